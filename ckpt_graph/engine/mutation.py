"""Mutation bookkeeping of the recorder: in-place ops, views, kept values, generator states.

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
#      ``x``; ``out[:, t] = h`` in an RNN loop changes ``out``) no longer matches its
#      handle. The region keeps a ``StorageHistory`` per written storage: its ``head`` is
#      the result of the last write, whose recomputation holds every write so far as long
#      as each write starts from the head or a view of it. The tensor's next use is then
#      *rebased*: an engine-made ``as_strided`` op node views the head with the tensor's
#      sizes, strides and storage offset, recomputed like any view (filling a buffer step
#      by step keeps nothing, where a snapshot per step cost a copy of the buffer per
#      write: a quadratic peak). Otherwise (a write that started elsewhere, such as chunks
#      with counters of their own, several written arguments, a host-offloaded head) the
#      next use takes the tensor as a kept snapshot (reason ``MUTATED_ALIAS``). The same
#      holds for a
#      write through an alias with a version counter of its own (``x.data.mul_(3)``, seen
#      as a ``detach`` view): the version stays, but the handle is superseded. A saved
#      tensor of the old value then cannot be served as eager would (eager reads the new
#      values, unchecked), and unpacking it raises an error naming ``.data``.
#   4. Kept values are shared with the forward tensors. Before an op writes a storage,
#      every kept value in that storage whose elements the write may touch (``overlap``:
#      exact for slices and chunks, conservative otherwise) and that some op node or saved
#      tensor already used is replaced by an exact copy (same storage offset and strides),
#      because the write would change it under them; it is also superseded (the copy
#      carries the value's version, and the handle still refers to the tensor, so that
#      the tensor's next use is rebased, rule 3). Kept values
#      of the storage the write leaves alone stay as they are: the gates of nn.LSTM are
#      chunks of one tensor (``unsafe_chunk``, each with a version counter of its own)
#      written in place one after another. A kept value the op overwrites with nobody
#      else needing it is not copied; its new version is kept instead
#      (``INPLACE_ON_KEPT``), which costs no memory since it is the same tensor.
#   5. The version of an in-place op's output (bumped) and of a view op's output (shared
#      with its base) is only set by autograd after this mode returns: those handles start
#      at -1 and read the tensor's version when the region next sees anything
#      (``Region._settle``), before any other op can change it.
#   6. A view's handle names its ``base``: the handle, not itself a view, whose storage
#      and version counter it shares (view ops take it from their input; in-place and
#      ``out=`` results from the argument they wrote). A write through a view supersedes
#      the base, in one step however many writes came before. A saved view whose tensor
#      is gone (``y[0].sin()`` saves a temporary) is checked through its base: a write
#      of the region over the base after the view was made (the base's ``writes`` passed
#      the view's ``base_writes``; the write that made the view does not count), or a
#      version change of the base tensor after it, raises as eager does.
#      Outputs of ``unsafe_chunk`` and its kin alias their input with version counters of
#      their own and no view relation: a write to one supersedes the value it was cut
#      from (nn.LSTM's gates), whose next use is rebased or a snapshot.
#   7. An in-place view op (``t_``, ``unsqueeze_``, ``as_strided_``) changes metadata
#      only, but bumps the version counter. Its replay runs on an alias with a counter of
#      its own unless it may use the value itself (below), so that the kept value it reads
#      keeps its version and later checks of it pass.
# Replaying a recorded write in backward follows the same rule from the other side: it runs
# on the cached value itself only when that value is recomputed, not a view, has no views
# and this op is its last pending user (dropout's ``empty_like -> bernoulli_ -> div_``);
# otherwise on an exact copy (see ``realize.run_node``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph.engine.graph import (
    SILENT_WRITE,
    UNANNOTATED_ALIASES,
    Handle,
    OpInfo,
    OpNode,
    arg_at,
    op_info,
)
from ckpt_graph.engine.holding import hold_copy, index_storage
from ckpt_graph.engine.replay import exact_copy

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = [
    "StorageHistory",
    "before_write",
    "capture_rng",
    "mark_written",
    "overlap",
    "rebase",
    "supersede_view_bases",
]

_AS_STRIDED = torch.ops.aten.as_strided.default
_set_versions = torch._C._autograd._unsafe_set_version_counter
_CHAIN_LIMIT = 64  # views followed back to the last write (see ``_descends``)


class StorageHistory:
    """The writes of the region to one storage. See Note [Mutation and views], rule 3.

    Attributes:
        head: handle of the value the last write returned, whose recomputation holds
            every write to the storage so far; ``None`` before the first write or once
            ``diverged``.
        roots: handles of the values written to (or through views of), not themselves
            views: a stale view of one of them can be rebased on ``head``.
        diverged: a write did not start from ``head`` (chunks with counters of their own
            written one by one): its recomputation may miss earlier writes, so stale
            values of the storage are kept as snapshots instead.
    """

    __slots__ = ("diverged", "head", "roots", "storage")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        # Histories are found by the storage's address; a storage freed during the region
        # and another allocated at its address must not share one.
        self.storage = StorageWeakRef(storage)
        self.head: Handle | None = None
        self.roots: set[Handle] = set()
        self.diverged = False


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
        silent = w in info.silent_args
        if not silent:
            supersede_view_bases(region, written)
        key = t.untyped_storage().data_ptr()
        _note_write(region, info, t.untyped_storage(), written)
        entries = region._by_storage.get(key)
        if not entries:
            continue
        remaining: list[Handle] = []
        copied: list[tuple[Handle, torch.Tensor]] = []
        for k in entries:
            if k.value is None:
                continue
            if k is written and k.reason is SILENT_WRITE:
                continue  # saved tensors read the new value: see Note [Silent writes]
            if k is not written and not overlap(t, k.value):
                remaining.append(k)  # rule 4: the write leaves its bytes as they are
                continue
            if k is not written and not silent:
                k.superseded = True  # its bytes change (see rule 3 for other counters)
                k.writes += 1
            if k is written and k.uses == 0 and info.returns_written:
                overwritten = k  # rule 4: its new version keeps the tensor
                continue
            if k.uses == 0 and (k is not written or info.returns_written):
                continue  # nobody needs the old value (this op does if it has other outputs)
            copy = exact_copy(k.value)
            if k.version >= 0:  # the copy carries the version the value had
                _set_versions((copy,), (k.version,))
            else:
                k.version = copy._version
            if silent:
                k.ref = None  # the tensor's version stays: it must not match ``k`` again
            copied.append((k, copy))
        if remaining:
            region._by_storage[key] = remaining
        else:
            del region._by_storage[key]
        for k, copy in copied:
            hold_copy(region, k, copy)
    return overwritten


def _history(region: Region, storage: torch.UntypedStorage) -> StorageHistory | None:
    """The history of the writes to ``storage``, if the region wrote to it."""
    key = storage.data_ptr()
    history = region._storages.get(key)
    if history is not None and history.storage.expired():
        del region._storages[key]  # a storage freed since, whose address was reused
        return None
    return history


def _note_write(
    region: Region, info: OpInfo, storage: torch.UntypedStorage, written: Handle
) -> None:
    """Update the storage's history before a write; ``after_write`` sets the new head."""
    history = _history(region, storage)
    if history is None:
        history = region._storages[storage.data_ptr()] = StorageHistory(storage)
    region._writing = None
    if history.diverged:
        return
    if (
        len(info.writes) != 1
        or not info.returns_written
        or info.silent_writes
        or (history.head is not None and not _descends(region, written, history.head))
    ):
        history.diverged = True
        history.head = None
        return
    root = written.base or written
    history.roots.add(root)
    src = _alias_source(region, root)
    if src is not None:
        history.roots.add(src)
    region._writing = history


