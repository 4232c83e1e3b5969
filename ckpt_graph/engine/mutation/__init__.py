"""Mutation: in-place writes, views and the kept values they change.

One idea per module: ``writes`` (before and after an in-place op: kept values copied,
old versions superseded; Note [Mutation and views] holds the rules), ``storage_history``
(writes through other aliases: a history per written storage, stale tensors rebased on it),
``write_prep`` (silent writes, undo of failed writes) and ``overlap`` (whether a write
touches a kept value).
"""

from __future__ import annotations

__all__: list[str] = []
