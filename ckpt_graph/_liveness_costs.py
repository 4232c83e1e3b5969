"""The liveness simulator's graph of a recorded region, and the memory it adds on top.

:func:`from_region` turns a region into a :class:`~ckpt_graph._liveness.SimGraph`: values
and storages, the step of each saved tensor, the ops that may be transient, and two kinds
of memory that do not depend on the plan (Note [Backward liveness model] rules 1, 4 and 7):
gradient buffers per backward step (:func:`grad_bytes`, from the graph alone), and the
*workspaces* of ops, the temporaries an op allocates beyond its results, in its backward
formula (``convolution_backward``'s unfolded input, ``native_batch_norm_backward``'s
normalised input) and when it runs again in backward (``convolution``'s unfolded input).
:func:`measure_workspaces` measures them once per op signature.

# Note [Measuring op workspaces]
# 1. What is measured. For each op node, on fresh tensors with the recorded shapes, dtypes
#    and strides (floating ones random, integer and boolean ones zero, so indices are valid),
#    ``ckpt_graph.memory.measure`` reports (a) the op run under ``no_grad``, and (b) the
#    backward of the op alone (``torch.autograd.grad`` from its floating outputs that later
#    ops or the loss consume, to its inputs that require gradients). The workspace is the
#    peak minus the end level: what the call allocated beyond its results (the op's outputs,
#    or the gradients of its inputs, which rule 4 counts separately). Backends pick their
#    own algorithms (the slow convolution for float64 unfolds the input into a buffer
#    ``kernel size`` times as large; oneDNN for float32 allocates reordered copies), so the
#    figures come from the backend that will run, not from a table of formulas.
# 2. Cost. One measurement per distinct signature (op, tensor metadata, other arguments),
#    memoised for the process: a block repeated N times is measured once. Each takes two
#    profiler sessions and one forward and backward of the op at the real size: a 12-layer
#    GPT-style region (381 ops, 14 signatures) takes 0.2-0.6 s on 2 CPU cores once its
#    kernels are warm.
# 3. Not measured (0): views and in-place ops returning the written value (their formulas
#    allocate their results only; ops that write buffers, such as batch norm's running
#    statistics, are measured with those buffers not requiring gradients), ops on non-CPU
#    tensors, random ops given a generator, and ops whose fresh-tensor run fails. Random
#    ops run under ``torch.random.fork_rng``, so the caller's random stream is unchanged.
#    Measuring inside another ``measure`` or a profiler is not possible and returns what
#    was measured so far.
# 4. A region's own op nodes are not touched: only metadata is read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from . import realize
from ._errors import CkptGraphError
from .graph import Handle, arg_at
from .memory import measure

if TYPE_CHECKING:
    from ._liveness import SimGraph, SimOp, SimValue
    from .graph import OpNode
    from .region import Region

__all__ = ["Workspace", "from_region", "grad_bytes", "kept_ops_of", "measure_workspaces"]


class Workspace(NamedTuple):
    """Temporaries of one op, in bytes, beyond what it returns.

    Attributes:
        backward: allocated by its backward formula (beyond the input gradients).
        recompute: allocated when it runs again in backward (beyond its outputs).
        output_saves: how many of the tensors its autograd node saves are its own outputs
            (-1 if unknown); tells which step a save belongs to (rule 1).
        input_grads: bytes of input gradients its backward formula allocates (-1 if not
            measured); 0 means it passes its output's gradient on (rule 4).
    """

    backward: int
    recompute: int
    output_saves: int = -1
    input_grads: int = -1


_MEMO: dict[tuple[Any, ...], Workspace] = {}
_MEMO_LIMIT = 4096
_ZERO = Workspace(0, 0)


def measure_workspaces(region: Region) -> dict[int, Workspace]:
    """Measure the workspace of each op node of a recorded region (CPU tensors only).

    See Note [Measuring op workspaces]. The result is meant for
    ``from_region(region, workspaces=...)``.

    Raises:
        ValueError: if the region's block is still open (the measured ops would be recorded).

    Example:
        >>> ws = measure_workspaces(region)  # doctest: +SKIP
        >>> g = from_region(region, workspaces=ws)  # doctest: +SKIP
    """
    if region._open:
        raise ValueError(
            "measure_workspaces: the region is still open; call it after the "
            "save_recompute_policy block has exited"
        )
    consumed = {id(i) for node in region.nodes for i in node.inputs}
    last = len(region.nodes) - 1
    out: dict[int, Workspace] = {}
    for node in region.nodes:
        if not _measurable(node):
            continue
        wanted = tuple(
            o is not None and (id(o) in consumed or node.index == last) for o in node.outputs
        )
        key = _signature(node, wanted)
        ws = _MEMO.get(key)
        if ws is None:
            try:
                ws = _measure_one(node, wanted)
            except CkptGraphError:  # another measure() or a profiler is running
                return out
            if len(_MEMO) >= _MEMO_LIMIT:
                _MEMO.clear()
            _MEMO[key] = ws
        out[node.index] = ws
    return out


def _measurable(node: OpNode) -> bool:
    info = node.info
    if info.returns_written or info.is_inplace_view:
        return False  # writes to buffers (batch norm's running statistics) are fine
    if info.is_random and any(isinstance(a, torch.Generator) for a in node.kwargs.values()):
        return False  # would draw from the caller's generator
    outs = [o for o in node.outputs if o is not None]
    if not outs or all(o.is_view for o in outs):
        return False
    return all(i.device is None or i.device.type == "cpu" for i in node.inputs)


def _signature(node: OpNode, wanted: tuple[bool, ...]) -> tuple[Any, ...]:
    def sig(a: Any) -> Any:
        if _is_handle(a):
            return (tuple(a.shape), a.dtype, a.stride, _requires_grad(a))
        if isinstance(a, (list, tuple)):
            return tuple(sig(e) for e in a)
        return repr(a)

    return (
        str(node.op),
        sig(node.args),
        tuple(sorted((k, sig(v)) for k, v in node.kwargs.items())) if node.kwargs else (),
        wanted,
    )


def _is_handle(a: Any) -> bool:
    return type(a) is Handle


def _requires_grad(h: Handle) -> bool:
    if not h.dtype.is_floating_point and not h.dtype.is_complex:
        return False
    if h.node_index < 0 and h.ref is not None:
        t = h.ref()
        if t is not None:
            return bool(t.requires_grad)
    return True


def _fresh(h: Handle, gen: torch.Generator, written: bool) -> torch.Tensor:
    stride = h.stride if h.stride is not None and len(h.stride) == len(h.shape) else None
    if stride is None:
        t = torch.empty(h.shape, dtype=h.dtype)
    else:
        t = torch.empty_strided(h.shape, stride, dtype=h.dtype)
    if h.dtype.is_floating_point or h.dtype.is_complex:
        t.normal_(generator=gen)
    else:
        t.zero_()
    return t.requires_grad_(not written and _requires_grad(h))


def _measure_one(node: OpNode, wanted: tuple[bool, ...]) -> Workspace:
    gen = torch.Generator().manual_seed(0)
    leaves: list[torch.Tensor] = []
    written = {id(arg_at(node.args, node.kwargs, w)) for w in node.info.writes}

    def build(a: Any) -> Any:
        if _is_handle(a):
            t = _fresh(a, gen, id(a) in written)
            if t.requires_grad:
                leaves.append(t)
            return t
        if isinstance(a, list):
            return [build(e) for e in a]
        return a

    args = [build(a) for a in node.args]
    kwargs = {k: build(v) for k, v in node.kwargs.items()} if node.kwargs else {}
    with torch.random.fork_rng(devices=[]):  # random ops leave the caller's stream alone
        return _run_measured(node, args, kwargs, leaves, wanted)


def _run_measured(
    node: OpNode,
    args: list[Any],
    kwargs: dict[str, Any],
    leaves: list[torch.Tensor],
    wanted: tuple[bool, ...],
) -> Workspace:
    try:
        with torch.no_grad():  # a lambda: measure() takes a device= of its own
            fwd = measure(lambda: node.op(*args, **kwargs))
        saves: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saves.append((t.data_ptr(), tuple(t.shape), t.stride()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = node.op(*args, **kwargs)
        outs = res if isinstance(res, (tuple, list)) else (res,)
        mine = {
            (o.data_ptr(), tuple(o.shape), o.stride())
            for o in outs
            if isinstance(o, torch.Tensor) and o.data_ptr() != 0
        }
        output_saves = sum(1 for k in saves if k in mine)
        roots = [
            o
            for o, w in zip(outs, wanted, strict=False)
            if w and isinstance(o, torch.Tensor) and o.requires_grad
        ]
        bwd_peak, input_grads = 0, -1
        if roots and leaves:
            grads = [torch.ones_like(o) for o in roots]
            bwd = measure(torch.autograd.grad, roots, leaves, grads, allow_unused=True)
            bwd_peak, input_grads = bwd.peak_bytes - bwd.end_bytes, bwd.end_bytes
    except CkptGraphError:
        raise
    except Exception:  # fresh tensors the op rejects (value checks): not measured
        return _ZERO
    return Workspace(
        max(bwd_peak, 0), max(fwd.peak_bytes - fwd.end_bytes, 0), output_saves, input_grads
    )


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
        if any(o is not None and o.kept and not o.reason.startswith("engine") for o in n.outputs)  # type: ignore[union-attr]
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
            :func:`~ckpt_graph._liveness_costs.measure_workspaces`; none when omitted.

    Example:
        >>> g = from_region(region, workspaces=measure_workspaces(region))  # doctest: +SKIP
        >>> simulate(g, kept_ops_of(region)).peak_total_bytes  # doctest: +SKIP
    """
    from ._liveness import SimGraph, SimOp, SimValue

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
            if out.kept and (node.index not in free or (out.reason or "").startswith("engine")):
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
