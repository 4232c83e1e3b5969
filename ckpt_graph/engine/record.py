"""The recorder: a ``TorchDispatchMode`` that turns every aten op of a region into an op node.

See Note [Mutation and views] in ``mutation.py`` for in-place ops, views and kept values.
"""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING, Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph.engine import graph
from ckpt_graph.engine.debug import checksums
from ckpt_graph.engine.decisions import resolve
from ckpt_graph.engine.graph import _OP_INFO, Handle, OpInfo, OpNode, arg_at, op_info
from ckpt_graph.engine.mutation import (
    after_write,
    before_write,
    capture_rng,
    index_storage,
    mark_written,
)

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["KEEP", "Recorder", "decide", "record_node"]

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

# Note [Recording fast path]
# Most ops of a forward are plain: they write no argument, draw no random numbers and
# return one tensor (fresh, or a view). When the policy stack is constant
# PREFER_RECOMPUTE ("recompute_all" alone or nested) or has a callable policy (which
# ``decide`` then asks), and the op has no keyword arguments,
# ``Recorder.__torch_dispatch__`` records such an op inline, with the same result as the
# general path (``_record_op``, ``record_node``, ``decide``). Beyond saving calls, it saves
# objects: every object the recorder keeps counts towards the garbage collector's next
# young-generation pass, and those passes (which also walk the region's handles and
# nodes) were the largest single part of the per-op cost.
#   1. Arguments are scanned once; a tensor whose handle is current (same object, same
#      version) is looked up inline, anything else goes through ``Region.handle_of``.
#   2. Tuples are shared where equal (they are immutable): an op node whose only input
#      handle is the only output of its producer uses the producer's ``outputs`` tuple as
#      its ``inputs`` (and as its ``args`` when that is the only argument); when every
#      argument is a distinct tensor, ``inputs`` is the ``args`` tuple.
#   3. Output shapes are shared within a region (``Region._shapes``): equal
#      ``torch.Size`` objects, one per distinct shape instead of one per op.
#   4. An ``OpOverload`` is called through its C++ ``_op`` (its ``__call__`` only forwards).
#   5. Ops enter the fast path by id (``OpOverload.__hash__`` is Python code) after the
#      general path computed their ``OpInfo`` once; ``_PLAIN`` holds the op objects, so
#      ids are never reused while they are in it. ``ones_like`` always takes the general
#      path (the seed gradient of a backward must not be recorded).
# An op that returns no single tensor (tuple, list, non-tensor) finishes through
# ``record_node``. Everything else (in-place and random ops, keyword arguments, debug
# regions, other policies, a compiled caller) takes the general path.
_PLAIN: dict[int, tuple[Any, OpInfo]] = {}

