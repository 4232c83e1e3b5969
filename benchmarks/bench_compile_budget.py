"""``memory_budget(f)`` under torch.compile vs compile's own ``activation_memory_budget=f``.

Both plan on the same joint graph in inductor's partitioner: torch's knapsack alone, or
ckpt_graph's solver seeded with torch's answer (Note [memory_budget under torch.compile] in
ckpt_graph/planner/compile_solver.py). For each model and fraction: peak of one training step
(``ckpt_graph.memory.measure``), backward FLOPs (gradients, the same for every plan, plus
recompute; ``FlopCounterMode`` around backward), the largest gradient difference to compiled
without checkpointing, graph breaks (``torch._dynamo.explain``), what the solver chose, and
step time: the median of interleaved steps (the two plans alternate, in rotating order),
as a ratio to compile's own budget measured in the same run. Compile's budget holds only
while the config says so, so its compile and every one of its steps run inside
``torch._functorch.config.patch``; ckpt_graph's plan needs no setting.

Usage:
    python benchmarks/bench_compile_budget.py                       # writes results_compile_budget.md
    python benchmarks/bench_compile_budget.py --rounds 5 --out -    # print only
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_graph import policies
from ckpt_graph.integrations.wrap import wrap
from ckpt_graph.memory import measure

FRACTIONS = (0.3, 0.5, 0.7)
FLOPS_PER_BYTE = 4.0  # pinned, as in the tests


def _gpt() -> tuple[torch.nn.Module, tuple[Any, ...], str]:
    from ckpt_graph.compare.architectures import GPT

    torch.manual_seed(0)
    model = GPT(vocab=256, width=128, layers=4, heads=4, seq_len=64)
    return (
        model,
        (torch.randint(0, 256, (8, 64)),),
        "embedded GPT (4 blocks, width 128, 64 tokens, batch 8)",
    )


class _LM(torch.nn.Module):
    """transformers' GPT-2 with a positional input; the loss stays outside (it graph-breaks)."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor) -> Any:
        return self.lm(input_ids=x).logits


def _gpt2() -> tuple[torch.nn.Module, tuple[Any, ...], str]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=96,
        n_positions=64,
        n_embd=64,
        n_layer=3,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).train()
    return (
        _LM(model),
        (torch.randint(0, 96, (4, 64)),),
        "HF GPT-2 (3 layers, width 64, 64 tokens, batch 4)",
    )


def _step(
    model: torch.nn.Module, run: Callable[..., Any], inputs: tuple[Any, ...]
) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        run(*inputs).float().pow(2).mean().backward()

    return step


def _backward_flops(
    model: torch.nn.Module, run: Callable[..., Any], inputs: tuple[Any, ...]
) -> int:
    model.zero_grad(set_to_none=True)
    loss = run(*inputs).float().pow(2).mean()
    with FlopCounterMode(display=False) as mode:
        loss.backward()
    return int(mode.get_total_flops())


def _max_diff(model: torch.nn.Module, expected: list[torch.Tensor]) -> float:
    got = [p.grad for p in model.parameters()]
    return max(
        float((g - e).abs().max()) for g, e in zip(got, expected, strict=True) if g is not None
    )


class _Case:
    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        run: Callable[..., Any],
        inputs: tuple[Any, ...],
        scope: Callable[[], Any],
    ) -> None:
        self.name, self.model, self.run, self.inputs, self.scope = name, model, run, inputs, scope
        self.step = _step(model, run, inputs)
        self.times: list[float] = []

    def timed(self) -> None:
        with self.scope():
            start = time.perf_counter()
            self.step()
            self.times.append(time.perf_counter() - start)


