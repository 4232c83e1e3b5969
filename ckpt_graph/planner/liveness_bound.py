"""The liveness simulator's bounded pass (Note [Backward liveness model] rule 8).

Mirrors ``passes.PassState`` and ``cache_bound`` (Note [Bounded recompute cache]): the cuts
planned from the same use counts (``segment_plan``, Note [Planned segment cuts]), the
decision at the first realize that caches anything, the realize's reads, the open segment,
the pinned checkpoints, and the segment operations (join, close, owe, plan a realize).
``simulate`` drives it: it runs the planned ops and asks for these operations, as
``realize`` and ``realize.run_node`` do in a bounded pass.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckpt_graph.engine.segment_plan import SegmentProfile

if TYPE_CHECKING:
    from ckpt_graph.planner.sim_graph import SimGraph

__all__ = ["Bound"]


class Bound:
    """The state of a bounded pass (rule 8), mirroring ``passes.PassState``.

    ``pass_uses`` and ``cached`` are the simulator's own lists, shared: the segment operations
    update them as ``cache_bound`` updates handles, and ``release`` gives a dropped value's
    storage back.

    Attributes:
        limit: planned peak of the cache (``PassState.segment_limit``), 0 while the pass is
            not bounded.
        cuts: op indices after which a segment closes, ascending.
        undecided: an automatic bound waits for the first realize that caches anything.
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
        storages: dict[int, list[int]] = {}  # as ``cache_bound.plan_bound``
        for v, val in enumerate(values):
            if val.producer < 0 or kept[v] or pass_uses[v] <= 0:
                continue
            r = self.root[v]
            if kept[r] or values[r].producer < 0:
                continue
            entry = storages.get(r)
            if entry is None:
                entry = storages[r] = [values[r].producer, values[r].producer, 0]
            entry[1] = max(entry[1], last[v] if last[v] >= 0 else val.producer)
            if saved_refs[v]:
                entry[2] = 1
        spans = [(p, e, values[r].nbytes, saved == 1) for r, (p, e, saved) in storages.items()]
        profile: SegmentProfile | None = SegmentProfile(len(ops), spans)
        assert profile is not None
        self.limit = 0
        self.cuts: list[int] = []
        self.undecided = False
        limit = g.cache_limit
        if limit is None:
            self.undecided = profile.saved_bytes > 0
        else:
            assert isinstance(limit, int)
            if profile.saved_bytes > limit:
                plan = profile.plan(limit)
                self.limit, self.cuts = max(plan.peak, 1), list(plan.cuts)
            else:
                profile = None
        self.profile = profile
        self.need: dict[int, int] = {}
        self.active: dict[int, None] = {}
        self.checkpoints: set[int] = set()
        self.pinned: list[int] = []
        self.segment: list[int] = []
        self.closing = False

    def nbytes(self, root: int) -> int:
        """Bytes of a storage the pass may cache (0 for kept values and region inputs)."""
        val = self.g.values[root]
        return 0 if self.kept[root] or val.producer < 0 else val.nbytes

    def decide(self, v: int) -> bool | None:
        """The automatic bound's decision at a realize of ``v`` (``cache_bound.decide_bound``):
        whether the pass is bounded, ``None`` if that realize caches nothing."""
        _, _, held = self.collect(v)
        if held == 0:
            return None
        self.undecided = False
        if held < self.g.bound_min_bytes:
            self.profile = None
            return False
        assert self.profile is not None
        plan = self.profile.plan(extra=self.step_gradient_bytes(v))
        if not plan.cuts or held < 2 * plan.peak:
            self.profile = None
            return False
        self.limit, self.cuts = max(plan.peak, 1), list(plan.cuts)
        return True

    def step_gradient_bytes(self, v: int) -> int:
        """``cache_bound.step_gradient_bytes``: the outputs of the last op reading ``v``
        and the values made before it and read after it."""
        values, ops, view = self.g.values, self.g.ops, self.view
        start = values[v].producer
        step = start
        last: dict[int, int] = {}
        for j in range(start + 1, len(ops)):
            for i in ops[j].inputs:
                if values[i].producer >= 0:
                    last[i] = j
                    if i == v:
                        step = j
        total = sum(values[o].nbytes for o in ops[step].outputs if not view[o])
        for u, end in last.items():
            if values[u].producer < step < end and not view[u]:
                total += values[u].nbytes
        return total

    def join(self, v: int) -> None:
        """``v`` is cached for later users only: add it to the open segment
        (``cache_bound.join_segment``)."""
        self.segment.append(v)

    def close(self) -> None:
        """Keep the frontier cached as checkpoints, pinned until the next close; drop the
        open segment's values (``cache_bound.close_segment``)."""
        values, cached = self.g.values, self.cached
        self.checkpoints.update(self.active)
        for d in self.segment:
            if cached[d]:
                cached[d] = False
                self.release(d)
                self.owe(values[d].producer)
        self.segment = []
        for a in self.active:
            self.pass_uses[a] += 1
        self.unpin()
        self.pinned = list(self.active)

    def unpin(self) -> None:
        """Release the pins of the last cut's checkpoints (``cache_bound.unpin``)."""
        for a in self.pinned:
            self.pass_uses[a] -= 1
            if self.pass_uses[a] == 0 and self.cached[a]:
                self.cached[a] = False
                self.release(a)
        self.pinned = []

    def closes_between(self, after: int, before: int) -> bool:
        """Whether a cut lies at op ``after`` or before op ``before``
        (``cache_bound.closes_between``)."""
        k = bisect.bisect_left(self.cuts, after)
        return k < len(self.cuts) and self.cuts[k] < before

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

    def collect(self, v: int) -> tuple[list[int], dict[int, int], int]:
        """The ops a realize of ``v`` runs in forward order, their reads (``need``) and the
        bytes it leaves cached (``cache_bound.collect_realize``)."""
        values, ops, kept = self.g.values, self.g.ops, self.kept
        pass_uses, cached = self.pass_uses, self.cached
        need = {v: 1}
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
            self.root[o]
            for j in order
            for o in ops[j].outputs
            if not kept[o] and pass_uses[o] > need.get(o, 0)
        }
        return order, need, sum(self.nbytes(r) for r in held)

    def plan_realize(self, v: int) -> list[int]:
        """The ops a realize of ``v`` runs, in forward order; sets up ``need``, the open
        segment, whether it may close and the tail cut (``cache_bound.plan_realize``)."""
        order, self.need, held = self.collect(v)
        self.segment = []
        self.closing = held > self.limit
        if self.closing and self.profile is not None:
            cut = self.profile.tail_cut(self.cuts, self.g.values[v].producer)
            self.profile = None
            if cut is not None:
                bisect.insort(self.cuts, cut)
        return order
