"""The liveness simulator's graph of a recorded region, and the memory it adds on top.

:func:`from_region` turns a region into a :class:`~ckpt_graph.planner.liveness.SimGraph`: values
and storages, the step of each saved tensor, the ops that may be transient, and two kinds
of memory that do not depend on the plan (Note [Backward liveness model] rules 1, 4 and 7):
gradient buffers per backward step (:func:`grad_bytes`, from the graph alone), and the
*workspaces* of ops, the temporaries an op allocates beyond its results, in its backward
formula (``convolution_backward``'s unfolded input, ``native_batch_norm_backward``'s
normalised input) and when it runs again in backward (``convolution``'s unfolded input).
:func:`~ckpt_graph.planner.workspaces.measure_workspaces` measures them once per op
signature (Note [Measuring op workspaces]).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ckpt_graph.engine import realize
from ckpt_graph.planner.workspaces import _ZERO, Workspace

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region
    from ckpt_graph.planner.liveness import SimGraph, SimOp, SimValue

__all__ = ["from_region", "grad_bytes", "kept_ops_of", "workspace_of"]


def grad_bytes(
    values: Sequence[SimValue],
    ops: Sequence[SimOp],
    floating: Sequence[bool],
    passthrough: Collection[int] = (),
) -> dict[int, int]:
    """Gradient bytes alive per step. See Note [Backward liveness model] rule 4.

    ``passthrough`` ops return their output's gradient as their inputs' (``add``): the
    inputs whose gradient starts there share that buffer instead of getting their own.
    """
    n = len(ops)
    last_use = [-1] * len(values)
    for j, op in enumerate(ops):
        for i in op.inputs:
            last_use[values[i].storage] = j
    low: dict[int, int] = {}  # gradient buffer (named by a value) -> first step it is freed at
    for v, val in enumerate(values):
        if floating[v] and val.storage == v and val.producer >= 0:
            low[v] = val.producer
    buffer = list(range(len(values)))  # the buffer holding each value's gradient
    for j in sorted(passthrough, reverse=True):
        outs = [o for o in ops[j].outputs if o in low or buffer[o] != o]
        if len(outs) != 1:
            continue
        b = buffer[outs[0]]
        for i in ops[j].inputs:
            r = values[i].storage
            if r in low and last_use[r] == j and buffer[r] == r:
                del low[r]
                buffer[r] = b
                low[b] = min(low[b], values[r].producer)
    delta = [0] * (n + 2)
    for v, first in low.items():
        end = last_use[v] if last_use[v] >= 0 else n - 1
        delta[first] += values[v].nbytes
        delta[end + 1] -= values[v].nbytes
    out: dict[int, int] = {}
    level = 0
    for j in range(n):
        level += delta[j]
        out[j] = level
    skip = set(passthrough)
    for j, op in enumerate(ops):
        if j in skip or (op.outputs and all(values[o].storage != o for o in op.outputs)):
            continue  # a view op: the gradient is formed where the view is consumed
        for i in op.inputs:
            root = values[i].storage
            if not floating[root]:
                continue
            if values[root].producer < 0 or last_use[root] > j:
                # a parameter's gradient, or a contribution added to an existing buffer
                out[j] += values[i].nbytes if values[i].nbytes else values[root].nbytes
    return out


def workspace_of(workspaces: Mapping[int, Workspace] | None, index: int) -> Workspace:
    """The workspace of op ``index`` (zero when not measured)."""
    if workspaces is None:
        return _ZERO
    return workspaces.get(index, _ZERO)


def kept_ops_of(region: Region) -> frozenset[int]:
    """Indices of the region's op nodes with an output kept by a policy or tag."""
    return frozenset(
        n.index
        for n in region.nodes
        if any(o is not None and o.reason is not None and not o.reason.by_engine for o in n.outputs)
    )


