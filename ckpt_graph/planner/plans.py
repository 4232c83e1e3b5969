"""How a chosen menu entry becomes a plan: ``make_plan``, with the view ops it keeps.

The records themselves (``RegionGraph``, ``Option``, ``Plan``, ``Seen``, ``StepPlan``) are in
``records``. See Note [Memory budget policy] and Note [Step budget across regions].
"""

from __future__ import annotations

from dataclasses import replace

from ckpt_graph.planner.forward_memory import prune
from ckpt_graph.planner.liveness import simulate
from ckpt_graph.planner.records import KeptTensor, Option, Plan, PlanReport, RegionGraph

__all__ = ["kept_views", "make_plan"]


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
        predicted_kept_bytes=option.result.kept_bytes,
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
