"""Tiny HuggingFace models built from configs (random init, no download), for the HF tests."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 96
SEQ = 64
BATCH = 4


def build(kind: str, attn: str = "sdpa", layers: int = 3) -> Any:
    """A small float32 ``kind`` model ("gpt2", "llama" or "bert") in train mode, dropout 0."""
    import transformers

    torch.manual_seed(0)
    common: dict[str, Any] = {"vocab_size": VOCAB, "use_cache": False}
    if kind == "gpt2":
        cfg: Any = transformers.GPT2Config(
            n_positions=SEQ,
            n_embd=64,
            n_layer=layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        cls: Any = transformers.GPT2LMHeadModel
    elif kind == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            **common,
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "bert":
        cfg = transformers.BertConfig(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            vocab_size=VOCAB,
        )
        cls = transformers.BertForMaskedLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = attn
    model = cls(cfg)
    model.train()
    return model


def batch(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def grads(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss(model, ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class Logits(torch.nn.Module):
    """An HF causal LM called with positional ids, returning its logits: the shape compiled
    tests need (the LM's own loss graph-breaks, so it stays outside)."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor) -> Any:
        return self.lm(input_ids=x).logits
