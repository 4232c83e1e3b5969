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
#    figures come from the backend that will run, not from a table of formulas. The same
#    backward says whether each input gradient has its input's strides (``own_layout``:
#    Note [Parameters' gradients in backward] rule 2).
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
#    Measuring is not possible while another ``measure``, a ``StepProbe`` or a profiler
#    runs (ours would raise or abandon the probe), nor while a region records in this
#    thread (it would record the ops): it stops there, with what was measured so far.
# 4. A region's own op nodes are not touched: ``OpSignatures`` reads their metadata
#    (shapes, dtypes, strides, which inputs require gradients, which are written, which
#    outputs are consumed) and keeps it, not the nodes, handles or tensors; the ops run
#    later on fresh tensors made from it, with grad mode on, inference mode and autocast
#    off, whatever the caller's modes. No tensor of the program is read or written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ckpt_graph._errors import CkptGraphError, CkptGraphValueError
from ckpt_graph.engine.graph import Handle, arg_at
from ckpt_graph.engine.region import current_region
from ckpt_graph.memory import busy, measure, measure_with_result
from ckpt_graph.planner.records import NO_WORKSPACE, Workspace

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["MEASURED", "OpSignatures", "measure_workspaces"]


# Workspaces measured in this process, by op signature (rule 2); at most _LIMIT entries.
MEASURED: dict[tuple[Any, ...], Workspace] = {}
_LIMIT = 4096


def measure_workspaces(region: Region) -> dict[int, Workspace]:
    """Measure the workspace of each op node of a recorded region (CPU tensors only).

    See Note [Measuring op workspaces]. The result is meant for
    ``from_region(region, workspaces=...)``; ops measured before an interruption (another
    ``measure()`` or a profiler running) are in it, the others are not.

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
    signatures = OpSignatures(region)
    signatures.measure()
    return signatures.known(partial=True) or {}


class _Arg(NamedTuple):
    """A tensor argument of a recorded op, as metadata (rule 4): a fresh tensor is made
    from it (rule 1)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None
    requires_grad: bool
    written: bool


