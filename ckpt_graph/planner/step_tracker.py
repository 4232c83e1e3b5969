"""Which regions of a ``memory_budget`` policy make up one training step, and when it ends.

A step starts when a region is entered after every region of the previous step ran its
backward or was released; each region takes the next ordinal. See rules 3 and 7 of Note
[Memory budget policy] in ``memory_budget.py``.

Example:
    >>> steps = StepTracker()
    >>> steps.over()  # no region yet: the next one starts a step
    True
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["StepTracker"]


class StepTracker:
    """The regions of the current step, in the order they were entered (their ordinals).

    Holds weak references only: a region that was dropped counts as finished.

    Invariants:
        A region's ordinal is its position in the step; a region dropped from the step
        (it saved nothing) gives its position to the next one entered.
    """

    def __init__(self) -> None:
        self._regions: list[weakref.ref[Region]] = []

    def __len__(self) -> int:
        return len(self._regions)

    def over(self) -> bool:
        """Whether every region of the step ran its backward or was released (``True`` for
        a step without regions): the next region entered starts a new step."""
        return all(_done(r()) for r in self._regions)

    def ended(self) -> bool:
        """Whether the step has regions and every one of them is finished."""
        return bool(self._regions) and self.over()

    def new_step(self) -> None:
        """Forget the finished step's regions."""
        self._regions = []

    def add(self, region: Region) -> int:
        """Add ``region`` to the step; returns its ordinal."""
        self._regions.append(weakref.ref(region))
        return len(self._regions) - 1

    def drop(self, region: Region) -> None:
        """Take ``region`` out of the step (it saved nothing: rule 7 of Note [Memory budget
        policy])."""
        self._regions = [r for r in self._regions if r() is not region]


def _done(region: Region | None) -> bool:
    """Whether a region of the current step is finished (backward ran, or released)."""
    if region is None:
        return True
    return region.pass_state.number > 0 or region.released