# Decisions that keep a value, and whether they keep it in host memory.
KEEP = {
    CheckpointPolicy.MUST_SAVE: False,
    CheckpointPolicy.PREFER_SAVE: False,
    CheckpointPolicy.MUST_CPU_OFFLOAD: True,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: True,
}
_KEEP_IDS = frozenset(id(d) for d in KEEP)  # for every op: Enum.__hash__ is Python code


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
        region = self.region
        constant = region._constant
        if (
            kwargs
            or (constant is not _RECOMPUTE and constant is not None)
            or not region._recording
            or region.debug
            or _dynamo_callback() is not None
        ):
            return self._dispatch(func, args, kwargs)
        entry = _PLAIN.get(id(func))
        if entry is None or _current_task() != region._task:
            return self._dispatch(func, args, kwargs)
        # See Note [Recording fast path].
        if region._unsettled:
            region._settle()
        nodes = region.nodes
        ids = region._ids
        inputs: list[Handle] = []
        h_args = list(args)
        only_tensors = True
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                h = ids.get(id(a))
                if h is None or (ref := h.ref) is None or ref() is not a:
                    h = region.handle_of(a)
                else:
                    try:
                        version = a._version
                    except RuntimeError:
                        version = 0
                    if h.version != version or h.superseded:
                        h = region.handle_of(a)
                h_args[i] = h
                inputs.append(h)
            else:
                only_tensors = False
                if type(a) is list or type(a) is tuple:
                    h_args[i] = region._scan_list(a, inputs)
        n = len(inputs)
        uniq: tuple[Any, ...]  # distinct input handles
        if n == 1:
            h = inputs[0]
            uniq = nodes[h.node_index].outputs if h.node_index >= 0 else ()
            if len(uniq) != 1 or uniq[0] is not h:
                uniq = (h,)
            h_tuple = uniq if only_tensors else tuple(h_args)
        else:
            h_tuple = tuple(h_args)
            if n == 2 and inputs[0] is not inputs[1]:
                uniq = h_tuple if only_tensors else (inputs[0], inputs[1])
            else:
                uniq = tuple(dict.fromkeys(inputs))
                if only_tensors and len(uniq) == len(h_tuple):
                    uniq = h_tuple
        out = func._op(*args) if type(func) is OpOverload else func(*args)
        info = entry[1]
        if kwargs is None:
            kwargs = {}
        if not isinstance(out, _Tensor):
            record_node(region, func, info, h_tuple, kwargs, uniq, out, None, args, kwargs, None)
            return out
        index = len(nodes)
        node = OpNode(index, func, info, h_tuple, kwargs, uniq)
        for h in uniq:
            h.uses += 1
        h = Handle(out, index, 0)
        shape = h.shape
        try:
            h.shape = region._shapes.setdefault(shape, shape)
        except TypeError:  # symbolic sizes are not hashable: no sharing
            h.shape = shape
        if info.view_outputs:  # as in record_node
            h.version = -1
            region._unsettled.append(h)
            h.is_view = True
            if uniq:
                b = uniq[0]
                b.has_views = True
                h.base = b.base or b
                h.base_writes = h.base.writes
        ids[id(out)] = h
        node.outputs = (h,)
        nodes.append(node)
        if constant is None:  # callable policies decide
            decide(region, node, out, args, kwargs, None, (out,))
            return out
        node.decision = _RECOMPUTE
        node.decided_by = "policy"
        node.module_path = region._modules.current_path
        return out

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        """The general path: any op, any policy stack."""
        if kwargs is None:
            kwargs = {}
        if _dynamo_callback() is not None:
            prior = _set_eval_frame(None)
            try:
                return _record_op(self.region, func, args, kwargs)
            finally:
                _set_eval_frame(prior)
        return _record_op(self.region, func, args, kwargs)


