"""Holding values: ``kept_bytes`` and the kept value of each handle, set in one place.

See Note [Holding values] in ckpt_graph/engine/holding.py.
"""

from __future__ import annotations

from typing import Any

import torch

import ckpt_graph as cg
from ckpt_graph.engine import graph


def _kept_outputs(region: Any) -> list[graph.Handle]:
    # Decided kept: a value nothing reads may be freed already (``v * 2`` below), see Note
    # [Kept values live no longer than in eager]; ``kept_bytes`` counts the decisions.
    return [o for n in region.nodes for o in n.outputs if o is not None and o.kept]


def test_kept_op_outputs_count_once_views_and_inputs_not_at_all() -> None:
    x = torch.randn(8, 4, requires_grad=True)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x.sin()  # 128 bytes
        v = a[0]  # a view: its bytes are a's
        b = (v * 2).sum()  # 16 + 4 bytes
        kept = _kept_outputs(region)
    assert {o.reason for o in kept} == {graph.POLICY}
    assert region.kept_bytes == 128 + 16 + 4
    assert region.kept_bytes == sum(o.nbytes for o in kept if not o.is_view)
    b.backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad[0], x.detach()[0].cos() * 2, rtol=0, atol=0)


def test_a_tag_holds_and_lets_go() -> None:
    x = torch.randn(16, requires_grad=True)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x.sin()
        assert region.kept_bytes == 64
        cg.tag_with_policy(a, False)
        assert region.kept_bytes == 0 and region.lookup(a).value is None  # type: ignore[union-attr]
        cg.tag_with_policy(a, True)
        assert region.kept_bytes == 64 and region.lookup(a).reason == graph.TAG  # type: ignore[union-attr]
        y = a.cos().sum()
    y.backward()
    xd = x.detach()
    torch.testing.assert_close(x.grad, -xd.sin().sin() * xd.cos(), rtol=0, atol=0)


def test_new_version_of_an_overwritten_kept_value_is_counted_once() -> None:
    x = torch.randn(16, requires_grad=True)
    with cg.save_recompute_policy("must_save_all") as region:
        a = x.sin()  # kept, and nobody used it yet (sin saves its input)
        a.mul_(2)  # overwritten in place: the new version is held instead, same memory
        y = a.sum()
    old, new = region.nodes[0].outputs[0], region.nodes[1].outputs[0]
    assert old is not None and new is not None
    assert old.value is None and old.superseded
    assert new.reason == graph.INPLACE_ON_KEPT
    assert region.kept_bytes == 64 + 4
    y.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos(), rtol=0, atol=0)


def test_copy_before_a_write_counts_new_memory_for_inputs_only() -> None:
    x = torch.randn(16, requires_grad=True)
    buf = torch.randn(16)
    old = buf.clone()
    with cg.save_recompute_policy("recompute_all") as region:
        y = (x + buf).sin().sum()  # recomputing x + buf needs buf: the caller's memory
        assert region.kept_bytes == 0
        buf.add_(1)  # so the region copies it first: 64 new bytes it holds
        z = (x + buf).sin().sum()
    assert region.kept_bytes == 64
    (y + z).backward()
    xd = x.detach()
    torch.testing.assert_close(x.grad, (xd + old).cos() + (xd + buf).cos(), rtol=0, atol=0)
