"""The liveness simulator's transient values (Note [Backward liveness model] rule 7).

Mirrors ``passes._mark_transient`` (Note [Transient values]): after the use counts of a pass,
cheap pointwise values are marked to run again at each use instead of staying cached.
``simulate`` calls it for a pass that is not bounded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_graph.planner.sim_graph import SimGraph

__all__ = ["mark_transient"]


def mark_transient(g: SimGraph, kept: list[bool], pass_uses: list[int]) -> list[bool]:
    """Recomputed values run again at each use instead of cached (rule 7).

    Mirrors ``passes._mark_transient`` (Note [Transient values]); adds the extra uses of
    the producers' inputs to ``pass_uses``.
    """
    values, ops, least = g.values, g.ops, g.transient_min_bytes
    transient = [False] * len(values)
    if not any(op.pointwise for op in ops):
        return transient
    view = [v.storage != k if v.is_view is None else v.is_view for k, v in enumerate(values)]
    aliased = [False] * len(values)
    for k, val in enumerate(values):
        if view[k]:
            aliased[val.storage] = True

    def aliases_kept(v: int) -> bool:  # a view of a kept value, through views only
        while view[v] and not kept[v]:
            p = values[v].producer
            if p < 0 or not ops[p].inputs:
                return False
            v = ops[p].inputs[0]
        return kept[v]

    for op in ops:
        if not op.pointwise or len(op.outputs) != 1:
            continue
        h = op.outputs[0]
        if kept[h] or pass_uses[h] < 2 or view[h] or aliased[h] or values[h].nbytes < least:
            continue
        nbytes = 0
        for i in op.inputs:
            if not kept[i] and not aliases_kept(i):
                if transient[i] or view[i] or pass_uses[i] < 2:
                    break
                nbytes += values[i].nbytes
        else:
            if nbytes <= values[h].nbytes:
                transient[h] = True
                for i in op.inputs:
                    if not kept[i]:
                        pass_uses[i] += pass_uses[h] - 1
    return transient
