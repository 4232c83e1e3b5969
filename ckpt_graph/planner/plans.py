"""What a plan is: a region's graph as planned, its menu entries, plans and step figures.

The records the budget planner passes around (``RegionGraph``, ``Option``, ``Plan``,
``Seen``, ``StepPlan``) and how a chosen entry becomes a ``Plan`` (``make_plan``). See Note
[Memory budget policy] and Note [Step budget across regions].
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ckpt_graph.planner.forward_memory import prune
from ckpt_graph.planner.liveness import SimGraph, SimResult, simulate
from ckpt_graph.planner.solve import KeptTensor, PlanReport

__all__ = [
    "Option",
    "Plan",
    "RegionGraph",
    "Seen",
    "Signature",
    "StepPlan",
    "kept_views",
    "make_plan",
    "numel",
]

Signature = tuple[str, tuple[tuple[int, ...], ...]]


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
    """A region of the current step whose block exited: its graph and activation inputs."""

    ordinal: int
    graph: RegionGraph
    inputs: int


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

    def __str__(self) -> str:
        from ckpt_graph.planner.budget_report import step_table  # its table, Note [Budget reports]

        return step_table(self, self.policy, self.fraction)


def make_plan(graph: RegionGraph, option: Option, ordinal: int, budget: int) -> Plan:
    """The plan of ``graph`` that keeps ``option``'s ops, with its report.

    Kept ops that backward never reads are dropped (Note [Forward memory of a plan]).
    """
    g = graph.g
    kept_ops, result = prune(g, option.kept_ops, option.result)
    views = kept_views(graph, kept_ops)
    if views:  # See Note [Kept views].
        result = simulate(g, kept_ops | views)
    option = replace(option, kept_ops=kept_ops, result=result)
    kept = tuple(
        KeptTensor(
            j,
            g.ops[j].name,
            sum(g.values[o].nbytes for o in g.ops[j].outputs if g.values[o].storage == o),
        )
        for j in sorted(option.kept_ops | views)
    )
    report = PlanReport(
        ordinal=ordinal,
        budget_bytes=budget,
        baseline_bytes=graph.baseline,
        kept=kept,
        predicted_peak_bytes=option.result.peak_bytes,
        predicted_total_peak_bytes=option.result.peak_total_bytes,
        predicted_recompute_flops=option.result.recompute_cost,
        recomputed_ops=option.result.recomputed_ops,
        feasible=option.feasible,
        candidates=len(graph.candidates),
        method=option.method,
    )
    kept_pos = frozenset(graph.positions[j] for j in option.kept_ops if j in graph.positions)
    kept_pos |= {graph.views[j] for j in views if graph.views[j] >= 0}
    return Plan(graph.signature, kept_pos, report, graph)


# Note [Kept views]
# A view op's output shares its base's storage: keeping it costs no memory when the base's
# storage is kept anyway (kept by the plan, fixed, or a region input such as a weight whose
# ``t()`` a linear layer saves), and recomputing it costs a dispatch. The solver leaves
# views out of its candidates (they never change a peak), so a plan that keeps every
# candidate would still recompute every view (transposes, splits) in backward.
# ``make_plan`` therefore also keeps each view op the policy decides (``RegionGraph.views``)
# whose every output's storage is kept, unless something writes that storage in place (a
# kept view must not see a later version of its base; such storages are left to
# recompute). The plan's figures are simulated with those views kept.


def kept_views(graph: RegionGraph, kept_ops: frozenset[int]) -> frozenset[int]:
    """The view ops of ``graph`` that keep no memory beyond ``kept_ops``' (Note [Kept views])."""
    if not graph.views:
        return frozenset()
    g = graph.g
    values = g.values
    kept = {v for j in kept_ops for v in g.ops[j].outputs} | set(g.fixed)
    written: set[int] = set()  # storages some computing op writes in place
    for v, val in enumerate(values):
        if val.storage != v and val.producer >= 0 and g.ops[val.producer].cost > 0:
            written.add(val.storage)
    out = []
    for j in graph.views:
        outputs = g.ops[j].outputs
        if outputs and all(
            values[o].storage != o
            and values[o].storage not in written
            and (values[o].storage in kept or values[values[o].storage].producer < 0)
            for o in outputs
        ):
            out.append(j)
    return frozenset(out)


def numel(shapes: tuple[tuple[int, ...], ...]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total
