"""The recorder: a ``TorchDispatchMode`` that turns every aten op of a region into an op node.

See Note [Mutation and views] in ``mutation/writes.py`` for in-place ops, views and kept values.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph.engine.graph import Handle
from ckpt_graph.engine.kept_lifetime import count_readers
from ckpt_graph.engine.mutation.failed_writes import restore, write_state
from ckpt_graph.engine.mutation.silent_writes import keep_silently_written
from ckpt_graph.engine.mutation.writes import before_write
from ckpt_graph.engine.op_info import OpInfo, op_info
from ckpt_graph.engine.outputs import decide, record_node
from ckpt_graph.engine.replay import capture_rng

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["Recorder"]

_current_task = torch._C._current_graph_task_id
try:  # dynamo's per-thread frame callback (C functions; no import of torch._dynamo)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # pragma: no cover - builds without dynamo

    def _dynamo_callback() -> Any:  # type: ignore[misc]
        return None

    def _set_eval_frame(callback: Any) -> Any:  # type: ignore[misc]
        return None


_ONES_LIKE = torch.ops.aten.ones_like.default
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_Tensor = torch.Tensor
# Results with tensors to record: one tuple for every op, not one built per op.
_RECORDED = (torch.Tensor, tuple, list)
_NO_KWARGS: dict[str, Any] = {}  # shared by every op node called without keywords; never written

# Note [One recording path]
# Every op of a region goes through ``Recorder.__torch_dispatch__``: gate, scan, prepare writes and random
# draws (only when the op's flags ask), run, build the op node, decide. There is no second,
# inline copy of these steps for common ops (two copies drift apart). The path
# is cheap for the common op, which writes nothing, draws nothing and returns one tensor,
# because the work per op is shaped for it:
#   1. Facts about an op are computed once and found by ``id(op)`` (``_OPS``):
#      ``OpOverload.__hash__`` is Python code. ``_OPS`` holds the op objects, so their ids
#      are never reused while they are in it. An ``OpOverload`` is called through its C++
#      ``_op`` (its ``__call__`` only forwards).
#   2. Arguments are scanned once; a tensor whose handle is current (same object, same
#      version) is looked up inline, anything else goes through ``Region.handle_of``.
#   3. Every object the recorder keeps counts towards the garbage collector's next
#      young-generation pass, and those passes (which also walk the region's handles and
#      nodes) were the largest single part of the per-op cost. So tuples are shared where
#      equal (they are immutable): an op node whose only input handle is the only output
#      of its producer uses the producer's ``outputs`` tuple as its ``inputs`` (and as its
#      ``args`` when that is the only argument); when every argument is a distinct tensor,
#      ``inputs`` is the ``args`` tuple. Op nodes called without keywords share one empty
#      ``kwargs`` dict. Output shapes are shared within a region (``RecordingState.shapes``): one
#      ``torch.Size`` per distinct shape instead of one per op. The handle is its own weak
#      reference, and the pass graph rows are shared (Note [Objects made per op] in graph.py).
#   4. Writes (``before_write`` and its undo), RNG capture and factory options run only for
#      ops whose ``OpInfo`` asks for them (``_OpEntry.special``).
# The seed gradient of a backward (``ones_like`` called by autograd) is never recorded.


# Note [Tools outside a region]
# What a region records, and so whether a memory_budget plan matches it, must not depend on
# the tools a user wraps around a step (a flop counter for MFU, the profiler, a logging or
# debug dispatch mode, MemTracker, anomaly mode). It does not, for these reasons:
#   1. The recorder is pushed when the region opens, so it sits above every mode entered
#      before: it sees each op first, as the program issued it. An outer mode handles the op
#      after the recorder ran it, with the recorder popped: what the outer mode does then
#      (FlopCounterMode's ``decompose`` of ops it has no formula for, a logging mode's
#      checksums, MemTracker's bookkeeping) never reaches the recorder.
#   2. Planning and calibrating ``flops_per_byte`` run inside the region's recorder (at
#      region enter and exit) and run their own ops with every mode disabled (see
#      ``calibrated_flops_per_byte``), so neither the recorder nor a user's mode sees them.
#   3. The profiler's ``record_function`` ranges, around the model and around each
#      recomputed op, are ops that return no tensor: never recorded.
#   4. Anomaly mode, the profiler and module-tracking hooks change no op: they add autograd
#      metadata, events and Python bookkeeping only.
# tests/planner/test_outer_tools.py runs a planned step under each tool: same op nodes, same
# kept values and recompute, no re-plan, gradients bitwise those of eager under the tool.
# Known limitations: a tool whose *Python* hooks run tensor ops inside the region (a module
# forward hook that computes statistics of activations) adds op nodes like any user code;
# and a mode entered *inside* a region sits above the recorder, which then records the ops
# the mode issues itself (a logging mode's checksums), indistinguishable from the program's
# (the mode stack looks the same for both): enter tools outside the region.


class _OpEntry:
    """What the recorder needs of one op, computed once. See Note [One recording path]."""

    __slots__ = ("call", "info", "op", "special")

    def __init__(self, op: Any) -> None:
        self.op = op  # pins the object, so that its id is not reused while cached
        self.info = info = op_info(op)
        self.call = op._op if type(op) is OpOverload else op
        self.special = bool(info.writes or info.is_random or info.options)


_OPS: dict[int, _OpEntry] = {}


def _seed_gradient() -> bool:
    """Whether ``ones_like`` is autograd making the implicit seed gradient of a backward."""
    frame: Any = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "_make_grads":
            return True
        frame = frame.f_back
    return False


class Recorder(TorchDispatchMode):
    """Records the aten ops of one region. Entered and exited by the region."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region
        self.recording = region.recording  # the same object for the region's lifetime

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in torch._disable_dynamo by default, which costs
        # microseconds per op. The recorder only needs it while dynamo's frame callback is
        # set in this thread (a compiled caller: dynamo would compile the recorder's own
        # frames), and checks that itself in a few nanoseconds.
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run one op and record it. See Note [One recording path]."""
        if _dynamo_callback() is not None:
            return self._without_dynamo(func, types, args, kwargs)
        if not kwargs:  # torch passes a new empty dict
            kwargs = _NO_KWARGS
        region, recording = self.region, self.recording
        # Backward run inside the region, and the region's own recompute, are not recorded.
        if (
            not recording.on
            or _current_task() != recording.task
            or (func is _ONES_LIKE and _seed_gradient())
        ):
            return func(*args, **kwargs)
        entry = _OPS.get(id(func))
        if entry is None:
            entry = _OPS[id(func)] = _OpEntry(func)
        if recording.unsettled:
            region.settle()
        h_args, h_kwargs, inputs = _scan(region, args, kwargs)
        rng = None
        overwritten = None
        if entry.special:
            out, rng, overwritten, h_kwargs = _run_special(
                region, entry, args, kwargs, h_args, h_kwargs
            )
        elif kwargs:
            out = entry.call(*args, **kwargs)
        else:
            out = entry.call(*args)
        if not isinstance(out, _RECORDED):
            return out  # no tensor output (item(), sizes): nothing to recompute
        info = entry.info
        node = record_node(region, func, info, h_args, h_kwargs, inputs, out, rng, args, kwargs)
        if node.decision is not _RECOMPUTE or overwritten is not None or info.is_random:
            decide(region, node, out, args, kwargs, overwritten)
        return out

    def _without_dynamo(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None
    ) -> Any:
        """Record with dynamo's frame callback unset: a compiled caller must not compile the
        recorder's own frames (see ``_should_skip_dynamo``)."""
        prior = _set_eval_frame(None)
        try:
            return self.__torch_dispatch__(func, types, args, kwargs)
        finally:
            _set_eval_frame(prior)


