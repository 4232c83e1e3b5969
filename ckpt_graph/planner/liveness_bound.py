"""The liveness simulator's state of a bounded pass (Note [Backward liveness model] rule 8).

Mirrors ``passes.PassState`` and ``cache_bound.segment_limit`` (Note [Bounded recompute
cache]): the segment size computed from the same use counts, the realize's reads, the open
segment and the checkpoints. ``simulate`` drives it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_graph.planner.sim_graph import SimGraph

__all__ = ["Bound"]


class Bound:
    """The state of a bounded pass (rule 8), mirroring ``passes.PassState``.

    Attributes:
        limit: bytes per segment (``cache_bound.segment_limit``), 0 when the pass is not bounded.
        frontier_bytes: mean frontier of the pass.
    """

    def __init__(self, g: SimGraph, kept: list[bool], pending: list[int], last: list[int]) -> None:
        values, ops = g.values, g.ops
        self.g, self.kept = g, kept
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
        packs = [0] * len(values)
        for _, v in g.saved:
            packs[v] += 1
        end: dict[int, int] = {}
        saved: set[int] = set()
        for v, val in enumerate(values):
            if val.producer < 0 or kept[v] or pending[v] <= 0:
                continue
            r = self.root[v]
            if kept[r] or values[r].producer < 0:
                continue
            end[r] = max(end.get(r, 0), last[v] if last[v] >= 0 else val.producer)
            if packs[v]:
                saved.add(r)
        total = sum(values[r].nbytes for r in saved)
        spans = sum(values[r].nbytes * (e - values[r].producer) for r, e in end.items())
        self.frontier_bytes = spans // max(len(ops), 1)
        k = math.isqrt(total * self.frontier_bytes)
        limit = g.cache_limit
        if limit is None:
            first = self._first_realize_bytes(packs)
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

    def _first_realize_bytes(self, packs: list[int]) -> int:
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
                if not kept[o] and packs[o]:
                    roots.add(self.root[o])
            for i in op.inputs:
                if not kept[i] and values[i].producer not in seen:
                    seen.add(values[i].producer)
                    stack.append(values[i].producer)
        return sum(self.nbytes(r) for r in roots)