class _Call(NamedTuple):
    """One op call to measure: the op, its arguments with tensors as metadata, and which
    of its outputs later ops or the loss consume."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    wanted: tuple[bool, ...]


class OpSignatures:
    """The distinct op signatures of a recorded region, to measure their workspaces later.

    Built from the region's metadata (it holds no tensor, and no op node or handle of the
    region), so that the measurement can wait until the region's memory is gone and no
    step is being measured: See Note [Workspaces in budget planning] in ``region_graph``.

    Attributes:
        calls: per distinct signature not yet measured in this process, the call to measure.

    Example:
        >>> signatures = OpSignatures(region)  # doctest: +SKIP
        >>> signatures.known() or signatures.measure()  # doctest: +SKIP
    """

    def __init__(self, region: Region) -> None:
        consumed = {id(i) for node in region.nodes for i in node.inputs}
        last = len(region.nodes) - 1
        self._keys: dict[int, tuple[Any, ...]] = {}  # op index -> its signature
        self.calls: dict[tuple[Any, ...], _Call] = {}
        for node in region.nodes:
            if not _measurable(node):
                continue
            wanted = tuple(
                o is not None and (id(o) in consumed or node.index == last) for o in node.outputs
            )
            key = _signature(node, wanted)
            self._keys[node.index] = key
            if key not in MEASURED and key not in self.calls:
                self.calls[key] = _call(node, wanted)

    def known(self, partial: bool = False) -> dict[int, Workspace] | None:
        """The workspace of each measurable op, from what this process measured; ``None``
        if one is not measured yet (``partial``: those that are)."""
        out: dict[int, Workspace] = {}
        for index, key in self._keys.items():
            ws = MEASURED.get(key)
            if ws is None:
                if not partial:
                    return None
                continue
            out[index] = ws
        return out

    def measure(self) -> dict[int, Workspace] | None:
        """Measure the signatures not measured yet; the workspace of each measurable op, or
        ``None`` if measuring is not possible now (a ``measure()``, a probe or a profiler
        runs, or a region records in this thread: rule 5 of Note [Workspaces in budget
        planning]); what was measured before an interruption is kept."""
        for key, call in list(self.calls.items()):
            ws = MEASURED.get(key)
            if ws is None:
                if not _can_measure():
                    return None
                try:
                    ws = _measure_one(call)
                except CkptGraphError:  # another measure() or a profiler is running
                    return None
                if len(MEASURED) >= _LIMIT:
                    MEASURED.clear()
                MEASURED[key] = ws
            del self.calls[key]
        return self.known()


def _can_measure() -> bool:
    """Whether measuring an op now leaves every measurement and recording alone."""
    if busy():  # a measure() or a StepProbe: a measure() of ours would abandon the probe
        return False
    region = current_region()
    return region is None or not region.recording.on  # its ops would be recorded


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


def _call(node: OpNode, wanted: tuple[bool, ...]) -> _Call:
    """The call of ``node`` with its tensors as metadata (rule 4)."""
    written = {id(arg_at(node.args, node.kwargs, w)) for w in node.info.writes}

    def meta(a: Any) -> Any:
        if _is_handle(a):
            stride = a.stride if a.stride is not None and len(a.stride) == len(a.shape) else None
            return _Arg(tuple(a.shape), a.dtype, stride, _requires_grad(a), id(a) in written)
        if isinstance(a, list):
            return [meta(e) for e in a]
        return a

    kwargs = {k: meta(v) for k, v in node.kwargs.items()} if node.kwargs else {}
    return _Call(node.op, tuple(meta(a) for a in node.args), kwargs, wanted)


def _fresh(a: _Arg, gen: torch.Generator) -> torch.Tensor:
    if a.stride is None:
        t = torch.empty(a.shape, dtype=a.dtype)
    else:
        t = torch.empty_strided(a.shape, a.stride, dtype=a.dtype)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        t.normal_(generator=gen)
    else:
        t.zero_()
    return t.requires_grad_(a.requires_grad and not a.written)


def _measure_one(call: _Call) -> Workspace:
    gen = torch.Generator().manual_seed(0)
    leaves: list[torch.Tensor] = []

    def build(a: Any) -> Any:
        if type(a) is _Arg:
            t = _fresh(a, gen)
            if t.requires_grad:
                leaves.append(t)
            return t
        if isinstance(a, list):
            return [build(e) for e in a]
        return a

    # Grad mode on, autocast off: the op runs as recorded, whatever the caller's modes.
    with (
        torch.random.fork_rng(devices=[]),
        torch.inference_mode(False),
        torch.enable_grad(),
        _no_autocast(),
    ):
        args = [build(a) for a in call.args]
        kwargs = {k: build(v) for k, v in call.kwargs.items()}
        return _run_measured(call, args, kwargs, leaves)


def _no_autocast() -> torch.autocast:
    return torch.autocast("cpu", enabled=False)


def _run_measured(
    call: _Call, args: list[Any], kwargs: dict[str, Any], leaves: list[torch.Tensor]
) -> Workspace:
    op = call.op
    try:
        with torch.no_grad():  # a lambda: measure() takes a device= of its own
            fwd = measure(lambda: op(*args, **kwargs))
        saves: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saves.append((t.data_ptr(), tuple(t.shape), t.stride()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = op(*args, **kwargs)
        outs = res if isinstance(res, (tuple, list)) else (res,)
        mine = {
            (o.data_ptr(), tuple(o.shape), o.stride())
            for o in outs
            if isinstance(o, torch.Tensor) and o.data_ptr() != 0
        }
        output_saves = sum(1 for k in saves if k in mine)
        roots = [
            o
            for o, w in zip(outs, call.wanted, strict=False)
            if w and isinstance(o, torch.Tensor) and o.requires_grad
        ]
        bwd_peak, input_grads, own_layout = 0, -1, None
        if roots and leaves:
            grads = [torch.ones_like(o) for o in roots]
            got, bwd = measure_with_result(
                torch.autograd.grad, roots, leaves, grads, allow_unused=True
            )
            bwd_peak, input_grads = bwd.peak_bytes - bwd.end_bytes, bwd.end_bytes
            own_layout = all(
                g is None or _same_layout(g, t) for g, t in zip(got, leaves, strict=True)
            )
    except CkptGraphError:
        raise
    except Exception:  # fresh tensors the op rejects (value checks): not measured
        return NO_WORKSPACE
    return Workspace(
        max(bwd_peak, 0),
        max(fwd.peak_bytes - fwd.end_bytes, 0),
        output_saves,
        input_grads,
        own_layout,
    )


def _same_layout(grad: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``grad`` has the strides of ``t`` (dimensions of size 1 aside, as
    ``AccumulateGrad``'s layout check)."""
    if grad.layout != torch.strided or grad.shape != t.shape:
        return False  # a sparse gradient (``embedding(sparse=True)``) has no strides
    pairs = zip(t.shape, grad.stride(), t.stride(), strict=True)
    return all(n == 1 or a == b for n, a, b in pairs)
