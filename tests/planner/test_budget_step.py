"""One ``memory_budget`` object for a whole training step across several regions.

See Note [Step budget across regions] in ckpt_graph/planner/step_budget.py. Gradients are
accumulated into zeroed buffers, so that a step's measured peak is its activation memory.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import torch
from models import gpt_loss_per_block

import ckpt_graph as cg
from ckpt_graph.compare.architectures import GPT
from ckpt_graph.integrations.wrap import unwrap, wrap
from ckpt_graph.memory import measure
from ckpt_graph.planner.liveness import SimResult
from ckpt_graph.planner.memory_budget import MemoryBudget, StepPlan
from ckpt_graph.planner.records import Option, Seen
from ckpt_graph.planner.step_budget import choose

LAYERS = 6
Step = Callable[[GPT, torch.Tensor], None]


def _model() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(64, 64, LAYERS, 4, 32).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, torch.randint(0, 64, (8, 32))


def _plain_step(model: GPT, x: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad.zero_()  # type: ignore[union-attr]
    model(x).pow(2).mean().backward()


def _blocks_step(policy: MemoryBudget) -> Step:
    """Each block in a ``with`` block of its own, all with the same policy object."""

    def step(model: GPT, x: torch.Tensor) -> None:
        for p in model.parameters():
            p.grad.zero_()  # type: ignore[union-attr]
        gpt_loss_per_block(model, x, policy).backward()

    return step


@functools.cache
def _plain() -> tuple[int, list[torch.Tensor]]:
    model, x = _model()
    peak = measure(_plain_step, model, x).peak_bytes
    return peak, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _run(step: Step, model: GPT, x: torch.Tensor) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peak = measure(step, model, x).peak_bytes
    return peak, [str(w.message) for w in caught]


def _check_steps(step: Step, policy: MemoryBudget, fraction: float) -> StepPlan:
    plain, ref = _plain()
    model, x = _model()
    _run(step, model, x)  # first step: the online heuristic; its regions are planned after
    for _ in range(2):
        peak, warned = _run(step, model, x)
        assert warned == []
        torch.testing.assert_close([p.grad for p in model.parameters()], ref, rtol=0, atol=0)
        assert peak <= (fraction + 0.1) * plain, (peak / plain, fraction)
    report = policy.step_report()
    assert report is not None and report.regions == LAYERS
    return report


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_wrap_per_layer_regions_meet_a_fraction_of_the_step(fraction: float) -> None:
    # Before: each block was budgeted alone; at 0.3 the step peaked at 0.55x the plain step.
    policy = cg.policies.memory_budget(fraction)

    def step(model: GPT, x: torch.Tensor) -> None:
        wrap(model, policy)
        try:
            _plain_step(model, x)
        finally:
            unwrap(model)

    report = _check_steps(step, policy, fraction)
    assert report.feasible and report.predicted_peak_bytes <= report.budget_bytes
    assert report.graphs == 1  # identical blocks: one graph, one menu


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_several_with_blocks_share_one_budget(fraction: float) -> None:
    policy = cg.policies.memory_budget(fraction)
    report = _check_steps(_blocks_step(policy), policy, fraction)
    assert report.feasible


def test_later_regions_keep_more_and_identical_choices_share_a_plan() -> None:
    policy = cg.policies.memory_budget(0.4)
    model, x = _model()
    step = _blocks_step(policy)
    for _ in range(2):
        _run(step, model, x)
    reports = [policy.report(k) for k in range(LAYERS)]
    assert all(r is not None for r in reports)
    kept = [sum(k.nbytes for k in r.kept) for r in reports if r is not None]
    assert kept[-1] > kept[0]  # freed first in backward: the last block keeps more
    assert kept == sorted(kept)
    plans = {id(policy.planner.plan(k)) for k in range(LAYERS)}
    assert len(plans) < LAYERS  # blocks given the same menu entry share one plan
    assert all(r is not None and r.reuses >= 1 for r in reports)


def test_step_boundaries() -> None:
    policy = cg.policies.memory_budget(0.5)
    model, x = _model()
    step = _blocks_step(policy)
    _run(step, model, x)
    first = policy.step_report()
    assert first is not None and first.regions == LAYERS
    # Two forwards before one backward: one step of 2 x LAYERS regions.
    losses = [gpt_loss_per_block(model, x, policy) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # regions #6.. have no plan of their own
        sum(losses).backward()  # type: ignore[union-attr]
        report = policy.step_report()
    assert report is not None and report.regions == 2 * LAYERS
    # Gradient accumulation (forward + backward per micro-batch): steps of LAYERS regions.
    for _ in range(2):
        _run(step, model, x)
    report = policy.step_report()
    assert report is not None and report.regions == LAYERS


def _option(peak: int, kept: int, cost: int) -> Option:
    return Option(frozenset(), SimResult(peak, peak, kept, cost, 0, -1), "test")


def test_joint_choice_is_the_cheapest_that_fits() -> None:
    # Two identical regions, inputs of 10 bytes each. Menu: recompute (peak 50, keeps 0,
    # cost 9) or keep (peak 50, keeps 50, cost 0). Limit 115: keeping in both would need
    # 10 + 50 + 10 + 50 = 120 during the second region's backward; keeping only in the
    # second (freed first) fits: 10 + 0 + 10 + 50 = 70, and the first: 10 + 50 = 60.
    menu = [_option(50, 0, 9), _option(50, 50, 0)]
    graph = object()
    seen = [Seen(0, graph, 10), Seen(1, graph, 10)]  # type: ignore[arg-type]
    assert choose(seen, [menu, menu], 115) == [0, 1]
    assert choose(seen, [menu, menu], 120) == [1, 1]
    assert choose(seen, [menu, menu], 59) is None


def test_inputs_the_program_rebinds_inside_the_block_count() -> None:
    # ``h = block(h)`` inside the with block drops the caller's reference to the input
    # before the region exits: only the region's hold keeps it alive.
    policy = cg.policies.memory_budget(0.5)
    model, x = _model()
    step = _blocks_step(policy)
    _run(step, model, x)
    report = policy.step_report()
    assert report is not None
    assert report.input_bytes == LAYERS * 8 * 32 * 64 * 4  # each block's hidden state
