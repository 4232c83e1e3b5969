"""The saved-tensor log of a region: what autograd saved, and how many packs it still holds.

The pack hook (``hooks.py``) appends to it for every tensor autograd saves in the region;
``Packed`` objects count themselves in and out of ``live_packs`` (see Note [Packed
lifetime]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle

__all__ = ["SavedLog"]


# Note [Saved tensor records]
# The pack hook runs for every tensor autograd saves; it records the position and the
# handle in two flat lists, and ``pairs`` pairs them up when read (the budget policy
# and introspection read it; plain recording never does). Appending to two lists
# creates no object, where a tuple per save would be one more object for the garbage
# collector to walk (see Note [One recording path]).
class SavedLog:
    """Every tensor autograd saved in a region, and the packed objects still alive.

    Attributes:
        at: for each save, the number of op nodes recorded before it.
        handles: for each save, the handle of the saved value (parallel to ``at``).
        strides: the saved tensors' strides, one shared tuple per distinct stride (as op
            output shapes are shared; see Note [One recording path]).
        live_packs: packed saved tensors autograd still holds (see Note [Packed lifetime]).

    Invariants:
        ``len(at) == len(handles)`` after each save.

    Example:
        >>> log = SavedLog()
        >>> len(log), log.pairs()
        (0, [])
    """

    __slots__ = ("_pairs", "at", "handles", "live_packs", "strides")

    def __init__(self) -> None:
        self.at: list[int] = []
        self.handles: list[Handle] = []
        self.strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.live_packs = 0
        self._pairs: list[tuple[int, Handle]] = []

    def __len__(self) -> int:
        """The number of saves."""
        return len(self.handles)

    def pairs(self) -> list[tuple[int, Handle]]:
        """``(number of op nodes recorded before the save, handle)`` per save, in order.
        See Note [Saved tensor records]."""
        pairs = self._pairs
        n = len(pairs)
        if n < len(self.handles):
            pairs.extend(zip(self.at[n:], self.handles[n:], strict=True))
        return pairs
