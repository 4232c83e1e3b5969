"""The planner's records: plans, their reports, and the state the policy keeps per block.

Plain data the planner's modules pass to each other, defined below every solver so that any
of them can name them without importing another's logic: what a solver returns
(``Solution``), what a plan reports (``KeptTensor``, ``PlanReport``), what a plan is across
regions and steps (``Signature``, ``Option``, ``RegionGraph``, ``Plan``, ``Seen``,
``StepPlan``), the policy's state of one open block (``Run``), an op's measured
temporaries (``Workspace``) and a region's graph waiting for them (``UnmeasuredGraph``).
The simulator's own graph and result types are in
``sim_graph``. See Note [Memory budget policy] and Note [Step budget across regions].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ckpt_graph.planner.sim_graph import SimGraph, SimResult

__all__ = [
    "NO_WORKSPACE",
    "KeptTensor",
    "Option",
    "Plan",
    "PlanReport",
    "RegionGraph",
    "Run",
    "Seen",
    "Signature",
    "Solution",
    "StepPlan",
    "UnmeasuredGraph",
    "Workspace",
    "numel",
]

Signature = tuple[str, tuple[tuple[int, ...], ...]]


def numel(shapes: tuple[tuple[int, ...], ...]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


@dataclass(frozen=True)
class KeptTensor:
    """One op whose outputs a plan keeps: position in the region, op name, bytes."""

    op_index: int
    op: str
    nbytes: int


@dataclass(frozen=True)
class PlanReport:
    """A plan of :func:`~ckpt_graph.planner.memory_budget.memory_budget` and what the
    simulator predicts for it.

    Attributes:
        ordinal: the region's position within a step (see Note [Memory budget policy]).
        budget_bytes: the budget in bytes.
        baseline_bytes: activation bytes autograd would keep without checkpointing.
        kept: the kept ops (region op index, op name, bytes of their outputs).
        predicted_peak_bytes: simulated activation peak of backward.
        predicted_total_peak_bytes: the same plus gradient buffers.
        predicted_recompute_flops: summed cost of the ops backward recomputes.
        recomputed_ops: how many ops backward recomputes.
        feasible: whether the plan fits the budget (else: the lowest peak found).
        candidates: ops the planner could decide.
        reuses: regions that ran with this plan after it was made.
        method: the starting plan the solver's local search improved (see :class:`Solution`).
        predicted_kept_bytes: simulated kept values when backward starts (Note [Phases of
            a measured step]).
    """

    ordinal: int
    budget_bytes: int
    baseline_bytes: int
    kept: tuple[KeptTensor, ...]
    predicted_peak_bytes: int
    predicted_total_peak_bytes: int
    predicted_recompute_flops: int
    recomputed_ops: int
    feasible: bool
    candidates: int
    reuses: int = 0
    method: str = ""
    predicted_kept_bytes: int = 0

    def __str__(self) -> str:
        mib = 2.0**20
        lines = [
            f"memory_budget plan (region #{self.ordinal}): budget {self.budget_bytes / mib:.3f} "
            f"MiB of {self.baseline_bytes / mib:.3f} MiB, predicted peak "
            f"{self.predicted_peak_bytes / mib:.3f} MiB"
            f"{'' if self.feasible else ' (does not fit)'}, recompute "
            f"{self.predicted_recompute_flops:,} FLOPs in {self.recomputed_ops} ops"
            + (f" (from the {self.method} plan)" if self.method else ""),
            f"  {'op':>6}  {'name':<40} {'bytes':>12}",
        ]
        lines += [f"  {k.op_index:>6}  {k.op:<40} {k.nbytes:>12,d}" for k in self.kept]
        return "\n".join(lines)


@dataclass(frozen=True)
class Solution:
    """A plan: the kept candidate ops and what the simulator predicts for them.

    ``method`` names the starting plan the local search improved (one of
    :data:`~ckpt_graph.planner.solve.SEEDS`, ``"hand: <name>"`` for a hand plan of
    Note [Hand seeds], or "all" when keeping every candidate fits).
    """

    kept_ops: frozenset[int]
    result: SimResult
    feasible: bool
    method: str = ""


@dataclass(frozen=True)
class Option:
    """One entry of a graph's menu: kept ops, the simulated backward and forward peak.

    ``forward`` is the forward's simulated peak (Note [Forward memory of a plan]); 0 when
    not computed (a step of one region does not use it).
    """

    kept_ops: frozenset[int]
    result: SimResult
    method: str
    feasible: bool = True
    forward: int = 0


@dataclass
class RegionGraph:
    """A region's graph as planned; one per op signature (Note [Step budget across regions])."""

    signature: tuple[Signature, ...]
    g: SimGraph
    candidates: list[int]
    positions: dict[int, int]
    baseline: int
    outside: int
    hand: dict[str, frozenset[int]] = field(default_factory=dict)  # Note [Hand seeds]
    menu: list[Option] | None = None
    everything: Option | None = None  # keeping every candidate (see ``everything``)
    # the plan of the same ops at smaller sizes to start from (Note [Warm start at a new size])
    warm: Plan | None = None
    # signature position of each view op the policy decides, -1 for a detach (Note [Kept
    # views], rule 6 of Note [Memory budget policy])
    views: dict[int, int] = field(default_factory=dict)
    # set while ``g`` lacks its ops' measured workspaces: called with the graph, measures
    # them and rebuilds ``g`` (and what follows from it) in place; returns whether it could
    # (Note [Workspaces in budget planning])
    unmeasured: Callable[[RegionGraph], bool] | None = None


