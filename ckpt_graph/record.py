"""The recorder: a ``TorchDispatchMode`` that turns every aten op of a region into an op node.

# Note [Mutation and views]
# Every tensor the region sees maps to the handle of the value it holds *now*
# (``Region.handle_of``): an identity map ``id(tensor) -> Handle`` whose entries are
# validated by a weak reference (ids are reused) and by the tensor's version counter.
#   1. An op whose schema writes an argument (``alias_info.is_write``, plus the few ops in
#      ``graph._UNANNOTATED_WRITES`` such as CPU ``native_batch_norm``) creates a new
#      version: the returned tensor maps to the new op node's output handle, and the old
#      handle is marked ``superseded`` so that a saved tensor of the old value raises
#      autograd's version-counter error when unpacked, as eager does.
#   2. Written arguments that the op does not return (running statistics) are dropped
#      from the map: their next use takes the tensor as it is (a kept snapshot).
#   3. A tensor whose version changed through another alias (``x[0:2].mul_(3)`` changes
#      ``x``) no longer matches its handle; its next use takes it as a kept snapshot
#      (reason ``MUTATED_ALIAS``). Correct, and rare in models; deriving the new value by
#      replaying view ops on the new base would avoid keeping it.
#   4. Kept values are shared with the forward tensors. Before an op writes a storage,
#      every kept value in that storage that some op node or saved tensor already used is
#      replaced by an exact copy (same storage offset and strides), because the write would
#      change it under them. A kept value the op overwrites with nobody else needing it is
#      not copied; its new version is kept instead (``INPLACE_ON_KEPT``), which costs no
#      memory since it is the same tensor.
#   5. The version of an in-place op's output (bumped) and of a view op's output (shared
#      with its base) is only set by autograd after this mode returns: those handles start
#      at -1 and read the tensor's version when the region next sees anything
#      (``Region._settle``), before any other op can change it.
# Replaying a recorded write in backward follows the same rule from the other side: it runs
# on the cached value itself only when that value is recomputed, not a view, has no views
# and this op is its last pending user (dropout's ``empty_like -> bernoulli_ -> div_``);
# otherwise on an exact copy (see ``realize.run_node``).
"""

from __future__ import annotations

import sys
import traceback
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from . import graph
from ._debug import checksums
from .graph import _OP_INFO, Handle, OpInfo, OpNode, arg_at, op_info
from .policies._core import resolve
from .realize import exact_copy

if TYPE_CHECKING:
    from .region import Region

