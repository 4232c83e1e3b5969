"""Regions beside torch features: autocast, no-grad in backward, dispatch modes, torch's
checkpoint, save_on_cpu, tensor hooks, vmap, leaves made in a region, custom autograd Functions.

Gradients under checkpointing equal a run without it, bitwise (DESIGN.md §3); the shared
setup is in ``bitwise_cases.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitwise_cases import (
    POLICIES,
    _transient_values,  # noqa: F401 (an autouse fixture: it applies here)
)
from models import assert_same, check, leaf, run
from torch import nn

import ckpt_graph as cg

# --------------------------------------------------------------------------- interplay with torch features


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_backward_under_autocast_and_no_grad(policy: Any) -> None:
    # Recompute runs the recorded (already cast) aten calls with autocast off, whatever the
    # caller of backward has enabled.
    def fn(scope: Any, m: nn.Module, x: torch.Tensor) -> Any:
        with scope():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = m(x).relu()
            out = (h.float() * x[:, :4]).sin()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.autograd.backward([out], [torch.ones_like(out)], retain_graph=True)
        total = out.sum()
        with torch.no_grad():
            total.backward()
        return out.detach()

    check(fn, [_autocast_mlp(), leaf(5, 8, dtype=torch.float32)], policy, scoped=True)


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_user_dispatch_mode_around_region(policy: Any) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    def fn(scope: Any, x: torch.Tensor, w: torch.Tensor) -> Any:
        with FlopCounterMode(display=False):
            with scope():
                y = ((x @ w).sin() @ w).exp()
            y.sum().backward()
        return y.detach()

    check(fn, [leaf(3, 4), leaf(4, 4, seed=2)], policy, scoped=True)


def _inner_block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (F.dropout(a.sin(), 0.3) * b).exp().tanh()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_torch_checkpoint_inside_region(policy: Any, reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(_inner_block, x.cos() * w, w, use_reentrant=reentrant).sin()

    check(fn, [leaf(3, 4), leaf(3, 4, seed=2)], policy)


def test_nested_block_inside_torch_checkpoint_inside_region() -> None:
    """See Note [Foreign saved-tensor hooks]."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def wrapped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with cg.save_recompute_policy("recompute_all"):
            return _inner_block(a, b)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(wrapped, x.cos(), w, use_reentrant=False).sin()

    ref = run(
        lambda x, w: torch_checkpoint(_inner_block, x.cos(), w, use_reentrant=False).sin(),
        [leaf(3, 4), leaf(3, 4, seed=2)],
    )
    assert_same(ref, run(fn, [leaf(3, 4), leaf(3, 4, seed=2)], "recompute_all"))


@pytest.mark.parametrize("outer", [False, True], ids=["no_outer_region", "outer_region"])
def test_torch_checkpoint_with_ops_around_a_nested_block(outer: bool) -> None:
    """torch's checkpoint saves the ops outside the block itself, the block's go to ckpt_graph;
    torch's recompute (in backward) finds the same number of saved tensors as its forward."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def wrapped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = a.exp()  # saved by torch's checkpoint
        with cg.save_recompute_policy("recompute_all"):
            h = _inner_block(a, b)
        return h * a

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(wrapped, x.cos(), w, use_reentrant=False).sin()

    ref = run(fn, [leaf(3, 4), leaf(3, 4, seed=2)])
    got = run(fn, [leaf(3, 4), leaf(3, 4, seed=2)], "recompute_all" if outer else None)
    assert_same(ref, got)


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_nested_block_inside_save_on_cpu_inside_region(policy: str) -> None:
    """The nested block's saves go to the region, not to the hooks pushed in between."""

    def fn(scope: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with scope() as region:
            h = x.cos()
            with torch.autograd.graph.save_on_cpu():
                inner = (
                    cg.save_recompute_policy(policy)
                    if region is not None
                    else contextlib.nullcontext()
                )
                with inner:
                    h = _inner_block(h, w)
            return h.sin()

    _, got = check(fn, [leaf(3, 4), leaf(3, 4, seed=2)], scoped=True)
    region = got.region
    assert region is not None
    saved_by = {region.nodes[h.node_index].info.name for _, h in region.saved if h.node_index >= 0}
    assert {"aten.exp.default", "aten.tanh.default"} <= saved_by  # inside the nested block


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_tensor_hooks_and_vmap_in_region(policy: Any) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = (x * w).exp()
        h.register_hook(lambda g: g * 2)
        v = torch.vmap(lambda a, b: (a * b).sin().exp())(h, w)
        return (v * h).sin()

    check(fn, [leaf(3, 4), leaf(3, 4, seed=2)], policy)


# --------------------------------------------------------------------------- leaves created in region


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_leaf_created_in_region(policy: Any) -> None:
    def fn(x: torch.Tensor) -> Any:
        w = torch.ones(4, dtype=x.dtype, requires_grad=True)
        b = torch.full((3, 1), 0.5, dtype=x.dtype).requires_grad_()
        out = ((x.sin() * w + b) * w).exp()
        return out, w, b  # w and b are leaves: their .grad is compared, not backpropagated

    ref, _got = check(fn, [leaf(3, 4)], policy)
    assert ref.grads[1] is not None and ref.grads[2] is not None


# --------------------------------------------------------------------------- custom autograd.Function


class ScaledExp(torch.autograd.Function):
    """exp(x) * w, saving an input and its own output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = x.exp()
        out = e * w
        ctx.save_for_backward(x, w, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w, out = ctx.saved_tensors
        return g * x.exp() * w, g * (out / w)


class SortedSquare(torch.autograd.Function):
    """(sorted x)^2 with a non-differentiable index output saved for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vals, idx = x.sort(dim=-1)
        ctx.save_for_backward(vals, idx)
        ctx.mark_non_differentiable(idx)
        return vals * vals, idx

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _gi: Any) -> torch.Tensor:
        vals, idx = ctx.saved_tensors
        return torch.zeros_like(g).scatter(-1, idx, 2 * vals * g)


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_custom_autograd_function(policy: Any) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> Any:
        h = ScaledExp.apply(x.sin(), w.cos())
        sq, idx = SortedSquare.apply(h * 2)
        return (sq * h).tanh(), idx

    check(fn, [leaf(3, 4), leaf(3, 4, seed=2)], policy)


# --------------------------------------------------------------------------- autocast


def _autocast_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_autocast_inside_region(policy: Any) -> None:
    def fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = m(x)
            h = (h * h).softmax(-1)
        return h.float().sin()

    ref, _ = check(fn, [_autocast_mlp(), leaf(5, 8, dtype=torch.float32)], policy)
    assert ref.outputs[0].dtype == torch.float32


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_region_inside_autocast(policy: Any) -> None:
    def fn(scope: Any, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with scope():
                h = m(x.cos())
            out = m[3](torch.ones(5, 16) * 0.5) + h  # after the region, still autocast
        return out.float().sin()

    check(fn, [_autocast_mlp(), leaf(5, 8, dtype=torch.float32)], policy, scoped=True)
