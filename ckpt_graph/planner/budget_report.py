"""What ``memory_budget``'s ``report()`` and ``step_report()`` print: tables in MiB.

# Note [Budget reports]
# A report says what the budget covers, what the plan predicts against it and what the
# step measured (Note [Measured budget check]), per region. Before, ``report()`` printed
# the last region's plan alone with its share of a step's budget against its own
# activation bytes ("budget 35.528 MiB of 17.508 MiB", one region of six) and
# ``step_report()`` a dataclass in bytes. Byte figures stay in the records' fields.
# A byte budget's headline says "fits" only while no measured step of it missed the budget
# (rule 6 of Note [Measured budget check]): after a miss it says by how much, and the
# "measured step peak" row says what the check did (planned again, warned) or why no step
# was measured.
# A fraction says what it is a fraction of: the step's simulated peak without
# checkpointing, or, once a measured step (``check=True``) corrected that reference with
# the memory outside the regions and the loss's backward (Note [Measured budget check]
# rule 4), the corrected figure beside the simulated one; its measured row then compares
# the step with the fraction of the corrected reference, as a byte budget's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt_graph.planner.records import PlanReport

if TYPE_CHECKING:
    from ckpt_graph.planner.records import StepPlan

__all__ = ["BudgetReport", "step_table"]

_MIB = float(2**20)


def _mib(n: int) -> str:
    return f"{n / _MIB:.3f} MiB"


@dataclass(frozen=True)
class BudgetReport(PlanReport):
    """``memory_budget(...).report()``: a region's plan with its step. See Note [Budget reports].

    Attributes (beyond :class:`PlanReport`'s):
        policy: the policy, e.g. ``"memory_budget(0.5)"``.
        fraction: the budget's fraction, None for bytes.
        measured_peak_bytes: the step's measured peak (Note [Measured budget check]), if
            measured.
        correction_bytes: taken off a byte budget for memory the step measured outside the
            plan's model.
        before_backward_bytes: planned for beyond that on top of the kept values when the
            regions' backward starts (Note [Phases of a measured step]).
        plain_peak_bytes: a fraction's reference: the step's simulated peak without
            checkpointing.
        reference_bytes: that reference as a measured step corrected it (0: not
            corrected; Note [Measured budget check] rule 4).
        step: the joint plan of the step when it has several regions.
        regions: the plan of each region of that step, by ordinal.
    """

    policy: str = ""
    fraction: float | None = None
    measured_peak_bytes: int | None = None
    correction_bytes: int = 0
    before_backward_bytes: int = 0
    plain_peak_bytes: int = 0
    reference_bytes: int = 0
    step: StepPlan | None = None
    regions: tuple[PlanReport, ...] = ()
    checked: str = ""

    def __str__(self) -> str:
        if self.step is not None:
            return step_table(self.step, self.policy, self.fraction)
        if self.fraction is not None:
            covers = _reference(self.fraction, self.plain_peak_bytes, self.reference_bytes)
            if self.reference_bytes:
                covers += (
                    f"; planned against the region's activations plus "
                    f"{_mib(self.correction_bytes)} measured outside them"
                    + _boundary(self.correction_bytes, self.before_backward_bytes)
                )
        else:
            covers = (
                "the step's measured peak (planned against the region's activations plus "
                f"{_mib(self.correction_bytes)} measured outside them"
                + _boundary(self.correction_bytes, self.before_backward_bytes)
                + ")"
            )
        fits = _fits(self.feasible, self.fraction, self.budget_bytes, self.measured_peak_bytes)
        lines = [
            f"{self.policy}: one region per step, plan of region #{self.ordinal}"
            + (f" (from the {self.method} plan)" if self.method else "")
            + f": predicted peak {_mib(self.predicted_peak_bytes)}, {fits}",
            f"  {'budget':<20}{_mib(self.budget_bytes):>14}  {covers}",
            f"  {'predicted peak':<20}{_mib(self.predicted_peak_bytes):>14}  activations "
            f"({_mib(self.predicted_total_peak_bytes)} with gradient buffers); {fits}",
        ]
        lines.append(_measured_line(self.measured_peak_bytes, self.checked))
        lines.append(
            f"  {'recompute':<20}{self.predicted_recompute_flops:>14,}  FLOPs in "
            f"{self.recomputed_ops} ops; {self.reuses} steps used this plan"
        )
        kept = sum(k.nbytes for k in self.kept)
        lines.append(
            f"  kept {len(self.kept)} ops, {_mib(kept)} ({self.candidates} candidates; views "
            "of kept values cost nothing):"
        )
        lines.append(f"    {'op':>6}  {'name':<36} {'MiB':>10}")
        lines += [f"    {k.op_index:>6}  {k.op:<36} {k.nbytes / _MIB:>10.3f}" for k in self.kept]
        return "\n".join(lines)


def _reference(fraction: float, plain: int, reference: int) -> str:
    """What a fraction budget is a fraction of (Note [Measured budget check] rule 4)."""
    if not reference:
        return f"{fraction:.0%} of the step's simulated peak without checkpointing ({_mib(plain)})"
    return (
        f"{fraction:.0%} of the step's peak without checkpointing as the measured step "
        f"corrects it ({_mib(reference)}; simulated {_mib(plain)}, without the memory "
        "outside the regions)"
    )


def _boundary(correction: int, before: int) -> str:
    """The boundary term of Note [Phases of a measured step], for the reports."""
    if not before:
        return ""
    return (
        f", and {_mib(correction + before)} on top of the kept values when the regions' "
        "backward starts: the loss's backward outside them"
    )


def step_table(step: StepPlan, policy: str = "memory_budget", fraction: float | None = None) -> str:
    """The table of a step planned jointly. See Note [Budget reports]."""
    if fraction is not None:
        covers = _reference(fraction, step.plain_peak_bytes, step.reference_bytes)
    else:
        covers = "the step's measured peak"
    if step.correction_bytes:
        covers += f"; planned {_mib(step.correction_bytes)} lower for memory measured outside"
    if step.before_backward_bytes:
        covers += _boundary(step.correction_bytes, step.before_backward_bytes)
    fits = _fits(step.feasible, fraction, step.budget_bytes, step.measured_peak_bytes)
    lines = [
        f"{policy}: {step.regions} regions per step, planned jointly (distinct graphs: "
        f"{step.graphs}): predicted peak {_mib(step.predicted_peak_bytes)}, {fits}",
        f"  {'budget':<20}{_mib(step.budget_bytes):>14}  {covers}",
        f"  {'predicted peak':<20}{_mib(step.predicted_peak_bytes):>14}  the regions' kept "
        "values, activation inputs, gradient buffers and forward peaks "
        f"(activations only: {_mib(step.predicted_activation_peak_bytes)}); {fits}",
    ]
    lines.append(_measured_line(step.measured_peak_bytes, step.checked))
    lines.append(
        f"  {'recompute':<20}{step.predicted_recompute_flops:>14,}  FLOPs; without "
        f"checkpointing the regions keep {_mib(step.baseline_bytes)}"
    )
    if step.rows:
        lines.append(
            f"    {'region':>6}  {'kept MiB':>9}  {'peak MiB':>9}  {'recompute FLOPs':>16}  "
            f"{'ops':>5}  plan"
        )
        for r in step.rows:
            kept = sum(k.nbytes for k in r.kept)
            lines.append(
                f"    {r.ordinal:>6}  {kept / _MIB:>9.3f}  "
                f"{r.predicted_total_peak_bytes / _MIB:>9.3f}  "
                f"{r.predicted_recompute_flops:>16,}  {r.recomputed_ops:>5}  {r.method}"
            )
    return "\n".join(lines)


def _fits(feasible: bool, fraction: float | None, budget: int, measured: int | None) -> str:
    """The headline's verdict: a plan predicted to fit a byte budget that its measured
    step missed does not "fit" (Note [Budget reports])."""
    fits = "fits" if feasible else "does not fit: the lowest peak found"
    # a fraction is measured only with check=True, which corrects its budget first
    if measured is not None and measured > budget:
        return f"{fits} as predicted, but the step measured {_mib(measured - budget)} over"
    return fits


def _measured_line(measured: int | None, checked: str) -> str:
    """The measured step's row: its peak, or why no step was measured."""
    if measured is None:
        return f"  {'measured step peak':<20}{'-':>14}  {checked}"
    return (
        f"  {'measured step peak':<20}{_mib(measured):>14}  the whole step: parameters' "
        f"gradients and memory outside the regions included; {checked}"
    )
