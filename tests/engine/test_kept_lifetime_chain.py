"""A chain of recomputed residual sums that nothing saves holds no kept value eager frees.

``h = h + f(h)`` in a loop, where ``f``'s kept output feeds only the sum and nothing saves
the sums: the program holds the chain's last sum, computed from every kept value through
recomputed ones. Holding those values for the sum (in case something saves it later) holds
more bytes than keeping the sum itself would, so they go when the program drops them, and a
later save of the sum keeps the sum (what eager saves). See Note [Kept values live no
longer than in eager], rule 2. Gradients are compared with eager, bitwise; peaks are
measured with ``ckpt_graph.memory.measure``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import leaf

import ckpt_graph as cg
from ckpt_graph.engine import graph
from ckpt_graph.memory import measure
from ckpt_graph.planner.memory_budget import memory_budget

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten
LAYERS = 8


def keep_mm_and_pad() -> Any:
    """Keeps the matmuls' outputs (which only the sums read) and the padded copies the
    matmuls save: nothing recomputes a sum for backward."""
    return cg.policies.save_ops(aten.mm, aten.constant_pad_nd)


def chain(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """``h = h + 0.5 * (pad(h) @ w)`` per layer: the matmul saves the padded copy, a
    multiplication by a number saves nothing, so no op saves a sum."""
    h = x * 1.0
    for w in ws:
        h = h + (F.pad(h, (0, 0)) @ w) * 0.5
    return h


def inputs() -> tuple[torch.Tensor, list[torch.Tensor]]:
    return leaf(64, 32), [leaf(32, 32, seed=k + 1) for k in range(LAYERS)]


def eager_grads(
    fn: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor],
) -> list[torch.Tensor]:
    x, ws = inputs()
    fn(x, ws).sum().backward()
    return [t.grad for t in (x, *ws)]  # type: ignore[misc]


def run_step(
    fn: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor],
    x: torch.Tensor,
    ws: list[torch.Tensor],
    policy: Any,
) -> None:
    for t in (x, *ws):
        t.grad = None
    if policy is None:
        y = fn(x, ws)
    else:
        with cg.save_recompute_policy(policy):
            y = fn(x, ws)
    y.sum().backward()


def test_kept_values_behind_an_unsaved_chain_go_when_the_program_drops_them() -> None:
    x, ws = inputs()
    with cg.save_recompute_policy(keep_mm_and_pad()) as region:
        h = chain(x, ws)
        mms = [n.outputs[0] for n in region.nodes if n.op is aten.mm.default]
        assert len(mms) == LAYERS and all(o.reason is graph.POLICY for o in mms)
        # Before, every matmul output stayed while the program held the last sum.
        assert all(o.value is None for o in mms)
    h.sum().backward()
    assert sum(n.realized for n in region.nodes) == 0
    torch.testing.assert_close([x.grad, *(w.grad for w in ws)], eager_grads(chain), rtol=0, atol=0)


def test_an_unsaved_chain_peaks_at_no_checkpointing() -> None:
    x, ws = inputs()
    plain = measure(run_step, chain, x, ws, None).peak_bytes
    want = [t.grad.clone() for t in (x, *ws)]  # type: ignore[union-attr]
    peak = measure(run_step, chain, x, ws, keep_mm_and_pad()).peak_bytes
    torch.testing.assert_close([t.grad for t in (x, *ws)], want, rtol=0, atol=0)
    # Holding each matmul output (16,384 bytes) while the last sum lived: 311,368 bytes
    # against 213,056 (measured 2026-11-28).
    assert peak == plain, (peak, plain)


def test_memory_budget_one_on_an_unsaved_chain_peaks_at_no_checkpointing() -> None:
    x, ws = inputs()
    plain = measure(run_step, chain, x, ws, None).peak_bytes
    want = [t.grad.clone() for t in (x, *ws)]  # type: ignore[union-attr]
    policy = memory_budget(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first step plans
        run_step(chain, x, ws, policy)
    for _ in range(2):
        peak = measure(run_step, chain, x, ws, policy).peak_bytes
        torch.testing.assert_close([t.grad for t in (x, *ws)], want, rtol=0, atol=0)
        assert peak == plain, (peak, plain)
    report = policy.report()
    assert report is not None and report.predicted_recompute_flops == 0


def saved_after(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """The chain, then a LayerNorm that saves its last sum."""
    h = chain(x, ws)
    return F.layer_norm(h, (h.shape[-1],)) * 2


def test_a_chain_value_saved_later_is_kept_itself() -> None:
    x, ws = inputs()
    with cg.save_recompute_policy(keep_mm_and_pad()) as region:
        y = saved_after(x, ws)
    (ln,) = [n for n in region.nodes if n.op is aten.native_layer_norm.default]
    last = ln.inputs[0]
    # The kept values its recomputation read were freed: it keeps the tensor autograd
    # saves, as eager does, and backward recomputes no sum (only the LayerNorm's
    # statistics, which the policy recomputes).
    assert last.reason is graph.SAVED_AFTER_INPUTS_FREED
    y.sum().backward()
    assert [n.op for n in region.nodes if n.realized] == [aten.native_layer_norm.default]
    torch.testing.assert_close(
        [x.grad, *(w.grad for w in ws)], eager_grads(saved_after), rtol=0, atol=0
    )
    plain = measure(run_step, saved_after, x, ws, None).peak_bytes
    assert measure(run_step, saved_after, x, ws, keep_mm_and_pad()).peak_bytes <= plain


@pytest.mark.parametrize("retain", [False, True])
def test_a_short_chain_saved_later_recomputes_from_the_kept_value(retain: bool) -> None:
    # One sum from a kept value of the same size: holding it costs no more than keeping the
    # sum, so it stays and backward recomputes the sum, as the policy asked.
    x, ws = inputs()

    def one(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
        h = x + (F.pad(x, (0, 0)) @ ws[0]) * 0.5
        return F.layer_norm(h, (h.shape[-1],))

    with cg.save_recompute_policy(keep_mm_and_pad()) as region:
        y = one(x, ws)
    (ln,) = [n for n in region.nodes if n.op is aten.native_layer_norm.default]
    assert ln.inputs[0].reason is None
    want = eager_grads(one)
    for _ in range(2 if retain else 1):
        for t in (x, *ws):
            t.grad = None
        y.sum().backward(retain_graph=retain)
        torch.testing.assert_close([x.grad, ws[0].grad], want[:2], rtol=0, atol=0)
    (add,) = [n for n in region.nodes if n.op is aten.add.Tensor]
    assert add.realized == (2 if retain else 1)


def viewed(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """The chain through views of the sums, its last sum saved through a view."""
    h = x * 1.0
    for w in ws:
        h = (h + (F.pad(h, (0, 0)) @ w) * 0.5).view(-1).view(64, 32)
    return F.layer_norm(h.t(), (64,)).sin()


def in_place(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """The chain summed in place, its result saved."""
    h = x * 1.0
    for w in ws:
        h.add_((F.pad(h, (0, 0)) @ w) * 0.5)
    return h.sin()


@pytest.mark.parametrize("fn", [viewed, in_place], ids=["views", "in_place"])
@pytest.mark.parametrize("retain", [False, True])
def test_chains_through_views_and_in_place_sums_are_exact(
    fn: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor], retain: bool
) -> None:
    x, ws = inputs()
    with cg.save_recompute_policy(keep_mm_and_pad()):
        y = fn(x, ws)
    want = eager_grads(fn)
    for _ in range(2 if retain else 1):
        for t in (x, *ws):
            t.grad = None
        y.sum().backward(retain_graph=retain)
        torch.testing.assert_close([x.grad, *(w.grad for w in ws)], want, rtol=0, atol=0)
    plain = measure(run_step, fn, x, ws, None).peak_bytes
    assert measure(run_step, fn, x, ws, keep_mm_and_pad()).peak_bytes <= plain


def test_a_second_region_reading_the_chain_is_exact() -> None:
    x, ws = inputs()

    def two(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
        h = chain(x, ws[:4])
        return F.layer_norm(chain(h, ws[4:]), (32,))

    with cg.save_recompute_policy(keep_mm_and_pad()):
        h = chain(x, ws[:4])
    with cg.save_recompute_policy(keep_mm_and_pad()):
        y = F.layer_norm(chain(h, ws[4:]), (32,))
    del h
    y.sum().backward()
    torch.testing.assert_close([x.grad, *(w.grad for w in ws)], eager_grads(two), rtol=0, atol=0)


def test_a_kept_value_stays_for_a_value_it_is_no_bigger_than() -> None:
    # ``a`` (kept) and ``b`` (kept) are read by the recomputed sum ``s``. While ``a``'s
    # tensor lives, holding ``b`` for ``s`` costs 256 bytes, no more than ``s``: it stays.
    # Once the program dropped both, holding them (512 bytes) costs more than keeping ``s``
    # if something saves it: both go.
    x = leaf(4, 8)
    with cg.save_recompute_policy(lambda ctx, out, op, *a, **k: op is aten.mul.Tensor) as region:
        a = x * 2  # kept; nothing saves it
        b = x * 3  # likewise
        s = a + b  # recomputed
        ha, hb = region.lookup(a), region.lookup(b)
        assert ha is not None and hb is not None
        del b
        assert hb.value is not None  # a's tensor lives: holding b costs 256 bytes
        del a
        assert ha.value is None and hb.value is None
        y = s.sin()  # saves s: kept itself
        hs = region.lookup(s)
        assert hs is not None and hs.reason is graph.SAVED_AFTER_INPUTS_FREED
    del s
    y.sum().backward()
    x2 = x.detach().requires_grad_(True)
    (x2 * 2 + x2 * 3).sin().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
