"""Train a tiny HuggingFace model with ckpt_graph as its gradient checkpointing (CPU, under a minute).

The model is built from a small config (random init, nothing downloaded) and learns a synthetic
task: continue an arithmetic sequence modulo the vocabulary (random start, random stride 1-3).
Only the first two tokens of a sequence are unpredictable, so the loss falls from chance level
(ln 64 = 4.16) to about 0.4 within the default 30 steps; the script prints both. ``--mode
enable`` turns on the
model's own gradient checkpointing with ckpt_graph regions (one region per decoder layer);
``--mode wrap`` uses ``ckpt_graph.wrap`` instead (any nn.Module); ``--mode none`` trains without
checkpointing. At the end the script measures the peak memory of one training step with and
without checkpointing.

Needs ``pip install transformers`` (and optionally ``tqdm`` for the progress bar).

Run:
    python examples/train_hf.py --model llama --steps 30
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ckpt_graph.integrations.wrap import unwrap, wrap
from ckpt_graph.memory import measure

VOCAB, SEQ = 64, 64


def build(kind: str) -> Any:
    import transformers

    # Special token ids inside the tiny vocabulary: transformers warns about the defaults (50256).
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "use_cache": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    if kind == "gpt2":
        cfg: Any = transformers.GPT2Config(
            n_positions=SEQ, n_embd=64, n_layer=4, n_head=4, **common
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        **common,
    )
    return transformers.LlamaForCausalLM(cfg)


def batches(batch: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Arithmetic sequences modulo VOCAB: from the third token on, each one is predictable."""
    positions = torch.arange(SEQ)
    while True:
        start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        yield (start + stride * positions) % VOCAB


def progress(steps: int) -> tuple[Iterable[int], Callable[[str], None]]:
    try:
        from tqdm import tqdm
    except ImportError:

        def show(text: str) -> None:
            print(text)

        return range(steps), show
    bar = tqdm(range(steps), desc="train")
    return bar, lambda text: bar.set_postfix_str(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "llama"], default="llama")
    parser.add_argument("--mode", choices=["enable", "wrap", "none"], default="enable")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build(args.model)
    model.train()
    if args.mode == "enable":
        from ckpt_graph.integrations import transformers as cg_hf

        cg_hf.enable(model, policy="recompute_all")
    elif args.mode == "wrap":
        wrap(model)  # the decoder layers (children of the ModuleList)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(args.batch, torch.Generator().manual_seed(1))

    def step(ids: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    steps, show = progress(args.steps)
    losses = []
    for i in steps:
        losses.append(step(next(data)))
        if isinstance(steps, range) and i % 10 != 9:
            continue
        show(f"step {i + 1} loss {losses[-1]:.3f}")
    last = sum(losses[-5:]) / len(losses[-5:])
    print(
        f"loss: {losses[0]:.3f} at step 1, {last:.3f} over the last 5 steps "
        f"(chance level ln({VOCAB}) = {math.log(VOCAB):.3f})"
    )

    ids = next(data)
    peak = measure(step, ids).peak_bytes
    if args.mode == "enable":
        from ckpt_graph.integrations import transformers as cg_hf

        cg_hf.disable(model)
    else:
        unwrap(model)
    plain = measure(step, ids).peak_bytes
    print(
        f"peak memory of one step: {peak / 2**20:.1f} MiB with --mode {args.mode}, "
        f"{plain / 2**20:.1f} MiB without checkpointing ({peak / plain:.0%})"
    )


if __name__ == "__main__":
    main()
