"""The user-facing API: tags (``tag_with_policy``), several regions, the ``checkpoint`` form.

Gradients under checkpointing equal a run without it, bitwise (DESIGN.md §3); the shared
setup is in ``bitwise_cases.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitwise_cases import (
    POLICIES,
    _transient_values,  # noqa: F401 (an autouse fixture: it applies here)
)
from models import assert_same, check, leaf, run

import ckpt_graph as cg


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
@pytest.mark.parametrize("target", ["view", "input", "leaf_in_region", "output"])
def test_tags_keep_gradients_exact(policy: Any, target: str) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> Any:
        h = (x * w).exp()
        tagged = {"view": h[1:], "input": x, "leaf_in_region": w, "output": h}[target]
        cg.tag_with_policy(tagged, True)
        cg.tag_with_policy(h.sin(), False)
        return (h[1:].tanh() * h[:2]).sum() + h.cos().sum()

    def eager(x: torch.Tensor, w: torch.Tensor) -> Any:
        h = (x * w).exp()
        return (h[1:].tanh() * h[:2]).sum() + h.cos().sum()

    ref = run(eager, [leaf(3, 4), leaf(3, 4, seed=2)], None)
    got = run(fn, [leaf(3, 4), leaf(3, 4, seed=2)], policy)
    assert_same(ref, got)


# --------------------------------------------------------------------------- several regions


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_two_regions_alive_at_once(policy: Any) -> None:
    # Two micro-batches, each in its own region, backward in the opposite order.
    def fn(scope: Any, x: torch.Tensor, w: torch.Tensor) -> Any:
        with scope():
            a = (x[:2] * w).sin().exp()
        with scope():
            b = (x[2:] * w).cos().exp()
        b.sum().backward()
        return a

    check(fn, [leaf(4, 3), leaf(3, seed=2)], policy, scoped=True)


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_region_output_feeds_next_region(policy: Any) -> None:
    def fn(scope: Any, x: torch.Tensor, w: torch.Tensor) -> Any:
        h = x
        for _ in range(3):
            with scope():
                h = (h * w).sin().exp()
        return h

    check(fn, [leaf(4, 3), leaf(3, seed=2)], policy, scoped=True)


@pytest.mark.parametrize("policy", POLICIES, ids=["recompute_all", "must_save_all", "save_matmuls"])
def test_checkpoint_function_form(policy: Any) -> None:
    def body(x: torch.Tensor, w: torch.Tensor, *, scale: float) -> torch.Tensor:
        return (F.dropout(x.sin(), 0.2) * w * scale).exp()

    def with_checkpoint(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cg.checkpoint(body, x, w, policy=policy, scale=0.5)

    inputs = [leaf(3, 4), leaf(3, 4, seed=2)]
    ref = run(lambda x, w: body(x, w, scale=0.5), inputs, None)
    got = run(with_checkpoint, inputs, None)  # no outer region: checkpoint() opens its own
    assert_same(ref, got)

    def region_seen_inside() -> Any:
        with cg.save_recompute_policy() as region:
            return region

    with cg.save_recompute_policy("recompute_all") as outer:  # checkpoint() nests in an open one
        assert cg.checkpoint(region_seen_inside, policy=policy) is outer