@dataclass(eq=False)  # by identity: regions of identical layers share one
class Plan:
    signature: tuple[Signature, ...]
    kept: frozenset[int]  # signature positions (see rule 6 of Note [Memory budget policy])
    report: PlanReport
    graph: RegionGraph | None = None
    # output elements of the signature up to each position (See Note [Plans across sizes])
    elements: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.elements:
            total = 0
            for _, shapes in self.signature:
                total += numel(shapes)
                self.elements.append(total)


@dataclass(frozen=True)
class Seen:
    """A region of the current step whose block exited: its graph and activation inputs,
    and the parameters' gradients its backward makes (``SimGraph.param_grad_bytes``)."""

    ordinal: int
    graph: RegionGraph
    inputs: int
    grads: int = 0


@dataclass(frozen=True)
class StepPlan:
    """The joint plan of a step's regions (Note [Step budget across regions]).

    Attributes:
        regions: regions in the step.
        budget_bytes: the step's budget in bytes.
        baseline_bytes: the step's activation bytes without checkpointing.
        input_bytes: activation inputs of the regions (always kept), in the step's peak.
        predicted_peak_bytes: the largest term of rule 1 of the Note: the step's peak as
            a measurement sees it, less the memory outside the regions (rule 5).
        predicted_recompute_flops: summed recompute cost of the regions' plans.
        feasible: whether the plan fits the budget (else: the budget was raised to fit).
        graphs: distinct region graphs (identical layers share one).
        predicted_activation_peak_bytes: the same without the regions' gradient buffers
            and backward temporaries.
        plain_peak_bytes: ``predicted_peak_bytes`` of keeping every candidate (no
            checkpointing): what a fraction budget is a fraction of.
        correction_bytes: taken off the budget for memory the step measured outside the
            plan's model (Note [Measured budget check]).
        measured_peak_bytes: the step's measured peak, if measured.
        rows: each region's plan, by ordinal (``step_report()``).
        policy, fraction: the policy and its budget's fraction (None for bytes).
        checked: what the measured check did, or why no step was measured.
        predicted_boundary_bytes: the regions' kept values and activation inputs when
            their backward starts, less the memory outside the regions (Note [Phases of a
            measured step]).
        before_backward_bytes: planned for on top of them then, beyond ``correction_bytes``
            (the loss's backward outside the regions, as a measured step found it).
        reference_bytes: what a fraction budget is a fraction of once a measured step
            corrected ``plain_peak_bytes`` (0: not corrected; Note [Measured budget check]
            rule 4).
    """

    regions: int
    budget_bytes: int
    baseline_bytes: int
    input_bytes: int
    predicted_peak_bytes: int
    predicted_recompute_flops: int
    feasible: bool
    graphs: int
    predicted_activation_peak_bytes: int
    plain_peak_bytes: int
    correction_bytes: int = 0
    measured_peak_bytes: int | None = None
    rows: tuple[PlanReport, ...] = ()
    policy: str = "memory_budget"
    fraction: float | None = None
    checked: str = ""
    predicted_boundary_bytes: int = 0
    before_backward_bytes: int = 0
    reference_bytes: int = 0

    def __str__(self) -> str:
        from ckpt_graph.planner.budget_report import step_table  # its table, Note [Budget reports]

        return step_table(self, self.policy, self.fraction)


