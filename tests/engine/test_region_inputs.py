"""Region inputs computed before the region: views of written bases, and inputs written
after the region (issue 21, items 2 and 8). Each program runs eagerly and under ckpt_graph
and must agree bit for bit."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg
from ckpt_graph import policies

Scope = Callable[[Any], contextlib.AbstractContextManager[Any]]


def _scope(checkpointed: bool, **options: Any) -> Scope:
    if checkpointed:
        return lambda policy: cg.save_recompute_policy(policy, **options)
    return lambda policy: contextlib.nullcontext()


def _grads(fn: Callable[[Scope], tuple[torch.Tensor, ...]], **options: Any) -> None:
    """Run ``fn`` eagerly and checkpointed (``options`` for the regions); its gradients
    must agree bit for bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # memory_budget's and cache_limit's warnings
        ref = fn(_scope(False))
        got = fn(_scope(True, **options))
    assert len(ref) == len(got)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def _leaves() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, w


# --------------------------------------------------------------------------- item 2
# An output of a multi-output view op (``unbind``) whose base was written after the view
# was made may only be used under no grad (eager raises "Output 0 of Unbind is a view and
# its base ... has been modified inplace" when autograd reads its history). The region read
# that history (``grad_fn``) to decide how to hold a new region input and raised where eager
# runs. See Note [Holding values], rule 4.


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_view_of_written_base_written_under_no_grad_in_the_region(policy: str) -> None:
    def fn(scope: Scope) -> tuple[torch.Tensor, ...]:
        x, w = _leaves()
        base = x * 1.0
        parts = base.unbind(0)
        base.scatter_(0, torch.tensor([[1, 0, 2, 3, 1, 0]]), x[:1] * 3)  # into the base
        with scope(policy):
            with torch.no_grad():
                parts[2].add_(1.0)  # a region input: a stale view of a multi-output op
            loss = torch.tanh(base @ w).sum()
        loss.backward()
        assert x.grad is not None and w.grad is not None
        return x.grad, w.grad

    _grads(fn)


def _bool_table(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return bool(ctx.op_index % 2)


def test_fuzzed_program_of_issue_21_item_2() -> None:
    """The program the fuzzer found: nested regions with offload, a bool-table policy and
    ``memory_budget(0.3)`` after an unbind and a ``scatter_`` into the unbind's base."""

    def fn(scope: Scope) -> tuple[torch.Tensor, ...]:
        v0, v1 = _leaves()
        gen = torch.Generator().manual_seed(1)
        v2, v3, v4, v5 = v0.sin(), v0.cos(), v0 * 3, v0.tanh()
        v6 = F.silu(v2)
        v7 = F.hardtanh(v4)
        v8 = v5.permute(1, 0)
        v9 = torch.add(v7, v7)
        v10 = torch.complex(v8, v8)
        v11 = torch.randn(4, 6, generator=gen, dtype=torch.float64)
        v12 = v9.unbind(0)
        v9.scatter_(0, torch.tensor([[1, 0, 2, 3, 1, 0]]), v11[:1])
        with scope(lambda ctx, out, op, *a, **k: CheckpointPolicy.PREFER_CPU_OFFLOAD):
            v14 = F.cross_entropy(v7, torch.tensor([0, 1, 2, 3]))
            with scope(_bool_table):
                v15 = v3.clone().fill_(0.5)
                with torch.no_grad():
                    v12[2].add_(v11[0])
            v17 = F.batch_norm(v0, None, None, training=True)
            with scope(policies.memory_budget(0.3)):
                v18 = torch.mm(v17, v1)
                v19 = torch.einsum("ij,jk->ik", v9, v1)
                v20 = v19[v19.nonzero(as_tuple=True)]
                v21 = torch.cumsum(v2, 1)
                a, b = v21.split(3, 1)
            loss = v14 + v18.sum() + v19.pow(2).sum() + v20.sum() + (a * b).sum()
            loss = loss + v15.sum() + v10.abs().sum() + v6.sum()
        loss.backward()
        assert v0.grad is not None and v1.grad is not None
        return v0.grad, v1.grad

    _grads(fn)


# --------------------------------------------------------------------------- item 8
# A region input written after the region, which eager never saved, is not needed while
# the value computed from it is held: it is read as it is (Note [Live forward tensors]).


def _input_written_after_the_region(policy: Any) -> Any:
    def fn(scope: Scope) -> tuple[torch.Tensor, ...]:
        x, w = _leaves()
        inp = x * 1.0  # a region input that requires grad
        with scope(policy):
            h0 = inp * 2.0  # mul by a number saves nothing: eager never saves inp
            h = torch.tanh(h0 @ w) + h0  # mm saves h0, which the program keeps
        with torch.no_grad():
            inp.add_(1)
        h.sum().backward()
        assert x.grad is not None and w.grad is not None
        return x.grad, w.grad

    return fn


@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_input_written_after_the_region_while_the_value_from_it_is_held(policy: str) -> None:
    _grads(_input_written_after_the_region(policy))


def test_input_written_after_the_region_with_a_bounded_cache() -> None:
    _grads(_input_written_after_the_region("recompute_all"), cache_limit=8)


def test_value_held_by_the_program_is_not_recomputed_as_an_input() -> None:
    x, w = _leaves()
    with cg.save_recompute_policy("recompute_all") as region:
        h0 = x.sin()
        h = torch.tanh(h0 @ w)  # tanh's result is dropped: recomputed from mm(h0, w)
        loss = h.sum()
    del h
    loss.backward()
    runs = {n.info.name: n.realized for n in region.nodes}
    assert runs["aten.sin.default"] == 0  # h0 is held: read as it is
    assert runs["aten.mm.default"] == 1
    xe, we = _leaves()
    torch.tanh(xe.sin() @ we).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, we.grad, rtol=0, atol=0)