__all__ = [
    "KEEP",
    "Recorder",
    "before_write",
    "capture_rng",
    "decide",
    "index_storage",
    "mark_written",
    "record_node",
    "supersede_view_bases",
]

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
# PREFER_RECOMPUTE ("recompute_all" alone or nested) and the op has no keyword arguments,
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
        if (
            kwargs
            or region._constant is not _RECOMPUTE
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
                    if h.version != version:
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
                uniq[0].has_views = True
        ids[id(out)] = h
        node.outputs = (h,)
        node.decision = _RECOMPUTE
        node.decided_by = "policy"
        node.module_path = region._modules.current_path
        nodes.append(node)
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
    if not info.writes and not info.is_random and func is not _ONES_LIKE and id(func) not in _PLAIN:
        _PLAIN[id(func)] = (func, info)
    h_args, h_kwargs, inputs = region._scan(args, kwargs)
    overwritten = (
        before_write(region, info, args, kwargs, h_args, h_kwargs) if info.writes else None
    )
    rng = capture_rng(args, kwargs) if info.is_random else None
    out = func(*args, **kwargs)
    record_node(region, func, info, h_args, h_kwargs, inputs, out, rng, args, kwargs, overwritten)
    return out


# ----------------------------------------------------------------- mutation
# See Note [Mutation and views].


def index_storage(region: Region, h: Handle) -> None:
    """Add a kept value to the region's storage index (see ``before_write``)."""
    assert region._by_storage is not None
    if h.value is not None and h.offload_device is None:
        key = h.value.untyped_storage().data_ptr()
        if key:
            region._by_storage.setdefault(key, []).append(h)


def before_write(
    region: Region,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
) -> Handle | None:
    """Copy kept values an in-place op is about to change. See Note [Mutation and views].

    Returns:
        The written argument's kept handle if it is overwritten without a copy (its
        new version must then be kept), else ``None``.
    """
    if region._by_storage is None:
        region._by_storage = {}
        for h in region.inputs:
            index_storage(region, h)
        for node in region.nodes:
            for o in node.outputs:
                if o is not None and o.value is not None:
                    index_storage(region, o)
    overwritten: Handle | None = None
    for w in info.writes:
        t = arg_at(args, kwargs, w)
        written = arg_at(h_args, h_kwargs, w)
        if not isinstance(t, torch.Tensor) or not isinstance(written, Handle):
            continue
        if not info.silent_writes:
            supersede_view_bases(region, written)
        key = t.untyped_storage().data_ptr()
        entries = region._by_storage.pop(key, None)
        if not entries:
            continue
        for k in entries:
            if k.value is None:
                continue
            if k is not written and not info.silent_writes:
                k.superseded = True  # an alias: it shares the version counter
            if k is written and k.uses == 0 and info.returns_written:
                overwritten = k  # rule 4: its new version keeps the tensor
                continue
            if k.uses == 0 and (k is not written or info.returns_written):
                continue  # nobody needs the old value (this op does if it has other outputs)
            k.value = exact_copy(k.value)
            k.version = k.value._version
            k.ref = None
            index_storage(region, k)
    return overwritten


def supersede_view_bases(region: Region, h: Handle) -> None:
    """A write through a view changes the values of the view's bases too."""
    while h.is_view and h.node_index >= 0:
        inputs = region.nodes[h.node_index].inputs
        if not inputs:
            break
        h = inputs[0]
        h.superseded = True


def mark_written(
    region: Region,
    info: OpInfo,
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Handle | None:
    """Supersede the old versions of written arguments; return the first one's handle."""
    first: Handle | None = None
    for w in info.writes:
        written = arg_at(h_args, h_kwargs, w)
        if not isinstance(written, Handle):
            continue
        written.superseded = not info.silent_writes
        if first is None:
            first = written
        if not info.returns_written:
            t = arg_at(args, kwargs, w)
            region._ids.pop(id(t), None)
    return first


def capture_rng(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Generator, torch.Tensor] | None:
    """Generator state just before a random op runs. See Note [RNG replay]."""
    gen = kwargs.get("generator")
    if gen is None:
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "cpu":
            gen = torch.default_generator
        elif device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            gen = torch.cuda.default_generators[idx]
        else:
            return None  # no replay known for this device: outputs are kept
    state = gen.get_state()
    # See Note [RNG replay]: consecutive random ops that left the generator as it was (SDPA
    # without dropout, dropout(p=0)) share one state tensor instead of holding a copy each.
    last_gen, last_state = _LAST_RNG
    if last_gen is not None and last_gen() is gen:
        last = last_state()
        if last is not None and torch.equal(last, state):
            return gen, last
    _LAST_RNG[:] = [weakref.ref(gen), weakref.ref(state)]
    return gen, state


# The generator and the state tensor of the last capture, weakly held (a region owns them).
_LAST_RNG: list[Any] = [None, None]


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
                if previous is not None:
                    h.is_view, h.has_views = previous.is_view, previous.has_views
            elif info.view_outputs:
                h.version = -1
                region._unsettled.append(h)
                h.is_view = True
                if inputs:
                    inputs[0].has_views = True
            ids[id(o)] = h
            handles.append(h)
        node.outputs = tuple(handles)
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
    keep = decision in KEEP
    if not keep and overwritten is None:
        if not node.info.is_random or node.rng is not None:
            return
        keep = True  # no generator replay for this device
    for o, h in zip(outs, node.outputs, strict=True):
        if h is None:
            continue
        if overwritten is not None:
            h.keep(region._detached(o), graph.INPLACE_ON_KEPT)
            overwritten.value = None  # superseded: nobody used the old version
        elif keep:
            region._keep(h, o, graph.POLICY, KEEP.get(decision, False))
        else:
            continue
        if not h.is_view and overwritten is None:
            # A view's bytes belong to its base; an in-place version's were counted
            # with the kept value it overwrote.
            region.kept_bytes += h.nbytes
        if region._by_storage is not None:
            index_storage(region, h)
