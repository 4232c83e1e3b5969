"""Forward memory of a region's plan: its peak while the forward runs, and kept values that
cost only forward memory.

# Note [Forward memory of a plan]
# 1. While a region's forward runs, the engine holds each kept value (the plan's and the
#    fixed ones) from its op to the region's exit; a recomputed value lives as eager has it,
#    from its op to the last op of the region that reads it (autograd saved it through the
#    pack hook, which stores a handle, not the tensor). Memory is counted per storage, as
#    in Note [Backward liveness model] rule 3; region inputs are not counted. The forward
#    peak of a plan is the largest level at an op, its outputs and ``run_workspace``
#    included, before the values it read last are freed.
# 2. Kept values that backward never reads (no saved tensor, no op that runs in backward
#    reads them) are freed at the region's exit (Note [Backward liveness model] rule 5),
#    so keeping them changes nothing in backward but holds them through the rest of the
#    forward: ``prune`` drops their ops from a plan. Solvers keep such values because
#    their simulated cost and backward peak are the same either way; the step's forward
#    peak is not (a layer that keeps every candidate keeps the temporaries of GPT-2's
#    tanh GELU, which autograd does not save, through the rest of its forward).
# Known limitations: Python references that outlive a value's last use (a local the layer
# still holds, e.g. HF GPT-2's ``residual``) are not modelled, so the forward peak is a
# lower bound; the forward of a plan is never measured.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckpt_graph.planner.liveness import SimGraph, SimResult, simulate

__all__ = ["forward_peak", "prune"]


def forward_peak(g: SimGraph, kept_ops: Iterable[int]) -> int:
    """The simulated memory peak of the region's forward with ``kept_ops`` kept.

    See Note [Forward memory of a plan] rule 1.

    Example:
        >>> from ckpt_graph.planner.liveness import SimOp, SimValue
        >>> x, a, b, c = SimValue(8, -1, 0), SimValue(32, 0, 1), SimValue(8, 1, 2), SimValue(8, 2, 3)
        >>> ops = (SimOp((0,), (1,), 5), SimOp((1,), (2,), 5), SimOp((2,), (3,), 5))
        >>> g = SimGraph((x, a, b, c), ops, ((1, 1),))
        >>> forward_peak(g, []), forward_peak(g, [0])  # a freed after op 1, or held to exit
        (40, 48)
    """
    values, ops = g.values, g.ops
    held = set()  # storages held to the region's exit
    for v in g.fixed:
        held.add(values[v].storage)
    for j in kept_ops:
        held.update(values[o].storage for o in ops[j].outputs)
    last = [-1] * len(values)  # last op reading each storage
    for j, op in enumerate(ops):
        for i in op.inputs:
            last[values[i].storage] = j
    level = peak = 0
    alive: list[int] = []
    for j, op in enumerate(ops):
        for o in op.outputs:
            if values[o].storage == o:  # a new storage (not a view, not an in-place result)
                level += values[o].nbytes
                alive.append(o)
        peak = max(peak, level + op.run_workspace)
        left = []
        for s in alive:
            if s in held or last[s] > j:
                left.append(s)
            else:
                level -= values[s].nbytes
        alive = left
    return peak


def prune(
    g: SimGraph, kept_ops: Iterable[int], result: SimResult
) -> tuple[frozenset[int], SimResult]:
    """``kept_ops`` without the ops none of whose outputs backward reads, and its simulation.

    ``result`` is the simulation of ``kept_ops`` (its ``runs`` tell which ops backward
    runs). See Note [Forward memory of a plan] rule 2. The pruned plan is simulated again
    and returned only if backward is the same (peaks, kept bytes, cost); else ``kept_ops``.

    Example:
        >>> kept, r = prune(graph, plan.kept_ops, simulate(graph, plan.kept_ops))  # doctest: +SKIP
    """
    kept = frozenset(kept_ops)
    if not result.runs:
        return kept, result
    values, ops = g.values, g.ops
    read = set()  # storages a saved tensor or an op that runs in backward reads
    for _, v in g.saved:
        read.add(values[v].storage)
    for j, op in enumerate(ops):
        if result.runs[j]:
            read.update(values[i].storage for i in op.inputs)
    pruned = frozenset(j for j in kept if any(values[o].storage in read for o in ops[j].outputs))
    if pruned == kept:
        return kept, result
    again = simulate(g, pruned)
    same = (
        again.peak_bytes == result.peak_bytes
        and again.peak_total_bytes == result.peak_total_bytes
        and again.kept_bytes == result.kept_bytes
        and again.recompute_cost == result.recompute_cost
    )
    return (pruned, again) if same else (kept, result)
