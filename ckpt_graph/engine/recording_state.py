"""The recording state of a region: what the recorder and the mutation rules track per op.

The recorder (``record.py``), the op node builder (``outputs.py``), the pack hook
(``hooks.py``), holding (``holding.py``) and the mutation rules (``mutation.py``,
``storage_history.py``, ``write_prep.py``) share it; it lives while the region is open
and is emptied when the region closes (only ``ids`` stays, for ``Region.lookup``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ckpt_graph.engine.graph import Handle
    from ckpt_graph.engine.mutation.storage_history import StorageHistory

__all__ = ["RecordingState"]


class RecordingState:
    """What a region tracks while it records its forward.

    Attributes:
        on: whether ops run now are recorded: ``False`` outside the open block and while
            a policy, a recompute or the engine itself runs tensor ops in it (each sets it
            back to the value it found).
        task: the autograd graph task the region was opened in; ops and saves of another
            task (a backward run inside the region) are not recorded.
        ids: ``id(tensor)`` to the handle of the value it held when last seen.
        shapes: one shared ``torch.Size`` per distinct output shape (see Note [One recording
            path]).
        by_storage: the kept values by storage address, built at the region's first
            in-place op (``None`` before; see Note [Mutation and views]).
        storages: the history of the writes to each written storage, by address.
        writing: the history of the storage the op being recorded writes, between
            ``note_write`` and ``after_write``.
        unsettled: handles of in-place and view outputs whose version autograd sets after
            the recorder returns (``Region.settle`` reads them).
        alias_keys: the dispatch keys ``holding.detached`` saw last and the ones it derives
            from them (``None`` before its first call).
        watched: weak references to the forward tensors of kept op outputs, which free
            the kept value when the program drops the tensor and nothing reads the value
            (see Note [Kept values live no longer than in eager]).
        counting: ``Handle.recompute_readers`` is kept up to date: from the first kept op
            output, in-place write over a kept value or tag (see Note [Kept values live no
            longer than in eager], rule 6).
        random_nodes: positions of the op nodes recorded with a generator state
            (``OpNode.rng``), which region exit frees for those that never run; kept
            after the region closes.

    Example:
        >>> state = RecordingState()
        >>> state.on, state.by_storage
        (False, None)
    """

    __slots__ = (
        "alias_keys",
        "by_storage",
        "counting",
        "ids",
        "on",
        "random_nodes",
        "shapes",
        "storages",
        "task",
        "unsettled",
        "watched",
        "writing",
    )

    def __init__(self) -> None:
        self.on = False
        self.task = -1
        self.ids: dict[int, Handle] = {}
        self.shapes: dict[torch.Size, torch.Size] = {}
        self.by_storage: dict[int, list[Handle]] | None = None
        self.storages: dict[int, StorageHistory] = {}
        self.writing: StorageHistory | None = None
        self.unsettled: list[Handle] = []
        self.alias_keys: tuple[Any, Any, Any] | None = None
        self.watched: list[weakref.ref[torch.Tensor]] = []
        self.random_nodes: list[int] = []
        self.counting = False

    def finish(self) -> None:
        """Stop recording and drop what only recording needs (the region closes)."""
        self.on = False
        self.by_storage = None
        self.storages = {}
        self.shapes = {}
        self.watched = []  # See Note [Kept values live no longer than in eager], rule 5.