def after_write(region: Region, out: Handle | None) -> None:
    """The write recorded by ``before_write`` returned ``out``: the storage's new head."""
    history = region._writing
    if history is not None:
        region._writing = None
        if out is None:
            history.diverged = True
            history.head = None
        else:
            history.head = out


def _descends(region: Region, h: Handle, head: Handle) -> bool:
    """Whether ``h`` is ``head`` or a view of it (through view ops only)."""
    nodes = region.nodes
    for _ in range(_CHAIN_LIMIT):
        if h is head:
            return True
        if not h.is_view or h.node_index < 0:
            return False
        node = nodes[h.node_index]
        if node.info.writes or not node.inputs:
            return False
        h = node.inputs[0]
    return False


def rebase(region: Region, t: torch.Tensor, old: Handle) -> Handle | None:
    """The value ``t`` holds after writes to its storage through other aliases, as a view
    of the last write's result, or ``None`` if it cannot be derived so (rule 3).

    ``old`` is the handle of the value ``t`` held before.
    """
    history = _history(region, t.untyped_storage())
    if history is None or history.head is None or (old.base or old) not in history.roots:
        return None
    head = history.head
    if head.offload_device is not None or head.dtype != t.dtype:
        return None  # a host copy keeps only the view's elements, not the storage
    index = len(region.nodes)
    args = (head, list(t.size()), list(t.stride()), int(t.storage_offset()))
    node = OpNode(index, _AS_STRIDED, op_info(_AS_STRIDED), args, {}, (head,))
    head.uses += 1
    head.has_views = True
    h = Handle(t, index, 0)
    h.is_view = True  # its bytes belong to the last write's value; its own base
    node.outputs = (h,)
    node.decision = CheckpointPolicy.PREFER_RECOMPUTE
    node.decided_by = "engine"
    node.module_path = region._modules.current_path
    region.nodes.append(node)
    history.roots.add(h)
    return h


