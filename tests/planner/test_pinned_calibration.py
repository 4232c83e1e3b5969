"""Pinning the planner's FLOPs-per-byte ratio (issue 21 item 14).

See Note [Pinned calibration] in ckpt_graph/planner/cost_model.py: a plan made without
``flops_per_byte=`` must not depend on the machine or its load when the ratio is pinned, and
the test session pins it (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import ckpt_graph as cg
from ckpt_graph.compare.zoo import build_workload
from ckpt_graph.planner import budget_planner
from ckpt_graph.planner.cost_model import FLOPS_PER_BYTE_ENV, machine_flops_per_byte
from ckpt_graph.planner.memory_budget import MemoryBudget
from ckpt_graph.policies import memory_budget


def _plan(policy: MemoryBudget) -> tuple[list[int], int]:
    """Kept op indices and predicted recompute FLOPs of one planned step of a small GPT."""
    w = build_workload("gpt", layers=2, width=32, batch=2, seq_len=16)
    with cg.save_recompute_policy(policy):
        out = w.model(*w.inputs)
    w.loss(out).backward()
    report = policy.report()
    assert report is not None
    return sorted(k.op_index for k in report.kept), report.predicted_recompute_flops


def test_the_test_session_pins_the_ratio() -> None:
    assert os.environ[FLOPS_PER_BYTE_ENV] == "2.0"
    assert machine_flops_per_byte() == 2.0


def test_a_pinned_ratio_plans_without_calibrating(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> float:
        raise AssertionError("calibrated although the ratio is pinned")

    monkeypatch.setattr(
        "ckpt_graph.planner.cost_model.calibrated_flops_per_byte", refuse, raising=True
    )
    pinned = _plan(memory_budget(0.5))
    explicit = _plan(memory_budget(0.5, flops_per_byte=2.0))
    assert pinned == explicit


def test_an_explicit_ratio_wins_over_the_pinned_one(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []
    recorded = budget_planner.recorded_costs

    def spy(region: cg.Region, indices: object, flops_per_byte: float) -> dict[int, int]:
        seen.append(flops_per_byte)
        return recorded(region, indices, flops_per_byte)  # type: ignore[arg-type]

    monkeypatch.setattr(budget_planner, "recorded_costs", spy)
    monkeypatch.setenv(FLOPS_PER_BYTE_ENV, "3.5")
    _plan(memory_budget(0.5))
    _plan(memory_budget(0.5, flops_per_byte=0.5))
    assert seen[0] == 3.5 and seen[-1] == 0.5 and set(seen) == {3.5, 0.5}


@pytest.mark.parametrize("text", ["fast", "-1", "nan", "inf"])
def test_a_bad_pinned_ratio_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(FLOPS_PER_BYTE_ENV, text)
    with pytest.raises(cg.CkptGraphError, match=rf"CKPT_GRAPH_FLOPS_PER_BYTE={text!r}"):
        machine_flops_per_byte()


def test_unset_calibrates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FLOPS_PER_BYTE_ENV)
    assert 0.5 <= machine_flops_per_byte() <= 16.0  # the calibration's clamp
    torch.testing.assert_close(machine_flops_per_byte(), machine_flops_per_byte())  # cached