def _record_op(region: Region, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Backward run inside the region, and the region's own recompute, are not recorded.
    if (
        not region._recording
        or _current_task() != region._task
        or (func is _ONES_LIKE and _seed_gradient())
    ):
        return func(*args, **kwargs)
    if region._unsettled:
        region._settle()
    info = _OP_INFO.get(func) or op_info(func)
    if (
        not info.writes
        and not info.is_random
        and not info.options
        and func is not _ONES_LIKE
        and id(func) not in _PLAIN
    ):
        _PLAIN[id(func)] = (func, info)
    h_args, h_kwargs, inputs = region._scan(args, kwargs)
    overwritten = None
    undo = None
    kept_bytes = region.kept_bytes
    if info.writes:
        undo = _write_state(region, info, args, kwargs, h_args, h_kwargs)
        if info.silent_writes:
            _keep_silently_written(region, info, args, kwargs, h_args, h_kwargs)
        overwritten = before_write(region, info, args, kwargs, h_args, h_kwargs)
    rng = capture_rng(args, kwargs) if info.is_random else None
    try:
        out = func(*args, **kwargs)
    except BaseException:
        if undo is not None:
            _restore(region, undo)
            region.kept_bytes = kept_bytes
        raise
    if info.options and isinstance(out, torch.Tensor):
        h_kwargs = _resolved_options(info, h_kwargs, out)
    record_node(region, func, info, h_args, h_kwargs, inputs, out, rng, args, kwargs, overwritten)
    return out


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


# Note [Silent writes]
# Some writes bump no version counter (``OpInfo.silent_writes``): CPU ``native_batch_norm``
# updating running statistics, ``rrelu_with_noise`` filling its noise argument. Autograd
# saves ``noise`` before the op runs, and eager's backward reads whatever the tensor holds
# then: the values the op wrote. A recomputed handle of the written argument would give
# the values before the write (``empty_like``'s garbage), so the written argument is kept
# as an alias of the forward tensor before the op runs (reason ``SILENT_WRITE``): the alias
# sees the write, as eager's saved tensor does, and ``before_write`` does not replace it by
# a copy. Region inputs (running statistics) are kept anyway, and copied before the write
# for the op nodes that read them earlier.


def _keep_silently_written(
    region: Region,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
) -> None:
    """Keep recomputed arguments a silent write changes. See Note [Silent writes]."""
    for w in info.writes:
        t = arg_at(args, kwargs, w)
        h = arg_at(h_args, h_kwargs, w)
        if not isinstance(t, torch.Tensor) or not isinstance(h, Handle) or h.node_index < 0:
            continue
        if h.reason is None:
            region._keep(h, t, graph.SILENT_WRITE, False)
            if not h.is_view:
                region.kept_bytes += h.nbytes
            if region._by_storage is not None:
                index_storage(region, h)
        elif h.reason is graph.POLICY or h.reason is graph.TAG:
            h.reason = graph.SILENT_WRITE  # already an alias; ``before_write`` must not copy it


# Note [Failed in-place ops]
# ``before_write`` prepares a region for an in-place op before the op runs: it supersedes
# the old values of the written tensor and of its view bases, and replaces kept values in
# the written storage by copies. An op can still raise (``y[0:2].add_(torch.ones(3))``: a
# shape error), and code may catch that and go on; eager then has nothing changed. So the
# handles ``before_write`` (and ``_keep_silently_written``) may touch are noted first
# (``_write_state``: the view bases of each written handle and every kept value in a
# written storage; only for ops that write) and restored with ``kept_bytes`` if the op
# raises (``_restore``), and nothing is recorded. The storage index
# is rebuilt at the next write. Without this, a saved tensor of the base raised an error
# about `.data` in backward.
_Undo = list[tuple[Handle, bool, Any, int, Any, str | None]]


def _write_state(
    region: Region,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
) -> _Undo:
    """What ``before_write`` may change. See Note [Failed in-place ops]."""
    touched: dict[int, Handle] = {}
    by_storage = region._by_storage
    for w in info.writes:
        t = arg_at(args, kwargs, w)
        h = arg_at(h_args, h_kwargs, w)
        if not isinstance(t, torch.Tensor) or not isinstance(h, Handle):
            continue
        touched[id(h)] = h
        while h.is_view and h.node_index >= 0 and region.nodes[h.node_index].inputs:
            h = region.nodes[h.node_index].inputs[0]
            touched[id(h)] = h
        key = t.untyped_storage().data_ptr()
        if by_storage is not None:
            entries: Any = by_storage.get(key, ())
        else:  # not built yet: the first write of the region (see ``before_write``)
            entries = [
                o
                for o in (*region.inputs, *(o for n in region.nodes for o in n.outputs))
                if o is not None
                and o.value is not None
                and o.offload_device is None
                and o.value.untyped_storage().data_ptr() == key
            ]
        for k in entries:
            touched[id(k)] = k
    return [(h, h.superseded, h.value, h.version, h.ref, h.reason) for h in touched.values()]


def _restore(region: Region, undo: _Undo) -> None:
    """Undo ``before_write`` for an op that raised. See Note [Failed in-place ops]."""
    for h, superseded, value, version, ref, reason in undo:
        h.superseded, h.value, h.version, h.ref, h.reason = superseded, value, version, ref, reason
    region._by_storage = None


# ----------------------------------------------------------------- op nodes


def record_node(
    region: Region,
    op: Any,
    info: OpInfo,
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
    inputs: tuple[Handle, ...],
    out: Any,
    rng: tuple[torch.Generator, torch.Tensor] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    overwritten: Handle | None,
) -> None:
    if isinstance(out, torch.Tensor):
        outs: tuple[Any, ...] | list[Any] = (out,)
        is_tuple = False
    elif isinstance(out, (tuple, list)):
        outs, is_tuple = out, True
    else:
        return  # no tensor output (item(), sizes): nothing to recompute
    index = len(region.nodes)
    node = OpNode(index, op, info, h_args, h_kwargs, inputs)
    if is_tuple:
        node.out_is_tuple = True
    if rng is not None:
        node.rng = rng
    for h in inputs:
        h.uses += 1
    previous: Handle | None = None
    if info.writes:
        previous = mark_written(region, info, h_args, h_kwargs, args, kwargs)
    ids = region._ids
    if not is_tuple and not info.writes and not info.view_outputs:
        h = Handle(out, index, 0)  # the common case: one fresh tensor
        ids[id(out)] = h
        node.outputs = (h,)
    else:
        handles: list[Handle | None] = []
        for j, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                handles.append(None)
                continue
            h = Handle(o, index, j)
            if info.returns_written:
                h.version = -1
                region._unsettled.append(h)
                if previous is not None:  # See Note [Mutation and views], rule 6.
                    h.is_view, h.has_views = previous.is_view, previous.has_views
                    h.base = previous.base
                    if h.base is not None:
                        h.base_writes = h.base.writes
            elif info.view_outputs:
                h.version = -1
                region._unsettled.append(h)
                h.is_view = True
                if inputs:
                    b = inputs[0]
                    b.has_views = True
                    h.base = b.base or b
                    h.base_writes = h.base.writes
            ids[id(o)] = h
            handles.append(h)
        node.outputs = tuple(handles)
    if info.writes and region._writing is not None:  # See Note [Mutation and views], rule 3.
        after_write(region, node.outputs[0] if len(node.outputs) == 1 else None)
    if region.debug:
        node.stack = "".join(traceback.format_stack(limit=14)[:-4])
        node.checksums = checksums(outs)
    region.nodes.append(node)
    decide(region, node, out, args, kwargs, overwritten, outs)


def decide(
    region: Region,
    node: OpNode,
    out: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    overwritten: Handle | None,
    outs: Any,
) -> None:
    decision = region._constant
    if decision is CheckpointPolicy.PREFER_RECOMPUTE and overwritten is None:
        # Fast path: "recompute_all" alone, an op that needs nothing kept.
        node.decision = decision
        node.decided_by = "policy"
        node.module_path = region._modules.current_path
        if not node.info.is_random or node.rng is not None:
            return
    if decision is not None:
        by = "policy"
    else:
        ctx = region._ctx
        assert ctx is not None
        ctx._set(node.index, node.op, node.info, out, args, kwargs)
        region._recording = False  # a policy's own tensor ops are not part of the region
        try:
            decision, by = resolve(region._policies, ctx, out, node.op, args, kwargs)
        finally:
            region._recording = True
            ctx._clear()
    node.decision = decision
    node.decided_by = by
    node.module_path = region._modules.current_path
    keep = id(decision) in _KEEP_IDS
    reason = graph.POLICY
    if node.info.is_random and node.rng is None and overwritten is None:
        # No generator replay for this device (see Note [RNG replay]): recomputing would
        # draw other values, so the engine keeps them, whatever the policy or a tag says.
        keep = True
        reason = graph.RANDOM_WITHOUT_REPLAY
    elif not keep and overwritten is None:
        return
    for o, h in zip(outs, node.outputs, strict=True):
        if h is None:
            continue
        if overwritten is not None:
            h.keep(region._detached(o), graph.INPLACE_ON_KEPT)
            overwritten.value = None  # superseded: nobody used the old version
        elif keep:
            region._keep(h, o, reason, KEEP.get(decision, False))
        else:
            continue
        if not h.is_view and overwritten is None:
            # A view's bytes belong to its base; an in-place version's were counted
            # with the kept value it overwrote.
            region.kept_bytes += h.nbytes
        if region._by_storage is not None:
            index_storage(region, h)
