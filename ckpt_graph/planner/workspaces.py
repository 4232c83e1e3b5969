"""Op workspaces for the liveness simulator: memory an op allocates beyond its results.

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
#    profiler sessions and one forward and backward of the op at the real size (a region's
#    cost grows with its distinct signatures, not its ops; figures in BENCHMARKS.md,
#    "History from Notes").
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

from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph._errors import CkptGraphError, CkptGraphValueError
from ckpt_graph.engine.graph import Handle, arg_at
from ckpt_graph.memory import measure
from ckpt_graph.planner.records import NO_WORKSPACE, Workspace

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["measure_workspaces"]


_MEMO: dict[tuple[Any, ...], Workspace] = {}
_MEMO_LIMIT = 4096


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
    if region.is_open:
        raise CkptGraphValueError(
            "ckpt_graph: measure_workspaces: the region is still open; call it after the "
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
        return NO_WORKSPACE
    return Workspace(
        max(bwd_peak, 0), max(fwd.peak_bytes - fwd.end_bytes, 0), output_saves, input_grads
    )
