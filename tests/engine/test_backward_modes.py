"""Several backward passes over one region: retain_graph, partial grads, inputs=, double backward.

Each test runs the same sequence of backward calls on an eager graph and on a checkpointed one
and compares every gradient bitwise. Handles not unpacked in one pass must leave use counts and
caches right for the next (DESIGN.md §3, multiple consumers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import CALLS, counted_exp, leaf, make_model, save_matmuls

import ckpt_graph as cg

POLICIES = ["recompute_all", "must_save_all", save_matmuls]
POLICY_IDS = ["recompute_all", "must_save_all", "save_matmuls"]


def _model(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two outputs sharing intermediates; random op included (RNG replay across passes)."""
    h = (x @ w).tanh()
    h = torch.nn.functional.dropout(h, 0.3, training=True)
    shared = h.exp() * x
    a = (shared.sin() * w).sum(1)
    b = (shared.cos() @ w).sigmoid()
    return a, b


Body = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], list[torch.Tensor]]


def _compare(body: Body, policy: Any) -> None:
    """Run ``body(a, b, x, w)`` (backward calls) on eager and checkpointed graphs, compare."""
    results = []
    for ckpt in (False, True):
        x, w = leaf(4, 4), leaf(4, 4, seed=1)
        torch.manual_seed(0)
        scope = cg.save_recompute_policy(policy) if ckpt else contextlib.nullcontext()
        with scope:
            a, b = _model(x, w)
        got = body(a, b, x, w)
        results.append((got, x.grad, w.grad, torch.get_rng_state()))
    (ref, rx, rw, rrng), (out, cx, cw, crng) = results
    assert len(ref) == len(out)
    for i, (p, q) in enumerate(zip(ref, out, strict=True)):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda m, i=i: f"result {i}: {m}")
    for name, p, q in (("x.grad", rx, cx), ("w.grad", rw, cw)):
        assert (p is None) == (q is None), name
        if p is not None:
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(rrng, crng), "RNG state after the backward passes differs"


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_retain_graph_second_backward_accumulates(policy: Any) -> None:
    def body(
        a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor
    ) -> list[torch.Tensor]:
        loss = a.sum() + b.sum()
        loss.backward(retain_graph=True)
        first = [x.grad.clone(), w.grad.clone()]
        loss.backward()
        assert torch.equal(x.grad, 2 * first[0])
        return first

    _compare(body, policy)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_retain_graph_three_passes_and_different_seeds(policy: Any) -> None:
    def body(
        a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor
    ) -> list[torch.Tensor]:
        outs = []
        for k in range(3):
            ga = torch.full_like(a, 1.0 + k)
            gb = torch.linspace(-1, 1, b.numel(), dtype=b.dtype).view_as(b) * (k + 1)
            torch.autograd.backward([a, b], [ga, gb], retain_graph=k < 2)
            outs.append(x.grad.clone())
        return outs

    _compare(body, policy)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_autograd_grad_on_part_then_rest(policy: Any) -> None:
    def body(
        a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor
    ) -> list[torch.Tensor]:
        ga = torch.autograd.grad(a.sum(), [x, w], retain_graph=True)
        gb = torch.autograd.grad(b.sum(), [x, w])
        return [*ga, *gb]

    _compare(body, policy)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_autograd_grad_on_part_of_inputs_then_full_backward(policy: Any) -> None:
    def body(
        a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor
    ) -> list[torch.Tensor]:
        loss = (a * 2).sum() + b.sum()
        (gw,) = torch.autograd.grad(
            loss, [w], retain_graph=True
        )  # unpacks only part of the handles
        (gb,) = torch.autograd.grad(b.sum(), [x], retain_graph=True)
        loss.backward()
        return [gw, gb]

    _compare(body, policy)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_autograd_grad_without_retain_on_one_output(policy: Any) -> None:
    # The first output's own branch is freed; the second output's pass still works where eager does.
    def body(
        a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor
    ) -> list[torch.Tensor]:
        (g1,) = torch.autograd.grad(b.sum(), [w], retain_graph=True)
        (g2,) = torch.autograd.grad(b.sum() * 3, [x])
        return [g1, g2]

    _compare(body, policy)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_backward_inputs_subset(policy: Any) -> None:
    def body(
        a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor
    ) -> list[torch.Tensor]:
        loss = a.sum() + b.sum()
        loss.backward(inputs=[w], retain_graph=True)
        assert x.grad is None
        wg = w.grad.clone()
        loss.backward(inputs=[x])
        return [wg]

    _compare(body, policy)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_double_backward_create_graph(policy: Any) -> None:
    def body(
        a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor
    ) -> list[torch.Tensor]:
        loss = a.sum() + (b * b).sum()
        gx, gw = torch.autograd.grad(loss, [x, w], create_graph=True)
        penalty = (gx * gx).sum() + (gw.sin() * w).sum()
        penalty.backward()
        return [gx.detach(), gw.detach()]

    _compare(body, policy)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_triple_backward(policy: Any) -> None:
    x, xe = leaf(3), leaf(3)
    outs = []
    for t, scope in ((xe, contextlib.nullcontext()), (x, cg.save_recompute_policy(policy))):
        with scope:
            y = (t.sin() * t.exp()).sum()
        (g1,) = torch.autograd.grad(y, [t], create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), [t], create_graph=True)
        (g3,) = torch.autograd.grad(g2.sum(), [t])
        outs.append((g1.detach(), g2.detach(), g3))
    for p, q in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_grad_of_grad_through_region_only(policy: Any) -> None:
    # Double backward where the first backward runs inside the region and the second outside.
    x, xe = leaf(4), leaf(4)
    with cg.save_recompute_policy(policy):
        y = (x.tanh() ** 3).sum()
        (g,) = torch.autograd.grad(y, [x], create_graph=True)
    g.pow(2).sum().backward()
    ye = (xe.tanh() ** 3).sum()
    (ge,) = torch.autograd.grad(ye, [xe], create_graph=True)
    ge.pow(2).sum().backward()
    torch.testing.assert_close(g, ge, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_zoo_retain_graph_and_partial(name: str) -> None:
    model, inp = make_model(name)
    results = []
    for ckpt in (False, True):
        m, _ = make_model(name)
        torch.manual_seed(0)
        scope = cg.save_recompute_policy("recompute_all") if ckpt else contextlib.nullcontext()
        with scope:
            out = m(inp.detach().clone().requires_grad_(inp.requires_grad))
        params = list(m.parameters())
        first = torch.autograd.grad(out.sum(), params[:2], retain_graph=True)
        out.pow(2).sum().backward(retain_graph=True)
        out.sum().backward()
        results.append([*first, *(p.grad for p in params)])
    del model
    for p, q in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_recompute_count_per_pass() -> None:
    # Each backward pass recomputes a needed value once, however many passes there are.
    x = leaf(3)
    with cg.save_recompute_policy("recompute_all"):
        y = counted_exp(x.sin()).cos().sum()
    assert CALLS["counted_exp"] == 1
    y.backward(retain_graph=True)
    assert CALLS["counted_exp"] == 2
    y.backward(retain_graph=True)
    assert CALLS["counted_exp"] == 3
    torch.autograd.grad(y, [x])
    assert CALLS["counted_exp"] == 4


def test_second_backward_without_retain_graph_raises_like_eager() -> None:
    for scope in (contextlib.nullcontext(), cg.save_recompute_policy("recompute_all")):
        x = leaf(3)
        with scope:
            y = (x.sin() * x).sum()
        y.backward()
        with pytest.raises(RuntimeError, match="second time"):
            y.backward()
