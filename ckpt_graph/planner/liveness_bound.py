"""The liveness simulator's bounded pass (Note [Backward liveness model] rule 8).

Mirrors ``passes.PassState`` and ``cache_bound`` (Note [Bounded recompute cache]): the
segment size computed from the same use counts, the realize's reads, the open segment, the
checkpoints, and the segment operations (join, close, owe, plan a realize). ``simulate``
drives it: it runs the planned ops and asks for these operations, as ``realize.run_node``
does in a bounded pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_graph.planner.sim_graph import SimGraph

__all__ = ["Bound"]


class Bound:
    """The state of a bounded pass (rule 8), mirroring ``passes.PassState``.

    ``pass_uses`` and ``cached`` are the simulator's own lists, shared: the segment operations
    update them as ``cache_bound`` updates handles, and ``release`` gives a dropped value's
    storage back.

    Attributes:
        limit: bytes per segment (``cache_bound.segment_limit``), 0 when the pass is not bounded.
        frontier_bytes: mean frontier of the pass.
        owed: per op, an output was dropped while it had uses left: the op runs again.
    """

    def __init__(
        self,
        g: SimGraph,
        kept: list[bool],
        pass_uses: list[int],
        last: list[int],
        cached: list[bool],
        release: Callable[[int], None],
    ) -> None:
        values, ops = g.values, g.ops
        self.g, self.kept = g, kept
        self.pass_uses, self.cached, self.release = pass_uses, cached, release
        self.owed = [False] * len(ops)
        self.view = [
            v.storage != k if v.is_view is None else v.is_view for k, v in enumerate(values)
        ]
        # The engine's root of a value (``cache_bound.root_of``): through its views only, to
        # the first kept value. An alias the engine does not mark as a view (Note
        # [Unannotated aliases]) shares its input's storage in the graph but is a root here,
        # as it is for the engine's segment sizes.
        self.root = list(range(len(values)))
        for v in range(len(values)):
            r = v
            while self.view[r] and not kept[r]:
                p = values[r].producer
                if p < 0 or not ops[p].inputs:
                    break
                r = ops[p].inputs[0]
            self.root[v] = r
        saved_refs = [0] * len(values)
        for _, v in g.saved:
            saved_refs[v] += 1
        end: dict[int, int] = {}
        saved: set[int] = set()
        for v, val in enumerate(values):
            if val.producer < 0 or kept[v] or pass_uses[v] <= 0:
                continue
            r = self.root[v]
            if kept[r] or values[r].producer < 0:
                continue
            end[r] = max(end.get(r, 0), last[v] if last[v] >= 0 else val.producer)
            if saved_refs[v]:
                saved.add(r)
        total = sum(values[r].nbytes for r in saved)
        spans = sum(values[r].nbytes * (e - values[r].producer) for r, e in end.items())
        self.frontier_bytes = spans // max(len(ops), 1)
        k = math.isqrt(total * self.frontier_bytes)
        limit = g.cache_limit
        if limit is None:
            first = self._first_realize_bytes(saved_refs)
            self.limit = k if k > 0 and first >= 4 * k else 0
        else:
            assert isinstance(limit, int)
            self.limit = 0 if total <= limit else max(k, 1) if limit < 2 * k else limit // 2
        self.need: dict[int, int] = {}
        self.active: dict[int, None] = {}
        self.checkpoints: set[int] = set()
        self.segment: list[int] = []
        self.segment_bytes = 0
        self.segment_roots: set[int] = set()
        self.closing = False

    def nbytes(self, root: int) -> int:
        """Bytes of a storage the pass may cache (0 for kept values and region inputs)."""
        val = self.g.values[root]
        return 0 if self.kept[root] or val.producer < 0 else val.nbytes

    def frontier(self) -> int:
        """Bytes of the storages the running realize's values still to be read hold."""
        return sum(self.nbytes(r) for r in {self.root[a] for a in self.active})

    def _first_realize_bytes(self, saved_refs: list[int]) -> int:
        values, ops, kept = self.g.values, self.g.ops, self.kept
        target = next((v for _, v in reversed(self.g.saved) if not kept[v]), -1)
        if target < 0 or values[target].producer < 0:
            return 0
        seen = {values[target].producer}
        stack = [values[target].producer]
        roots: set[int] = set()
        while stack:
            op = ops[stack.pop()]
            for o in op.outputs:
                if not kept[o] and saved_refs[o]:
                    roots.add(self.root[o])
            for i in op.inputs:
                if not kept[i] and values[i].producer not in seen:
                    seen.add(values[i].producer)
                    stack.append(values[i].producer)
        return sum(self.nbytes(r) for r in roots)

    def join(self, v: int) -> None:
        """``v`` is cached for later users only: add it to the open segment
        (``cache_bound.join_segment``)."""
        values, kept, cached = self.g.values, self.kept, self.cached
        nbytes = values[v].nbytes
        if self.view[v]:
            r = self.root[v]
            if kept[r] or values[r].producer < 0 or cached[r] or r in self.segment_roots:
                nbytes = 0
            else:
                self.segment_roots.add(r)
        if self.closing and self.segment and self.segment_bytes + nbytes > self.limit:
            self.close()
        self.segment.append(v)
        self.segment_bytes += nbytes

    def close(self) -> None:
        """Keep the frontier cached as checkpoints, drop the open segment's values
        (``cache_bound.close_segment``)."""
        values, cached = self.g.values, self.cached
        self.checkpoints.update(self.active)
        for d in self.segment:
            if cached[d]:
                cached[d] = False
                self.release(d)
                self.owe(values[d].producer)
        self.segment, self.segment_bytes, self.segment_roots = [], 0, set()

    def owe(self, j: int) -> None:
        """A cached output of op ``j`` was dropped: ``j`` runs again (``cache_bound.owe``)."""
        values, ops, kept = self.g.values, self.g.ops, self.kept
        owed, pass_uses, cached = self.owed, self.pass_uses, self.cached
        stack = [j]
        while stack:
            j = stack.pop()
            if owed[j]:
                continue
            owed[j] = True
            for i in ops[j].inputs:
                if not kept[i]:
                    pass_uses[i] += 1
                    if not cached[i]:
                        stack.append(values[i].producer)

    def plan_realize(self, v: int) -> list[int]:
        """The ops a realize of ``v`` runs, in forward order; sets up ``need``, the open
        segment and whether it may close (``cache_bound.plan_realize``)."""
        values, ops, kept = self.g.values, self.g.ops, self.kept
        pass_uses, cached = self.pass_uses, self.cached
        need = self.need = {v: 1}
        todo: set[int] = set()
        stack = [values[v].producer]
        while stack:
            j = stack.pop()
            if j in todo:
                continue
            todo.add(j)
            for i in ops[j].inputs:
                if not kept[i]:
                    need[i] = need.get(i, 0) + 1
                    if not cached[i]:
                        stack.append(values[i].producer)
        order = sorted(todo)
        held = {
            values[o].storage
            for j in order
            for o in ops[j].outputs
            if not kept[o] and pass_uses[o] > need.get(o, 0)
        }
        held_bytes = sum(self.nbytes(r) for r in held)
        self.segment, self.segment_bytes, self.segment_roots = [], 0, set()
        self.closing = held_bytes > self.limit
        return order
