"""A fraction budget measured (``check=True``): its reference, the step's peak without
checkpointing, is corrected by the first measured planned step with the memory outside the
regions and the loss's backward outside them (Note [Measured budget check] rule 4), and the
re-plan holds the kept values plus that loss within the budget, as a byte budget's does
(Note [Phases of a measured step]). ``"auto"`` and ``False`` leave fractions as they were:
of the simulated peak, not measured."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_budget_loss_outside import Model as LossOutsideModel

import ckpt_graph as cg
from ckpt_graph.memory import measure
from ckpt_graph.policies import MemoryBudget, memory_budget

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, WIDTH, TOKENS, BLOCKS = 512, 64, 512, 6


def Model() -> LossOutsideModel:
    """The loss-outside tests' model at this file's sizes."""
    return LossOutsideModel(VOCAB, VOCAB, WIDTH, BLOCKS)


def _setup() -> tuple[LossOutsideModel, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return (
        Model(),
        torch.randint(0, VOCAB, (2, TOKENS)),
        torch.randint(0, VOCAB, (2, TOKENS)),
    )


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _step(
    model: LossOutsideModel, x: torch.Tensor, y: torch.Tensor, policy: MemoryBudget | None
) -> Callable[[], None]:
    """A training step with the loss (and nothing else) after the policy's region."""

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        if policy is None:
            logits = model(x)
        else:
            with cg.save_recompute_policy(policy):
                logits = model(x)
        loss = _loss(logits, y)
        del logits
        loss.backward()

    return step


def _grads(model: LossOutsideModel) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _none_peak(
    model: LossOutsideModel, x: torch.Tensor, y: torch.Tensor
) -> tuple[int, list[torch.Tensor]]:
    """No checkpointing's measured step peak and gradients."""
    step = _step(model, x, y, None)
    step()
    return measure(step).peak_bytes, _grads(model)


def _planned(step: Callable[[], None], steps: int = 3) -> None:
    """Run ``steps`` steps with no warning: the heuristic's, the first plan's (measured),
    the re-plan's (measured)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(steps):
            step()


@pytest.mark.parametrize("fraction", [0.4, 0.5])
def test_a_measured_fraction_is_of_the_measured_peak_without_checkpointing(
    fraction: float,
) -> None:
    """The first plan holds ``fraction`` of the simulated peak without checkpointing
    (17.67 MiB), which leaves out the cross-entropy's 6 MiB after the region: that step
    measured 0.49x / 0.58x of no checkpointing's 21.30 MiB. The measured reference is none's
    measured peak (to the byte here), and the re-plan, with the loss's 6 MiB on top of its
    kept values, measures within ``fraction`` of it."""
    model, x, y = _setup()
    none, eager = _none_peak(model, x, y)
    policy = memory_budget(fraction, flops_per_byte=2.0, check=True)
    step = _step(model, x, y, policy)
    _planned(step)
    report = policy.report()
    assert not policy.checking
    check = policy.planner.check
    assert check.corrected  # the first planned step missed the corrected budget
    assert check.before_backward is not None and check.before_backward > 0
    peak = measure(step).peak_bytes
    torch.testing.assert_close(_grads(model), eager, rtol=0, atol=0)
    assert peak <= fraction * none, (peak / none, fraction)
    assert report is not None and report.feasible
    assert report.reference_bytes > report.plain_peak_bytes  # type: ignore[attr-defined]
    assert abs(report.reference_bytes - none) <= 0.01 * none, (report, none)  # type: ignore[attr-defined]
    assert report.budget_bytes == int(fraction * report.reference_bytes)  # type: ignore[attr-defined]
    text = str(report)
    assert f"{fraction:.0%} of the step's peak without checkpointing as the measured step" in text
    assert "within the budget" in text


@pytest.mark.parametrize("check", ["auto", False])
def test_unmeasured_fractions_are_of_the_simulated_peak(check: bool | str) -> None:
    """``"auto"`` and ``False`` do not measure a fraction: its budget stays ``fraction`` of
    the step's simulated peak without checkpointing, and the plan is the one ``check=True``
    makes before its measurement (which then plans again)."""
    model, x, y = _setup()
    policy = memory_budget(0.5, flops_per_byte=2.0, check=check)  # type: ignore[arg-type]
    measured = memory_budget(0.5, flops_per_byte=2.0, check=True)
    _planned(_step(model, x, y, policy), steps=4)
    _planned(_step(model, x, y, measured), steps=2)  # the first plan, its step not compared
    report, first = policy.report(), measured.planner.report(None)
    assert report is not None and first is not None
    assert report.measured_peak_bytes is None and report.reference_bytes == 0  # type: ignore[attr-defined]
    assert not policy.planner.check.learnt
    assert report.budget_bytes == int(0.5 * report.plain_peak_bytes)  # type: ignore[attr-defined]
    assert report.budget_bytes == first.budget_bytes
    assert [k.op_index for k in report.kept] == [k.op_index for k in first.kept]
    assert "50% of the step's simulated peak without checkpointing" in str(report)
    assert report.reuses == 3  # planned once: no re-plan


def test_a_measured_fraction_of_wrapped_blocks_plans_for_the_loss_outside() -> None:
    """Per-block regions (``cg.wrap``), the embedding, head and loss outside them: the joint
    plan's budget is of the corrected reference and its boundary holds the blocks' kept
    values and inputs plus the loss (rule 6 of Note [Step budget across regions])."""
    model, x, y = _setup()
    none, eager = _none_peak(model, x, y)
    policy = memory_budget(0.5, flops_per_byte=2.0, check=True)
    cg.wrap(model, policy)
    try:
        step = _step(model, x, y, None)  # the policy's regions are the wrapped blocks
        _planned(step, steps=4)  # the fourth step's first region compares the third
        assert not policy.checking
        peak = measure(step).peak_bytes
    finally:
        cg.unwrap(model)
    torch.testing.assert_close(_grads(model), eager, rtol=0, atol=0)
    assert peak <= 0.5 * none, peak / none
    report = policy.step_report()
    assert report is not None and report.feasible and report.regions == BLOCKS, report
    assert report.reference_bytes > report.plain_peak_bytes
    assert report.budget_bytes == int(0.5 * report.reference_bytes)
    assert "as the measured step corrects it" in str(report)