def from_region(
    region: Region,
    costs: Mapping[int, int] | None = None,
    free_ops: Iterable[int] = (),
    workspaces: Mapping[int, Workspace] | None = None,
) -> SimGraph:
    """Build the :class:`SimGraph` of a recorded region.

    Args:
        region: a region whose forward has run (values may be released; metadata is used).
        costs: recompute cost per op index; missing ops cost the elements of their outputs;
            ops whose outputs are all views cost 0.
        free_ops: ops whose kept outputs are left to the plan (not fixed); outputs of every
            other op are fixed as the forward decided them.
        workspaces: temporaries per op index, e.g. from
            :func:`~ckpt_graph.planner.workspaces.measure_workspaces`; none when omitted.

    Example:
        >>> g = from_region(region, workspaces=measure_workspaces(region))  # doctest: +SKIP
        >>> simulate(g, kept_ops_of(region)).peak_total_bytes  # doctest: +SKIP
    """
    from ckpt_graph.planner.liveness import SimGraph, SimOp, SimValue

    free = set(free_ops)
    vid: dict[int, int] = {}
    values: list[SimValue] = []
    fixed: set[int] = set()
    floating: list[bool] = []
    for inp in region.inputs:
        vid[id(inp)] = len(values)
        values.append(SimValue(inp.nbytes, -1, len(values)))
        floating.append(inp.dtype.is_floating_point)
    ops: list[SimOp] = []
    used: set[int] = set()  # values consumed so far (ops and saves), for rule 6
    saves = sorted(((n, id(h)) for n, h in region.saved), key=lambda e: e[0])
    next_save = 0
    for node in region.nodes:
        while next_save < len(saves) and saves[next_save][0] <= node.index:
            used.add(saves[next_save][1])
            next_save += 1
        ins = tuple(vid[id(i)] for i in node.inputs if id(i) in vid)
        outs: list[int] = []
        info = node.info
        for out in node.outputs:
            if out is None:
                continue
            v = len(values)
            vid[id(out)] = v
            root = v
            if (ins and out.is_view and not info.returns_written) or (
                ins and info.returns_written and id(node.inputs[0]) not in used
            ):
                root = values[ins[0]].storage
            values.append(SimValue(out.nbytes, node.index, root, out.is_view))
            floating.append(out.dtype.is_floating_point and root == v)
            outs.append(v)
            if out.reason is not None and (node.index not in free or out.reason.by_engine):
                fixed.add(v)
        if all(o is None or o.is_view for o in node.outputs):
            cost = 0  # views compute nothing
        elif costs is not None and node.index in costs:
            cost = costs[node.index]
        else:
            cost = sum(o.shape.numel() for o in node.outputs if o is not None)
        ws = workspace_of(workspaces, node.index)
        pointwise = (
            info.is_pointwise
            and not info.writes
            and node.rng is None
            and len(node.outputs) == 1
            and len(outs) == 1
        )
        ops.append(SimOp(ins, tuple(outs), cost, info.name, ws.backward, ws.recompute, pointwise))
        used.update(id(i) for i in node.inputs)
    saved = _steps_of_saves(region, vid, ops, workspaces)
    read = {values[i].storage for op in ops for i in op.inputs}
    for _, v in saved:  # saved but never read (batch norm's save_mean): no gradient
        if v not in read and values[v].storage == v:
            floating[v] = False
    ws_items = workspaces.items() if workspaces is not None else ()
    return SimGraph(
        tuple(values),
        tuple(ops),
        tuple(saved),
        frozenset(fixed),
        grad_bytes(values, ops, floating, [j for j, w in ws_items if w.input_grads == 0]),
        getattr(realize, "TRANSIENT_MIN_BYTES", 0),
        region.cache_limit,
    )


def _steps_of_saves(
    region: Region,
    vid: Mapping[int, int],
    ops: Sequence[SimOp],
    workspaces: Mapping[int, Workspace] | None,
) -> list[tuple[int, int]]:
    """``(step, value id)`` per saved tensor of the region. See Note [Backward liveness model] rule 1."""
    n_ops = len(ops)
    logged = [(n, vid.get(id(h))) for n, h in region.saved]
    times = Counter(logged)
    seen: Counter[tuple[int, int | None]] = Counter()
    taken = [0] * (n_ops + 1)  # output saves already given to each op
    saved: list[tuple[int, int]] = []
    last = 0
    for n, sv in logged:
        if sv is None:
            continue
        seen[n, sv] += 1
        step = n if n < n_ops and sv in ops[n].inputs else n - 1
        if step == n and n > 0 and sv in ops[n - 1].outputs:
            expected = workspace_of(workspaces, n - 1).output_saves
            if expected >= 0:  # measured: op n-1 saves that many of its outputs first
                step = n - 1 if taken[n - 1] < expected else n
            elif times[n, sv] > 1 and seen[n, sv] == 1:
                step = n - 1  # saved as op n-1's output, then again as op n's input
        if step == n - 1 and n > 0:
            taken[n - 1] += 1
        last = max(last, min(max(step, 0), n_ops - 1))
        saved.append((last, sv))
    return saved
