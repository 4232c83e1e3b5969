"""Ops the recorder records and runs again: keyword arguments, multi-output ops, factory ops,
and other op semantics (no-grad blocks, ``.item()``, masks, scatters, embedding bags).

Gradients under checkpointing equal a run without it, bitwise (DESIGN.md §3); the shared
setup is in ``bitwise_cases.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitwise_cases import (
    POLICIES,
    Case,
    _post,
    _transient_values,  # noqa: F401 (an autouse fixture: it applies here)
)
from models import check, const_policy, leaf
from torch.utils.checkpoint import CheckpointPolicy

# --------------------------------------------------------------------------- kwargs-bearing ops


def _to_channels_last(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # view(-1) after permute is only valid if the copy really is channels_last.
    r = (x * 2).to(memory_format=torch.channels_last)
    return _post(r.permute(0, 2, 3, 1).view(-1), w.view(-1))


def _sdpa_attn_mask(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # attn_mask and scale are keyword-only in the aten schema; the mask is a region value.
    q = (x @ w).view(1, 2, 3, 2)
    mask = (m @ w).view(1, 1, 3, 4)[..., :3].tanh()
    return F.scaled_dot_product_attention(q, q.sin(), q.cos(), attn_mask=mask, scale=0.7).exp()


def _embedding_bag_weights(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    idx, offsets = torch.tensor([0, 2, 1, 2, 0]), torch.tensor([0, 2])
    psw = w.flatten()[:5].sin()
    return F.embedding_bag(idx, x.exp(), offsets, mode="sum", per_sample_weights=psw).sin()


KWARG_CASES: dict[str, Case] = {
    "add_alpha": (
        lambda x, y, w: _post(torch.add(x, y, alpha=2.5), w),
        [leaf(3, 4), leaf(3, 4, seed=1), leaf(3, 4, seed=2)],
    ),
    "sub_alpha": (
        lambda x, y, w: _post(torch.sub(x, y, alpha=-0.5), w),
        [leaf(3, 4), leaf(3, 4, seed=1), leaf(3, 4, seed=2)],
    ),
    "gelu_tanh": (
        lambda x, w: _post(F.gelu(x, approximate="tanh"), w),
        [leaf(3, 4), leaf(3, 4, seed=2)],
    ),
    "sum_dtype": (
        lambda x, w: _post(x.exp().sum(dim=0, dtype=torch.float32), w),
        [leaf(3, 4), leaf(4, seed=2, dtype=torch.float32)],
    ),
    "div_floor": (
        lambda x, y, w: _post(torch.div(x * 4, y.abs() + 0.5, rounding_mode="floor"), w),
        [leaf(3, 4), leaf(3, 4, seed=1), leaf(3, 4, seed=2)],
    ),
    "div_trunc": (
        lambda x, y, w: _post(torch.div(x * 4, y + 0.1, rounding_mode="trunc"), w),
        [leaf(3, 4), leaf(3, 4, seed=1), leaf(3, 4, seed=2)],
    ),
    "to_memory_format": (_to_channels_last, [leaf(2, 3, 2, 2), leaf(2, 2, 2, 3, seed=2)]),
    "to_dtype": (
        lambda x, w: _post(x.exp().to(torch.float32), w),
        [leaf(3, 4), leaf(3, 4, seed=2, dtype=torch.float32)],
    ),
    "softmax_dtype": (
        lambda x, w: _post(F.softmax(x, dim=1, dtype=torch.float32), w),
        [leaf(3, 4), leaf(3, 4, seed=2, dtype=torch.float32)],
    ),
    "clamp_min_max": (
        lambda x, w: _post(torch.clamp(x, min=-0.3, max=0.4), w),
        [leaf(3, 4), leaf(3, 4, seed=2)],
    ),
    "leaky_relu_slope": (
        lambda x, w: _post(F.leaky_relu(x, negative_slope=0.3), w),
        [leaf(3, 4), leaf(3, 4, seed=2)],
    ),
    "layer_norm_eps": (
        lambda x, w: _post(F.layer_norm(x, (4,), eps=0.5), w),
        [leaf(3, 4), leaf(3, 4, seed=2)],
    ),
    "addcmul_value": (
        lambda x, y, w: _post(torch.addcmul(x, y, w, value=0.3), w),
        [leaf(3, 4), leaf(3, 4, seed=1), leaf(3, 4, seed=2)],
    ),
    "cumsum_dim": (lambda x, w: _post(torch.cumsum(x, dim=1), w), [leaf(3, 4), leaf(3, 4, seed=2)]),
    "sdpa_attn_mask_scale": (_sdpa_attn_mask, [leaf(3, 4), leaf(4, 4, seed=1), leaf(3, 4, seed=2)]),
    "clamp_tensor_bounds": (
        lambda x, w: torch.clamp(x.exp(), min=w.sin() * 0.1, max=w.sin() * 0.1 + 1).sin(),
        [leaf(3, 4), leaf(3, 4, seed=2)],
    ),
    "normal_tensor_params": (
        lambda x, w: (torch.normal(x.sin(), w.exp() * 0.1) * x).sin(),
        [leaf(3, 4), leaf(3, 4, seed=2)],
    ),
    "embedding_bag_per_sample_weights": (_embedding_bag_weights, [leaf(3, 4), leaf(3, 4, seed=2)]),
    "rand_generator": (
        lambda x, g, w: _post(x * torch.rand(x.shape, generator=g, dtype=x.dtype), w),
        [leaf(3, 4), torch.Generator().manual_seed(7), leaf(3, 4, seed=2)],
    ),
}


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
@pytest.mark.parametrize("name", list(KWARG_CASES))
def test_kwargs_ops(name: str, policy: Any) -> None:
    fn, inputs = KWARG_CASES[name]
    check(fn, inputs, policy)


# --------------------------------------------------------------------------- multi-output ops


def _topk(x: torch.Tensor, w: torch.Tensor) -> Any:
    vals, idx = x.sin().topk(2, dim=1)
    return (vals * w).cos(), x.gather(1, idx) * 2, idx


def _max_dim(x: torch.Tensor, w: torch.Tensor) -> Any:
    vals, idx = (x * 3).max(dim=1)
    return (vals * w[:, 0]).sin(), idx


def _sort(x: torch.Tensor, w: torch.Tensor) -> Any:
    vals, idx = x.exp().sort(dim=1, descending=True)
    return _post(vals, w), x.gather(1, idx).exp(), idx


MULTI_CASES: dict[str, Case] = {
    "split": (
        lambda x, w: (lambda a, b: (a * b * w[:2]).sin())(*x.exp().split(2, dim=0)),
        [leaf(4, 3), leaf(4, 3, seed=2)],
    ),
    "split_sizes": (
        lambda x, w: (lambda a, b: _post(a.sum(0) * b.sum(0), w[0]))(*x.tanh().split([1, 3])),
        [leaf(4, 3), leaf(4, 3, seed=2)],
    ),
    "chunk": (
        lambda x, w: (lambda a, b, c: _post(a * b + c, w[:, :1]))(*x.sin().chunk(3, dim=1)),
        [leaf(4, 3), leaf(4, 3, seed=2)],
    ),
    "unbind": (
        lambda x, w: (lambda *rows: _post(rows[0] * rows[3] - rows[1] * rows[2], w[0]))(
            *x.exp().unbind(0)
        ),
        [leaf(4, 3), leaf(4, 3, seed=2)],
    ),
    "topk": (_topk, [leaf(4, 5), leaf(4, 2, seed=2)]),
    "max_dim": (_max_dim, [leaf(4, 5), leaf(4, 2, seed=2)]),
    "sort": (_sort, [leaf(4, 5), leaf(4, 5, seed=2)]),
    "std_mean": (
        lambda x, w: (lambda s, m: _post(s * m, w[0]))(*torch.std_mean(x.sin(), dim=0)),
        [leaf(4, 3), leaf(4, 3, seed=2)],
    ),
    "aminmax": (
        lambda x, w: (lambda lo, hi: _post(lo * hi, w[0]))(*torch.aminmax(x.exp() * x, dim=0)),
        [leaf(4, 3), leaf(4, 3, seed=2)],
    ),
}


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
@pytest.mark.parametrize("name", list(MULTI_CASES))
def test_multi_output_ops(name: str, policy: Any) -> None:
    fn, inputs = MULTI_CASES[name]
    check(fn, inputs, policy)


# --------------------------------------------------------------------------- factory ops


FACTORY_CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ones": lambda x: torch.ones(4, dtype=x.dtype),
    "zeros_like_plus": lambda x: torch.zeros_like(x) + 2,
    "arange": lambda x: torch.arange(4, dtype=x.dtype),
    "full": lambda x: torch.full((3, 4), 0.5, dtype=x.dtype),
    "eye": lambda x: torch.eye(4, dtype=x.dtype)[:3],
    "linspace": lambda x: torch.linspace(-1, 1, 4, dtype=x.dtype),
    "new_ones": lambda x: x.new_ones(3, 4) * 3,
    "randn": lambda x: torch.randn(3, 4, dtype=x.dtype),
    "empty_fill": lambda x: torch.empty(3, 4, dtype=x.dtype).fill_(1.25),
}


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
@pytest.mark.parametrize("name", list(FACTORY_CASES))
def test_factory_ops(name: str, policy: Any) -> None:
    make = FACTORY_CASES[name]
    check(lambda x: (x.sin() * make(x)).exp(), [leaf(3, 4)], policy)


# --------------------------------------------------------------------------- misc semantics


def _no_grad_inside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        s = (x * w).sum()  # recorded without grad; needed by the mul below
    return (x.sin() * s * w).exp()


def _detach_alias_mutated(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    d = h.detach()
    d.add_(1)  # mutates h's storage through a detached alias
    return h.sin()


def _item_scalar(x: torch.Tensor) -> torch.Tensor:
    s = x.detach().abs().sum().item()  # a Python float baked into the next op
    return (x.cos() * s).sin()


def _masked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.exp()
    m = h > 1.2
    return (torch.where(m, h * w, w.sin()).masked_fill(~m & (w > 0), 0.5) * h).sum(0)


def _scatter_index_put(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.sin() * 1
    idx = x.detach().argmax(dim=1, keepdim=True)
    h = h.scatter(1, idx, w[:, :1])
    h.index_put_((torch.tensor([0, 2]),), w[0, :4] * 2, accumulate=True)
    return (h * h).sum()


def _embedding_bag(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    idx = torch.tensor([0, 2, 1, 2, 0])
    offsets = torch.tensor([0, 2])
    return (F.embedding_bag(idx, x.exp(), offsets, mode="mean") * w[:2]).sin()


def _sdpa_dropout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q = (x @ w).view(1, 2, 3, 2)
    return F.scaled_dot_product_attention(q, q.sin(), q.cos(), dropout_p=0.4).exp()


MISC_CASES: dict[str, Case] = {
    "no_grad_inside": (_no_grad_inside, [leaf(3, 4), leaf(3, 4, seed=2)]),
    "detach_alias_mutated": (_detach_alias_mutated, [leaf(3, 4)]),
    "item_scalar": (_item_scalar, [leaf(3, 4)]),
    "where_masked_fill": (_masked, [leaf(3, 4), leaf(3, 4, seed=2)]),
    "scatter_index_put_": (_scatter_index_put, [leaf(3, 4), leaf(3, 4, seed=2)]),
    "embedding_bag": (_embedding_bag, [leaf(3, 4), leaf(3, 4, seed=2)]),
    "sdpa_dropout": (_sdpa_dropout, [leaf(3, 4), leaf(4, 4, seed=2)]),
}
OFFLOAD = [
    const_policy(CheckpointPolicy.MUST_CPU_OFFLOAD, "offload_all"),
    const_policy(CheckpointPolicy.PREFER_CPU_OFFLOAD, "prefer_offload_all"),
]


@pytest.mark.parametrize(
    "policy",
    POLICIES + OFFLOAD,
    ids=["recompute_all", "must_save_all", "save_matmuls", "offload", "prefer_offload"],
)
@pytest.mark.parametrize("name", list(MISC_CASES))
def test_misc_semantics(name: str, policy: Any) -> None:
    fn, inputs = MISC_CASES[name]
    check(fn, inputs, policy)