def _alias_source(region: Region, root: Handle) -> Handle | None:
    """The value whose storage ``root`` aliases without being its view (``unsafe_chunk``)."""
    if root.node_index < 0:
        return None
    node = region.nodes[root.node_index]
    if node.op not in UNANNOTATED_ALIASES or not node.inputs:
        return None
    src = node.inputs[0]
    return src.base or src


def supersede_view_bases(region: Region, h: Handle) -> None:
    """A write through a view changes the value of the view's base too (rule 6), and a
    write to an ``unsafe_chunk`` output the value it was cut from."""
    b = h.base
    if b is not None:
        b.superseded = True
        b.writes += 1
    src = _alias_source(region, b or h)
    if src is not None:
        src.superseded = True
        src.writes += 1


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one storage may share an element; exact for strided views
    such as slices and chunks of one tensor, conservative (``True``) otherwise.

    See Note [Mutation and views], rule 4.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.dtype != b.dtype:
        return _span_overlap(a, b)
    # Element sets {offset + sum(i_d * stride_d)}. Dims of size 1 or stride 0 add nothing.
    sa = {st: n for n, st in zip(a.shape, a.stride(), strict=True) if n > 1 and st > 0}
    sb = {st: n for n, st in zip(b.shape, b.stride(), strict=True) if n > 1 and st > 0}
    if len(sa) != sum(1 for n, st in zip(a.shape, a.stride(), strict=True) if n > 1 and st > 0):
        return True  # two dims with one stride: the tensor overlaps itself
    if len(sb) != sum(1 for n, st in zip(b.shape, b.stride(), strict=True) if n > 1 and st > 0):
        return True
    strides = sorted(sa.keys() | sb.keys(), reverse=True)
    delta = int(b.storage_offset()) - int(a.storage_offset())
    # Write b's offset in a's coordinates: b's element j sits at coordinate q + j.
    q: list[int] = []
    rest = abs(delta)
    for st in strides:
        q.append(rest // st)
        rest -= q[-1] * st
    if rest:
        return _span_overlap(a, b)
    sign = 1 if delta >= 0 else -1
    lo: list[int] = []
    hi: list[int] = []
    disjoint = False
    for st, qd in zip(strides, q, strict=True):
        na, nb, qd = sa.get(st, 1), sb.get(st, 1), sign * qd
        lo.append(min(0, qd))
        hi.append(max(na, qd + nb))
        if qd >= na or qd + nb <= 0:
            disjoint = True  # the two boxes do not meet along this dim
    if not disjoint:
        return True
    # Coordinates are unique in the union box when each stride exceeds the span of the
    # smaller ones; then disjoint boxes are disjoint element sets.
    inner = 0
    for st, low, high in zip(reversed(strides), reversed(lo), reversed(hi), strict=True):
        if st <= inner:
            return _span_overlap(a, b)
        inner += st * (high - low - 1)
    return False


def _span_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges between the first and last elements of two tensors meet."""
    sa, sb = _span(a), _span(b)
    return sa[0] < sb[1] and sb[0] < sa[1]


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = int(t.storage_offset())
    end = start + 1
    for n, stride in zip(t.shape, t.stride(), strict=True):
        end += (int(n) - 1) * int(stride)
    size = t.element_size()
    return start * size, end * size


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
        silent = w in info.silent_args
        written.superseded = not silent
        written.writes += not silent
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
        if last is not None and _same(last, state):
            return gen, last
    _LAST_RNG[:] = [weakref.ref(gen), weakref.ref(state)]
    return gen, state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Below every dispatch mode: the caller's own modes (an op counter, a profiler) must not
    # see the engine's bookkeeping as ops of the program.
    with torch._C._DisableTorchDispatch():
        return torch.equal(a, b)


# The generator and the state tensor of the last capture, weakly held (a region owns them).
_LAST_RNG: list[Any] = [None, None]