def _measure_model(
    build: Callable[[], tuple[torch.nn.Module, tuple[Any, ...], str]], rounds: int
) -> tuple[str, list[dict[str, Any]]]:
    base, inputs, label = build()
    torch._dynamo.reset()
    plain = copy.deepcopy(base)
    _step(plain, torch.compile(plain), inputs)()
    expected = [p.grad.clone() for p in plain.parameters()]  # type: ignore[union-attr]
    plain_peak = measure(_step(plain, torch.compile(plain), inputs)).peak_bytes
    rows = []
    for f in FRACTIONS:
        policy = policies.memory_budget(f, flops_per_byte=FLOPS_PER_BYTE)
        torch._dynamo.reset()
        breaks = torch._dynamo.explain(wrap(copy.deepcopy(base), policy))(*inputs).graph_break_count
        torch._dynamo.reset()
        theirs = copy.deepcopy(base)

        def scope(f: float = f) -> Any:
            return functorch_config.patch(activation_memory_budget=f)

        with scope():
            t_run = torch.compile(theirs)
            torch_case = _Case("torch", theirs, t_run, inputs, scope)
            torch_case.step()
            torch_peak = measure(torch_case.step).peak_bytes
            torch_flops = _backward_flops(theirs, t_run, inputs)
            torch_case.step()
            torch_diff = _max_diff(theirs, expected)
        ours = wrap(copy.deepcopy(base), policy)
        o_run = torch.compile(ours)
        ours_case = _Case("ours", ours, o_run, inputs, contextlib.nullcontext)
        ours_case.step()
        ours_peak = measure(ours_case.step).peak_bytes
        ours_flops = _backward_flops(ours, o_run, inputs)
        ours_case.step()
        ours_diff = _max_diff(ours, expected)
        cases = [torch_case, ours_case]
        graphs = counters["stats"]["unique_graphs"]
        for r in range(rounds):
            for case in cases[r % 2 :] + cases[: r % 2]:
                case.timed()
        if counters["stats"]["unique_graphs"] != graphs:
            raise RuntimeError("a timed step recompiled: the timings would include compile time")
        reports = policy.compile_solver().reports
        chosen = (
            ", ".join(
                f"{len(rep.torch_answer.recomputed)}->{len(rep.chosen.recomputed)} of {rep.candidates}"
                for rep in reports
            )
            or "not asked"
        )
        rows.append(
            {
                "fraction": f,
                "plain_peak": plain_peak,
                "torch_peak": torch_peak,
                "ours_peak": ours_peak,
                "torch_flops": torch_flops,
                "ours_flops": ours_flops,
                "torch_diff": torch_diff,
                "ours_diff": ours_diff,
                "breaks": breaks,
                "chosen": chosen,
                "time_ratio": statistics.median(ours_case.times)
                / statistics.median(torch_case.times),
                "torch_ms": 1e3 * statistics.median(torch_case.times),
            }
        )
    return label, rows


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import logging

        level = logging.getLogger("torch._dynamo").level
        logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
        try:
            yield
        finally:
            logging.getLogger("torch._dynamo").setLevel(level)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timed steps per plan")
    parser.add_argument("--models", default="gpt,gpt2", help="comma-separated: gpt, gpt2")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).with_name("results_compile_budget.md")),
        help="markdown output ('-': print only)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on shared cores)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"gpt": _gpt, "gpt2": _gpt2}
    lines = [
        "# memory_budget(f) under torch.compile vs activation_memory_budget=f (inductor, CPU)",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved steps per plan",
        "",
    ]
    with _quiet():
        for key in args.models.split(","):
            label, rows = _measure_model(builds[key], args.rounds)
            lines += [
                f"## {label}",
                "",
                "| f | peak MiB: no ckpt / torch f / memory_budget(f) | backward GFLOP: torch / ours | "
                "max grad diff: torch / ours | breaks | recomputed candidates torch->ours | "
                "step time ours / torch (torch ms) |",
                "|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                lines.append(
                    f"| {r['fraction']} | {r['plain_peak'] / 2**20:.2f} / {r['torch_peak'] / 2**20:.2f} / "
                    f"{r['ours_peak'] / 2**20:.2f} | {r['torch_flops'] / 1e9:.4f} / {r['ours_flops'] / 1e9:.4f} | "
                    f"{r['torch_diff']:.1e} / {r['ours_diff']:.1e} | {r['breaks']} | {r['chosen']} | "
                    f"{r['time_ratio']:.3f}x ({r['torch_ms']:.1f}) |"
                )
            lines.append("")
            print("\n".join(lines[-len(rows) - 5 :]), flush=True)
    text = "\n".join(lines)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
