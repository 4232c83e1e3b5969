"""Mutation bookkeeping of the recorder: in-place ops, views, kept values.

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
#      handle. The region keeps a ``StorageHistory`` per written storage
#      (``storage_history.py``): its ``head`` is the result of the last write, whose
#      recomputation holds every write so far as long as each write starts from the head or
#      a view of it. The tensor's next use is then *rebased*: an engine-made ``as_strided``
#      op node views the head with the tensor's sizes, strides and storage offset,
#      recomputed like any view (filling a buffer step by step keeps nothing, where a
#      snapshot per step cost a copy of the buffer per write: a quadratic peak). Otherwise
#      (a write that started elsewhere, such as chunks with counters of their own, several
#      written arguments, a host-offloaded head) the next use takes the tensor as a kept
#      snapshot (reason ``MUTATED_ALIAS``). The same holds for a write through an alias with
#      a version counter of its own (``x.data.mul_(3)``, seen as a ``detach`` view): the
#      version stays, but the handle is superseded. A saved tensor of the old value then
#      cannot be served as eager would (eager reads the new values, unchecked), and
#      unpacking it raises an error naming ``.data``.
#   4. Kept values are shared with the forward tensors. Before an op writes a storage,
#      every kept value in that storage whose elements the write may touch (``overlap``:
#      exact for slices and chunks, conservative otherwise) and that a saved tensor or a
#      recomputation may still read (``kept_lifetime.may_read``; an op node whose outputs
#      are all kept never runs again, nor one whose recomputed outputs no saved tensor
#      needs yet) is replaced by an exact copy (same storage offset
#      and strides), because the write would change it under them; it is also superseded
#      (the copy carries the value's version, and the handle still refers to the tensor,
#      so that the tensor's next use is rebased, rule 3). Kept values
#      of the storage the write leaves alone stay as they are: the gates of nn.LSTM are
#      chunks of one tensor (``unsafe_chunk``, each with a version counter of its own)
#      written in place one after another. A kept value the op overwrites with nobody
#      else needing it is not copied; its new version is kept instead
#      (``INPLACE_ON_KEPT``), which costs no memory since it is the same tensor.
#   5. The version of an in-place op's output (bumped) and of a view op's output (shared
#      with its base) is only set by autograd after this mode returns: those handles start
#      at -1 and read the tensor's version when the region next sees anything
#      (``Region.settle``), before any other op can change it.
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

from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph.engine.graph import SILENT_WRITE, Handle, arg_at
from ckpt_graph.engine.holding import hold_copy, index_storage
from ckpt_graph.engine.kept_lifetime import may_read
from ckpt_graph.engine.mutation.storage_history import alias_source, note_write
from ckpt_graph.engine.op_info import OpInfo
from ckpt_graph.engine.replay import exact_copy

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["before_write", "mark_written", "overlap", "supersede_view_bases"]

_set_versions = torch._C._autograd._unsafe_set_version_counter


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
    state = region.recording
    if state.by_storage is None:
        state.by_storage = {}
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
        note_write(region, info, t.untyped_storage(), written)
        entries = state.by_storage.get(key)
        if not entries:
            continue
        remaining: list[Handle] = []
        copied: list[tuple[Handle, torch.Tensor]] = []
        for k in entries:
            value = k.value  # once: a dropped forward tensor may free it (kept_lifetime.py)
            if value is None:
                continue
            if k is written and k.reason is SILENT_WRITE:
                continue  # saved tensors read the new value: see Note [Silent writes]
            if k is not written and not overlap(t, value):
                remaining.append(k)  # rule 4: the write leaves its bytes as they are
                continue
            if k is not written and not silent:
                k.superseded = True  # its bytes change (see rule 3 for other counters)
                k.writes += 1
            # See Note [Kept values live no longer than in eager], rule 4. Saved tensors of
            # a value written silently read the new value, as eager's do, and the op's
            # outputs do not depend on the old one (Note [Silent writes]); nothing marks
            # it changed, so every recomputed op node that read it before counts.
            if silent:
                unread = not (k.recompute_input or (k is not written and k.saved_refs > 0))
            else:
                unread = not may_read(k)
            if k is written and unread and info.returns_written:
                overwritten = k  # rule 4: its new version keeps the tensor
                continue
            if unread and (k is not written or info.returns_written or silent):
                continue  # nobody needs the old value (this op does if it has other outputs)
            copy = exact_copy(value)
            if k.version >= 0:  # the copy carries the version the value had
                _set_versions((copy,), (k.version,))
            else:
                k.version = copy._version
            if silent:
                k.ref = None  # the tensor's version stays: it must not match ``k`` again
            copied.append((k, copy))
        if remaining:
            state.by_storage[key] = remaining
        else:
            del state.by_storage[key]
        # Whether the written storage stays held: a copy is then new memory, even of an op
        # output (see Note [Holding values], rule 2).
        moved = {id(k) for k, _ in copied}
        held = any(k.value is not None and id(k) not in moved for k in entries)
        for k, copy in copied:
            hold_copy(region, k, copy, held)
    return overwritten


def supersede_view_bases(region: Region, h: Handle) -> None:
    """A write through a view changes the value of the view's base too (rule 6), and a
    write to an ``unsafe_chunk`` output the value it was cut from."""
    b = h.base
    if b is not None:
        b.superseded = True
        b.writes += 1
    src = alias_source(region, b or h)
    if src is not None:
        src.superseded = True
        src.writes += 1


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
            region.recording.ids.pop(id(t), None)
    return first


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