def _scan(
    region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
    """Replace tensors by handles in an op's arguments (flat scan, no pytree).

    Returns:
        The arguments with handles, the keyword arguments with handles, and the distinct
        input handles, sharing tuples where equal (see Note [One recording path], rule 3).
    """
    ids = region.recording.ids
    inputs: list[Handle] = []
    h_args: list[Any] | None = None  # made at the first argument that is not a tensor
    for a in args:
        if isinstance(a, _Tensor):
            h = ids.get(id(a))
            if h is None or h() is not a or h.unlinked:  # See Note [A handle is a weak reference].
                h = region.handle_of(a)
            else:
                try:  # version_of(), inlined
                    version = a._version
                except RuntimeError:
                    version = 0
                if h.version != version or h.superseded:
                    h = region.handle_of(a)
            inputs.append(h)
            if h_args is not None:
                h_args.append(h)
        else:
            if h_args is None:
                h_args = inputs.copy()
            if type(a) is list or type(a) is tuple:
                a = _scan_list(region, a, inputs)
            h_args.append(a)
    if kwargs:
        if h_args is None:
            h_args = inputs.copy()
        kwargs = {k: _scan_one(region, v, inputs) for k, v in kwargs.items()}
    n = len(inputs)
    uniq: tuple[Any, ...]  # distinct input handles
    if n == 1:
        h = inputs[0]
        # The producer's outputs tuple, when ``h`` is its only output (``is`` checks it).
        uniq = region.nodes[h.node_index].outputs if h.node_index >= 0 else ()
        if len(uniq) != 1 or uniq[0] is not h:
            uniq = (h,)
        return (uniq if h_args is None else tuple(h_args)), kwargs, uniq
    if h_args is None:  # every argument a tensor
        h_tuple = tuple(inputs)
        if n == 2 and inputs[0] is not inputs[1]:
            return h_tuple, kwargs, h_tuple
        uniq = tuple(dict.fromkeys(inputs))
        return h_tuple, kwargs, (h_tuple if len(uniq) == n else uniq)
    if n == 2 and inputs[0] is not inputs[1]:
        uniq = (inputs[0], inputs[1])
    else:
        uniq = tuple(dict.fromkeys(inputs))
    return tuple(h_args), kwargs, uniq


def _scan_list(region: Region, a: list[Any] | tuple[Any, ...], inputs: list[Handle]) -> Any:
    for e in a:
        if isinstance(e, _Tensor):
            return [_scan_one(region, e, inputs) for e in a]
    return a


def _scan_one(region: Region, a: Any, inputs: list[Handle]) -> Any:
    if isinstance(a, _Tensor):
        h = region.handle_of(a)
        inputs.append(h)
        return h
    if type(a) is list or type(a) is tuple:
        return _scan_list(region, a, inputs)
    return a


def _run_special(
    region: Region,
    entry: _OpEntry,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
) -> tuple[Any, Any, Handle | None, dict[str, Any]]:
    """Run an op that writes, draws random numbers or is a factory.

    Returns:
        The op's result, the generator state it drew from (or ``None``), the kept handle
        it overwrites without a copy (see ``before_write``), and the keyword arguments
        with handles, factory options resolved (see Note [Factory ops]).
    """
    info = entry.info
    overwritten = None
    undo = None
    kept_bytes = region.kept_bytes
    if info.writes:
        if not region.recording.counting:  # See Note [Kept values live no longer than in eager].
            count_readers(region)
        undo = write_state(region, info, args, kwargs, h_args, h_kwargs)
        if info.silent_args:
            keep_silently_written(region, info, args, kwargs, h_args, h_kwargs)
        overwritten = before_write(region, info, args, kwargs, h_args, h_kwargs)
    rng = capture_rng(args, kwargs) if info.is_random else None
    try:
        out = entry.call(*args, **kwargs)
    except BaseException:
        if undo is not None:
            restore(region, undo)
            region.kept_bytes = kept_bytes
        raise
    if info.options and isinstance(out, _Tensor):
        h_kwargs = _resolved_options(info, h_kwargs, out)
    return out, rng, overwritten, h_kwargs


# Note [Factory ops]
# An op without tensor arguments (``rand``, ``full``, ``arange``, ``empty``, ``zeros``) takes
# its dtype, layout and device from global defaults when its keyword arguments leave them
# ``None``: ``torch.get_default_dtype()`` for floating values, the C++ default device. A
# replay under other defaults (``torch.set_default_dtype`` between forward and backward)
# would compute other values, so the recorder replaces such ``None``s by what the op
# produced. Which ops: from the schema (``OpInfo.options``: keyword-only ``dtype`` /
# ``layout`` / ``device`` and no tensor argument), not a list. Ops with a tensor argument
# (``*_like``, ``new_zeros``) resolve ``None`` from that tensor, which the replay has too.
# Other globals that change an op's result are fixed per region instead; see Note
# [Replay globals] in replay.py.
_OPTION_OF = {
    "dtype": lambda t: t.dtype,
    "layout": lambda t: t.layout,
    "device": lambda t: t.device,
}


def _resolved_options(info: OpInfo, kwargs: dict[str, Any], out: torch.Tensor) -> dict[str, Any]:
    """``kwargs`` with the factory options left ``None`` set from ``out``."""
    missing = [name for name in info.options if kwargs.get(name) is None]
    if not missing:
        return kwargs
    kwargs = dict(kwargs)
    for name in missing:
        kwargs[name] = _OPTION_OF[name](out)
    return kwargs