@dataclass
class Run:
    """State of one open block of the policy in one region."""

    start: int
    ordinal: int
    kept_at_enter: int
    plans: list[Plan]
    inputs_at_enter: int = 0
    saved_at_enter: int = 0  # the region's saved tensors when the block opened
    exact: list[Plan] = field(default_factory=list)  # See Note [Plans across sizes].
    elements: int = 0
    grown: bool = False
    depth: int = 1
    signature: list[Signature] = field(default_factory=list)
    lag: int = 0  # positions before it are filtered by ``across_sizes.match``
    answers: dict[int, bool] = field(default_factory=dict)
    heuristic: bool = False
    diverged_at: int = -1
    saved_seen: int = 0
    saved_bytes: int = 0
    chain: dict[int, frozenset[int]] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)
    longest: int = 0
    seen: set[int] = field(default_factory=set)
    positions: dict[int, int] = field(default_factory=dict)


class Workspace(NamedTuple):
    """Temporaries of one op, in bytes, beyond what it returns.

    Attributes:
        backward: allocated by its backward formula (beyond the input gradients).
        recompute: allocated when it runs again in backward (beyond its outputs).
        output_saves: how many of the tensors its autograd node saves are its own outputs
            (-1 if unknown); tells which step a save belongs to (Note [Backward liveness
            model] rule 1).
        input_grads: bytes of input gradients its backward formula allocates (-1 if not
            measured); 0 means it passes its output's gradient on (rule 4 of that Note).
        own_layout: whether every input gradient its backward formula returns has its
            input's strides (``None`` if not measured): a parameter read through a
            transpose then gets its gradient without a copy (Note [Parameters' gradients
            in backward] rule 2).
    """

    backward: int
    recompute: int
    output_saves: int = -1
    input_grads: int = -1
    own_layout: bool | None = None


# An op with no temporaries, or one not measured.
NO_WORKSPACE = Workspace(0, 0)


@dataclass(frozen=True)
class UnmeasuredGraph:
    """A region's simulator graph before its ops' workspaces are known, and what adding
    them changes (``from_region.with_workspaces``; Note [Workspaces in budget planning]).

    Attributes:
        g: the graph without saves' steps, gradients or workspaces.
        saves: per saved tensor as the region logged it, ``(op nodes recorded before the
            save, value id)``; ``None`` for a value outside the graph.
        floating: per value, whether autograd gives it a gradient.
        permuted: per step, bytes of permuted gradient copies alive at its formula and
            those its formula makes (Note [Permuted gradients]).
        fresh: region inputs that are parameters whose ``.grad`` is ``None`` (Note
            [Parameters' gradients in backward]).
        after_bytes: bytes of such parameters' gradients made after the region's backward
            (parameters read through a view made outside the region).
    """

    g: SimGraph
    saves: tuple[tuple[int, int | None], ...]
    floating: tuple[bool, ...]
    permuted: dict[int, tuple[int, int]]
    fresh: tuple[int, ...] = ()
    after_bytes: int = 0
