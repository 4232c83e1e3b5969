"""Mutation: in-place writes, views and the kept values they change.

One idea per module: ``writes`` (before and after an in-place op: kept values the write
touches copied, old versions superseded; Note [Mutation and views] holds the rules),
``storage_history`` (writes through other aliases: a history per written storage, stale
tensors rebased on it), ``silent_writes`` (writes that bump no version counter) and
``failed_writes`` (an in-place op that raises leaves the region as it was).
"""

from __future__ import annotations

__all__: list[str] = []
