"""Writes through other aliases: the region's history of each written storage, and stale
tensors rebased on its last write. See Note [Mutation and views] (``writes.py``), rule 3.

``mutation.before_write`` notes each write (``note_write``), the recorder sets its result as
the storage's new head (``after_write``), and ``Region.handle_of`` asks ``rebase`` for a
tensor whose version changed through another alias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph.engine.graph import Handle, OpNode
from ckpt_graph.engine.op_info import UNANNOTATED_ALIASES, OpInfo, op_info

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["StorageHistory", "after_write", "alias_source", "note_write", "rebase"]

_AS_STRIDED = torch.ops.aten.as_strided.default
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


def _history(region: Region, storage: torch.UntypedStorage) -> StorageHistory | None:
    """The history of the writes to ``storage``, if the region wrote to it."""
    key = storage.data_ptr()
    storages = region.recording.storages
    history = storages.get(key)
    if history is not None and history.storage.expired():
        del storages[key]  # a storage freed since, whose address was reused
        return None
    return history


def note_write(
    region: Region, info: OpInfo, storage: torch.UntypedStorage, written: Handle
) -> None:
    """Update the storage's history before a write; ``after_write`` sets the new head."""
    history = _history(region, storage)
    if history is None:
        history = region.recording.storages[storage.data_ptr()] = StorageHistory(storage)
    region.recording.writing = None
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
    src = alias_source(region, root)
    if src is not None:
        history.roots.add(src)
    region.recording.writing = history


def after_write(region: Region, out: Handle | None) -> None:
    """The write recorded by ``before_write`` returned ``out``: the storage's new head."""
    history = region.recording.writing
    if history is not None:
        region.recording.writing = None
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
    if head.reason is not None and head.value is None:
        return None  # freed, nothing read it: see Note [Kept values live no longer than in eager]
    index = len(region.nodes)
    args = (head, list(t.size()), list(t.stride()), int(t.storage_offset()))
    node = OpNode(index, _AS_STRIDED, op_info(_AS_STRIDED), args, {}, (head,))
    head.forward_uses += 1
    head.recompute_input = True
    head.has_views = True
    values = region.pass_state.handles  # See Note [Values numbered as recorded].
    h = Handle(t, index, 0, len(values))
    values.append(h)
    h.is_view = True  # its bytes belong to the last write's value; its own base
    node.outputs = (h,)
    node.decision = CheckpointPolicy.PREFER_RECOMPUTE
    node.decided_by = "engine"
    node.module_path = region.module_stack.current_path
    region.nodes.append(node)
    history.roots.add(h)
    return h


def alias_source(region: Region, root: Handle) -> Handle | None:
    """The value whose storage ``root`` aliases without being its view (``unsafe_chunk``)."""
    if root.node_index < 0:
        return None
    node = region.nodes[root.node_index]
    if node.op not in UNANNOTATED_ALIASES or not node.inputs:
        return None
    src = node.inputs[0]
    return src.base or src
