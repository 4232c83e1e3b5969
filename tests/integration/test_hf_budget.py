"""One ``memory_budget`` for a whole HF training step with a region per layer.

Tiny GPT-2 and Llama (6 layers, random init) with ``integrations.transformers.enable``: the
regions of a step are planned jointly (Note [Step budget across regions]). Gradients are
accumulated into zeroed buffers, so that a step's peak is its activation memory.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ckpt_graph import policies
from ckpt_graph.memory import measure
from ckpt_graph.planner.memory_budget import MemoryBudget

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (pip install transformers)"
)

from ckpt_graph.integrations import transformers as cg_hf  # noqa: E402

from .hf_models import batch, build, loss  # noqa: E402

LAYERS = 6
BISECT_STEPS = 5


def _step(model: Any, ids: torch.Tensor) -> None:
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    loss(model, ids).backward()


def _grads(model: Any) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _flops(model: Any, ids: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        _step(model, ids)
    return counter.get_total_flops()


@functools.cache
def _plain(kind: str) -> tuple[int, list[torch.Tensor], int]:
    """Peak bytes, gradients and FLOPs of a step without checkpointing."""
    model, ids = build(kind, layers=LAYERS), batch()
    _step(model, ids)  # allocates the gradient buffers
    peak = measure(_step, model, ids).peak_bytes
    return peak, _grads(model), _flops(model, ids)


def _quiet_step(model: Any, ids: torch.Tensor) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peak = measure(_step, model, ids).peak_bytes
    return peak, [str(w.message) for w in caught if "ckpt_graph" in str(w.message)]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7])
def test_step_peak_meets_the_fraction_of_the_plain_step(kind: str, fraction: float) -> None:
    plain, ref, _ = _plain(kind)
    model, ids = build(kind, layers=LAYERS), batch()
    policy = policies.memory_budget(fraction)
    cg_hf.enable(model, policy)
    _quiet_step(model, ids)  # first step: online heuristic, then the step is planned
    step = None
    for _ in range(2):
        peak, warned = _quiet_step(model, ids)
        assert warned == []
        torch.testing.assert_close(_grads(model), ref, rtol=0, atol=0)
        # measured (before: 0.36 / 0.52-0.58 / 0.74): 0.24-0.26 / 0.50 / 0.70
        assert peak <= (fraction + 0.02) * plain, (peak / plain, fraction)
        step = policy.step_report()
        assert step is not None
        # the predicted peak leaves out the memory outside the regions (24 / 73 KiB)
        assert step.predicted_peak_bytes <= peak <= step.predicted_peak_bytes + 0.02 * plain
    assert step is not None and step.regions == LAYERS and step.graphs == 1
    assert step.feasible and step.predicted_peak_bytes <= step.budget_bytes


def _planned(
    model: Any, ids: torch.Tensor, budget: int | float
) -> tuple[MemoryBudget, int, list[str]]:
    """``memory_budget(budget)`` enabled on ``model``, its step's peak and warnings.

    The first step runs the online heuristic (the step is planned when the next starts);
    the second, planned, is measured.
    """
    policy = policies.memory_budget(budget)
    cg_hf.enable(model, policy)
    _quiet_step(model, ids)
    peak, warned = _quiet_step(model, ids)
    return policy, peak, warned


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_at_hf_checkpointing_peak_recomputes_less(kind: str) -> None:
    # Issue 13 section 2: at HF's own checkpointing peak (a budget whose measured step
    # peak is at most HF's), memory_budget recomputes fewer FLOPs. The budget in bytes is
    # HF's peak less what the step holds outside the regions, which the planner does not
    # model (Note [Step budget across regions] rule 5): learnt from a measured step, here
    # keeping everything. Should that not fit, the largest budget that does is bisected,
    # as benchmarks/bench_pareto.py finds a budget at a peak.
    # Before: GPT-2 peaked at 1.24x HF's (the last layer's forward held values backward
    # never reads: Note [Forward memory of a plan]).
    _, ref, plain_flops = _plain(kind)
    model, ids = build(kind, layers=LAYERS), batch()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _step(model, ids)
    hf_peak = measure(_step, model, ids).peak_bytes
    torch.testing.assert_close(_grads(model), ref, rtol=0, atol=0)
    hf_recompute = _flops(model, ids) - plain_flops
    model.gradient_checkpointing_disable()
    probe, probe_peak, _ = _planned(model, ids, 1.0)
    probe_step = probe.step_report()
    assert probe_step is not None
    outside = probe_peak - probe_step.predicted_peak_bytes
    assert 0 <= outside <= 0.01 * probe_peak
    lo, hi = 0, hf_peak - outside
    budget = hi
    policy, peak, warned = _planned(model, ids, hi)
    if peak > hf_peak:  # bisect below
        best = None
        for _ in range(BISECT_STEPS):
            mid = (lo + hi) // 2
            trial = _planned(model, ids, mid)
            if trial[1] <= hf_peak:
                lo, best, budget = mid, trial, mid
            else:
                hi = mid
        assert best is not None, "no budget measured within HF's peak"
        policy, peak, warned = best
        cg_hf.enable(model, policy)
    assert peak <= hf_peak, (budget, peak / hf_peak)
    assert warned == []
    step = policy.step_report()
    assert step is not None and step.feasible
    # the same memory outside the regions as keeping everything, within the simulator's
    # drift (measured: GPT-2 24 KiB, the tied embedding's gradient; Llama 73 KiB)
    assert step.predicted_peak_bytes <= peak
    assert peak - step.predicted_peak_bytes <= outside + 0.01 * peak
    peak, warned = _quiet_step(model, ids)
    assert warned == [] and peak <= hf_peak
    torch.testing.assert_close(_grads(model), ref, rtol=0, atol=0)
    recompute = _flops(model, ids) - plain_flops
    assert 0 < recompute < hf_recompute, (recompute, hf_recompute)
