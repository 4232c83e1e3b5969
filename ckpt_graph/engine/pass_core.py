"""The rules of a backward pass, written once over an integer-indexed graph.

The engine (``passes``, ``realize``, ``cache_bound``, ``release``) and the liveness simulator
(``planner/liveness.py``) both run a backward pass by these functions: the engine over a
:class:`PassGraph` it numbers from a region (``passes.pass_graph``), the simulator over one
built from its ``SimGraph``. Values and op nodes are integers; per-value state (use counts,
whether a value is cached) is any indexable sequence: plain lists in the simulator, the
engine's own lists or views of its handles. Nothing here runs an op or holds a tensor:
an *executor* does (the engine's runs the recorded op and holds tensors, the simulator's
adds bytes), and the engine-only events (a second read of a saved tensor, live forward
tensors, kept values changed after the region, a partial backward) stay hooks of the
engine.

# Note [One pass core]
# The rules of Notes [Use counts and freeing], [Transient values], [Bounded recompute
# cache] and [Releasing kept values] are functions of the graph's shape and of per-value
# counters only: which op nodes read and make which values, which values are kept, views,
# bytes. Written over integers they serve both sides, so the simulator predicts what the
# engine does by construction instead of by a copy kept close by a drift test:
# 1. ``count_uses``: one sweep from the last op node back; a node runs when a recomputed
#    output has a pending use, and then adds one use to each of its inputs (recomputed ones
#    for a pass, all for the live uses at region exit). ``taken`` lets the engine serve a
#    value from the program's live forward tensor instead (Note [Live forward tensors]).
# 2. ``collect``: the walk back from a value through producers to the nearest kept or
#    cached values, with the reads of each value; the bounded realize, the decision to
#    bound, a second read and the analysis of recompute chains all use it.
# 3. ``mark_transient``: Note [Transient values].
# 4. :class:`Bound`: Note [Bounded recompute cache] (profile, decision, cuts, segments,
#    owed runs, the collected realize in forward order).
# 5. :class:`Pass`: the realize/run/use loop of an unbounded or bounded pass against an
#    :class:`Executor`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Protocol

from ckpt_graph.engine.segment_plan import SegmentPlan, SegmentProfile

__all__ = [
    "Bound",
    "Executor",
    "Pass",
    "PassGraph",
    "collect",
    "count_uses",
    "last_readers",
    "mark_transient",
    "roots",
    "step_gradient_bytes",
]


@dataclass(frozen=True)
class PassGraph:
    """A region's graph as a backward pass sees it: op nodes and values as integers.

    Attributes:
        inputs: per op node (forward order, a topological order), the distinct values it
            reads.
        outputs: per op node, the values it makes (tensor outputs only).
        producer: per value, the op node that makes it, -1 for a region input.
        nbytes: per value, the bytes of its storage if it owns one.
        view: per value, whether it is a view of another value (shares its storage).
        has_views: per value, whether some view op took it as input.
        transient_ok: per op node, whether its output may be transient (pointwise, not
            random, not in place, exactly one output): Note [Transient values].

    Example:
        >>> g = PassGraph(((0,), (1,)), ((1,), (2,)), (-1, 0, 1), (8, 8, 8),
        ...               (False,) * 3, (False,) * 3, (False, False))
        >>> uses = [0, 0, 1]  # one saved tensor refers to value 2
        >>> count_uses(g, [True, False, False], uses), uses
        ([True, True], [0, 1, 1])
    """

    inputs: Sequence[Sequence[int]]
    outputs: Sequence[Sequence[int]]
    producer: Sequence[int]
    nbytes: Sequence[int]
    view: Sequence[bool]
    has_views: Sequence[bool]
    transient_ok: Sequence[bool]


def count_uses(
    g: PassGraph,
    kept: Sequence[bool],
    uses: MutableSequence[int],
    *,
    all_inputs: bool = False,
    taken: Callable[[int], bool] | None = None,
) -> list[bool]:
    """Add the uses of the op nodes that will run to ``uses`` (which starts at the saved
    tensors of each value); return, per op node, whether it runs. See Note [One pass
    core], rule 1.

    Args:
        g: the graph.
        kept: per value, whether it is kept (never recomputed).
        uses: per value, the saved tensors referring to it; the uses of running op nodes
            are added (recomputed inputs only, or every input with ``all_inputs``).
        all_inputs: count the uses of kept inputs too (live uses at region exit).
        taken: called for each recomputed output with a pending use; ``True`` when the
            value is served otherwise (the engine's live forward tensors), so that it does
            not make its producer run.
    """
    inputs, outputs = g.inputs, g.outputs
    runs = [False] * len(outputs)
    for j in range(len(outputs) - 1, -1, -1):
        needed = False
        for o in outputs[j]:
            if not kept[o] and uses[o] > 0 and (taken is None or not taken(o)):
                needed = True
        if needed:
            runs[j] = True
            for i in inputs[j]:
                if all_inputs or not kept[i]:
                    uses[i] += 1
    return runs


def last_readers(g: PassGraph, kept: Sequence[bool], runs: Sequence[bool]) -> list[int]:
    """Per recomputed value, the last op node that runs and reads it (-1 if none)."""
    last = [-1] * len(g.producer)
    inputs = g.inputs
    for j in range(len(inputs) - 1, -1, -1):
        if runs[j]:
            for i in inputs[j]:
                if not kept[i] and last[i] < 0:
                    last[i] = j
    return last


def collect(
    g: PassGraph, v: int, kept: Sequence[bool], cached: Sequence[bool]
) -> tuple[list[int], dict[int, int]]:
    """What realizing ``v`` runs: from ``v`` back through producers to the nearest kept or
    cached values. See Note [One pass core], rule 2.

    Returns:
        The op nodes in forward order, and per recomputed value the collected op nodes that
        read it (``need``; ``v`` once more, for the read that asked for it).
    """
    inputs, producer = g.inputs, g.producer
    need = {v: 1}
    todo: set[int] = set()
    stack = [producer[v]]
    while stack:
        j = stack.pop()
        if j in todo:
            continue
        todo.add(j)
        for i in inputs[j]:
            if not kept[i]:
                need[i] = need.get(i, 0) + 1
                if not cached[i]:
                    stack.append(producer[i])
    return sorted(todo), need


def roots(g: PassGraph, kept: Sequence[bool]) -> list[int]:
    """Per value, the value whose storage it uses: itself unless a recomputed view, then
    through views (to the first input of their producers) up to a kept value or one that
    is not a view."""
    view, producer, inputs = g.view, g.producer, g.inputs
    root = list(range(len(producer)))
    done = [False] * len(producer)
    for v in range(len(producer)):
        path: list[int] = []
        r = v
        while not done[r] and view[r] and not kept[r]:
            p = producer[r]
            if p < 0 or not inputs[p]:
                break
            path.append(r)
            r = inputs[p][0]
        top = root[r] if done[r] else r
        for u in path:
            root[u] = top
            done[u] = True
    return root


def mark_transient(
    g: PassGraph,
    kept: Sequence[bool],
    uses: MutableSequence[int],
    min_bytes: int,
    live: Sequence[bool] | None = None,
) -> list[bool]:
    """Per value, whether it is transient in this pass; adds the extra uses of the
    transient values' recomputed inputs to ``uses``. See Note [Transient values].

    Args:
        g: the graph.
        kept: per value, whether it is kept.
        uses: the pass's use counts, after ``count_uses``.
        min_bytes: smaller values stay cached (``passes.TRANSIENT_MIN_BYTES``).
        live: per value, whether the pass reads it as the program's live forward tensor
            (never transient).
    """
    inputs, outputs, producer = g.inputs, g.outputs, g.producer
    nbytes, view = g.nbytes, g.view
    transient = [False] * len(producer)
    if not any(g.transient_ok):
        return transient

    def aliases_kept(v: int) -> bool:  # a view of a kept value, through views only
        while view[v] and not kept[v]:
            p = producer[v]
            if p < 0 or not inputs[p]:
                return False
            v = inputs[p][0]
        return kept[v]

    for j, ok in enumerate(g.transient_ok):
        if not ok:
            continue
        h = outputs[j][0]
        if (
            kept[h]
            or (live is not None and live[h])
            or uses[h] < 2
            or view[h]
            or g.has_views[h]
            or nbytes[h] < min_bytes
        ):
            continue
        total = 0
        for i in inputs[j]:
            if not kept[i] and not aliases_kept(i):
                if transient[i] or view[i] or uses[i] < 2:
                    break
                total += nbytes[i]
        else:
            if total <= nbytes[h]:
                transient[h] = True
                extra = uses[h] - 1
                for i in inputs[j]:
                    if not kept[i]:
                        uses[i] += extra
    return transient


def step_gradient_bytes(g: PassGraph, v: int) -> int:
    """Bytes of the gradients alive while backward reads ``v`` the first time, as the
    graph bounds them: the outputs of the last op node reading ``v`` (its step) and the
    values made before that node and read after it. See Note [Planned segment cuts],
    rule 2."""
    inputs, producer, view, nbytes = g.inputs, g.producer, g.view, g.nbytes
    step = producer[v]
    last: dict[int, int] = {}
    for j in range(producer[v] + 1, len(inputs)):
        for i in inputs[j]:
            if producer[i] >= 0:
                last[i] = j
                if i == v:
                    step = j
    total = sum(nbytes[o] for o in g.outputs[step] if not view[o])
    for u, end in last.items():
        if producer[u] < step < end and not view[u]:
            total += nbytes[u]
    return total


class Bound:
    """The state of a bounded pass. See Note [Bounded recompute cache].

    Args:
        g: the graph.
        kept: per value, whether it is kept.
        uses: the pass's use counts (updated: checkpoints are pinned, owed runs add uses).
        cached: per value, whether it is cached now.
        free: frees a cached value (the executor's ``free``).
        last: per value, the last op node of the pass that reads it (``last_readers``).
        saved: per value, whether a saved tensor refers to it.
        live: per value, whether the pass reads the program's forward tensor (its bytes
            are the program's), or ``None``.

    Attributes:
        limit: planned peak of the cache, 0 while the pass is not bounded.
        cuts: op nodes after which a segment closes, ascending.
        undecided: an automatic bound waits for the first realize that caches anything.
        profile: the pass's recomputed storages, until decided and the tail cut placed.
        owed: per op node, an output was freed while it had uses left: it runs again.
        closed_segments: segments closed so far.
    """

    def __init__(
        self,
        g: PassGraph,
        kept: Sequence[bool],
        uses: MutableSequence[int],
        cached: Sequence[bool],
        free: Callable[[int], None],
        last: Sequence[int],
        saved: Sequence[bool],
        live: Sequence[bool] | None = None,
    ) -> None:
        self.g, self.kept, self.uses, self.cached, self.free = g, kept, uses, cached, free
        self.live = live
        self.root = root = roots(g, kept)
        producer = g.producer
        storages: dict[int, list[int]] = {}  # per root: producer, last reader, saved
        for v, p in enumerate(producer):
            if p < 0 or kept[v] or uses[v] <= 0 or (live is not None and live[v]):
                continue
            r = root[v]
            if self._others(r):
                continue  # a view of a kept or live value holds nothing
            entry = storages.get(r)
            if entry is None:
                entry = storages[r] = [producer[r], producer[r], 0]
            entry[1] = max(entry[1], last[v] if last[v] >= 0 else p)
            if saved[v]:
                entry[2] = 1
        spans = [(p, e, g.nbytes[r], s == 1) for r, (p, e, s) in storages.items()]
        self.profile: SegmentProfile | None = SegmentProfile(len(g.outputs), spans)
        self.limit = 0
        self.cuts: list[int] = []
        self.undecided = False
        self.owed = [False] * len(g.outputs)
        self.need: dict[int, int] = {}  # per value, collected op nodes of the realize to read it
        self.active: dict[int, None] = {}  # values of this realize that ``need`` > 0
        self.checkpoints: set[int] = set()
        self.pinned: list[int] = []  # checkpoints of the last cut, until the next close
        self.segment: list[int] = []
        self.closing = False  # whether the running realize may close segments
        self.closed_segments = 0

    def _others(self, r: int) -> bool:
        """Whether a storage's bytes are not the cache's (kept, a region input, live)."""
        return self.kept[r] or self.g.producer[r] < 0 or (self.live is not None and self.live[r])

    def plan(self, cache_limit: int | None) -> SegmentPlan | None:
        """Plan the pass's bound (rule 1): automatic (``None``) waits for ``decide``; an
        explicit limit plans the cuts now when the saved bytes exceed it and returns the
        plan (``feasible`` false: the least peak two forwards allow is used instead)."""
        profile = self.profile
        assert profile is not None
        if cache_limit is None:
            self.undecided = profile.saved_bytes > 0
            return None
        if profile.saved_bytes <= cache_limit:
            self.profile = None
            return None
        plan = profile.plan(cache_limit)
        self.limit, self.cuts = max(plan.peak, 1), list(plan.cuts)
        return plan

    def held_bytes(self, order: Sequence[int], need: dict[int, int]) -> int:
        """Bytes of the storages a realize running ``order`` leaves cached for later."""
        kept, uses, root, outputs = self.kept, self.uses, self.root, self.g.outputs
        held = {
            root[o] for j in order for o in outputs[j] if not kept[o] and uses[o] > need.get(o, 0)
        }
        return sum(self.g.nbytes[r] for r in held if not self._others(r))

    def decide(self, v: int, min_bytes: int) -> bool | None:
        """The automatic bound's decision at a realize of ``v``: whether the pass is
        bounded, ``None`` when that realize caches nothing for later (rule 1)."""
        order, need = collect(self.g, v, self.kept, self.cached)
        held = self.held_bytes(order, need)
        if held == 0:
            return None
        self.undecided = False
        if held < min_bytes:
            self.profile = None
            return False
        assert self.profile is not None
        plan = self.profile.plan(extra=step_gradient_bytes(self.g, v))
        if not plan.cuts or held < 2 * plan.peak:
            self.profile = None
            return False
        self.limit, self.cuts = max(plan.peak, 1), list(plan.cuts)
        return True

    def realize(self, v: int, run: Callable[[int], None]) -> None:
        """Realize ``v`` (rule 2): collect its op nodes, ``run`` them in forward order,
        close the segments at the cuts passed; the last segment stays cached."""
        order, self.need = collect(self.g, v, self.kept, self.cached)
        self.segment = []
        # When what it leaves cached fits, the realize closes nothing: it runs a closed
        # segment again.
        self.closing = self.held_bytes(order, self.need) > self.limit
        profile = self.profile
        if self.closing and profile is not None:  # See Note [Planned segment cuts], rule 4.
            self.profile = None
            cut = profile.tail_cut(self.cuts, self.g.producer[v])
            if cut is not None:
                bisect.insort(self.cuts, cut)
        try:
            for k, j in enumerate(order):
                run(j)
                if self.closing and k + 1 < len(order) and self._closes_between(j, order[k + 1]):
                    self.close()
        finally:
            self.unpin()
            self.need = {}
            self.active = {}

    def made(self, o: int) -> None:
        """Op node output ``o`` was cached: active for this realize, or in the segment."""
        if o in self.need:
            self.active[o] = None
        else:
            self.segment.append(o)

    def read(self, i: int) -> None:
        """A run of this realize read ``i`` (after its use was taken): once no collected
        node reads it any more, it joins the segment unless it is a checkpoint."""
        left = self.need[i] - 1
        if left > 0:
            self.need[i] = left
            return
        del self.need[i]
        if i in self.active:
            del self.active[i]
            if self.cached[i] and i not in self.checkpoints:
                self.segment.append(i)

    def close(self) -> None:
        """Keep the frontier cached as checkpoints, pinned (one use more) until the next
        close; free the open segment's values, owing their producers a run (rule 2)."""
        self.checkpoints.update(self.active)
        self.closed_segments += 1
        for d in self.segment:
            if self.cached[d]:
                self.free(d)
                self.owe(self.g.producer[d])
        self.segment = []
        for a in self.active:
            self.uses[a] += 1
        self.unpin()
        self.pinned = list(self.active)

    def unpin(self) -> None:
        """Take the pins of the last cut's checkpoints back; free those with no use left."""
        uses = self.uses
        for a in self.pinned:
            uses[a] -= 1
            if uses[a] == 0 and self.cached[a]:
                self.free(a)
        self.pinned = []

    def _closes_between(self, after: int, before: int) -> bool:
        """Whether a cut lies at op node ``after`` or between it and ``before``."""
        cuts = self.cuts
        k = bisect.bisect_left(cuts, after)
        return k < len(cuts) and cuts[k] < before

    def owe(self, j: int) -> None:
        """A cached output of op node ``j`` was freed: ``j`` runs again, and each of its
        recomputed inputs gets a use, owed further back when not cached (rule 3)."""
        inputs, producer, kept = self.g.inputs, self.g.producer, self.kept
        owed, uses, cached = self.owed, self.uses, self.cached
        stack = [j]
        while stack:
            j = stack.pop()
            if owed[j]:
                continue
            owed[j] = True
            for i in inputs[j]:
                if not kept[i]:
                    uses[i] += 1
                    if not cached[i]:
                        stack.append(producer[i])


class Executor(Protocol):
    """What runs a pass's op nodes: the engine's runs recorded ops and holds tensors, the
    simulator's adds bytes."""

    def run(self, j: int) -> None:
        """Run op node ``j``: its outputs exist until ``hold`` or ``discard``."""

    def hold(self, o: int) -> None:
        """Cache output ``o`` of the node just run."""

    def discard(self, o: int) -> None:
        """Output ``o`` of the node just run is not cached."""

    def free(self, v: int) -> None:
        """Free the cached value ``v``."""


class Pass:
    """One backward pass: use counts, transient values, the bounded cache, and the
    realize/run/use loop against an executor. See Note [One pass core].

    Args:
        g: the graph.
        kept: per value, whether it is kept.
        uses: per value, the pass's use counts (``count_uses``).
        cached: per value, whether it is cached (the pass updates it).
        executor: runs op nodes and holds or frees their values.

    Attributes:
        transient: per value, whether it is transient (set by ``mark_transient``).
        waiting: per transient value, the op nodes of the running realize that read it.
        ran: per op node, whether it ran in this pass.
        runs: per op node, how many times it ran in this pass.
        bound: the bounded cache's state, or ``None`` for a pass that caches without bound.
    """

    def __init__(
        self,
        g: PassGraph,
        kept: Sequence[bool],
        uses: MutableSequence[int],
        cached: MutableSequence[bool],
        executor: Executor,
    ) -> None:
        self.g, self.kept, self.uses, self.cached, self.executor = g, kept, uses, cached, executor
        self.transient = [False] * len(g.producer)
        self.waiting = [0] * len(g.producer)
        self.ran = [False] * len(g.outputs)
        self.runs = [0] * len(g.outputs)
        self.bound: Bound | None = None
        self.bound_min_bytes = 0
        self.transient_min_bytes = 0
        self.live: Sequence[bool] | None = None

    def start(
        self,
        cache_limit: int | None,
        bounded: bool,
        last: Sequence[int],
        saved: Sequence[bool],
    ) -> SegmentPlan | None:
        """Plan the pass once its use counts are set: the bounded cache when ``bounded``
        (``cache_limit``: bytes, or ``None`` for the automatic bound), else, or when no
        bound is needed, the transient values. Returns the plan of an explicit limit (see
        ``Bound.plan``).

        See Note [Bounded recompute cache], rule 1, and Note [Transient values].
        """
        plan = None
        if bounded:
            bound = Bound(
                self.g, self.kept, self.uses, self.cached, self.free, last, saved, self.live
            )
            plan = bound.plan(cache_limit)
            if bound.limit > 0 or bound.undecided:
                self.bound = bound
        if self.bound is None:
            self.mark_transient()
        return plan

    def mark_transient(self) -> None:
        """Mark the pass's transient values (Note [Transient values])."""
        self.transient = mark_transient(
            self.g, self.kept, self.uses, self.transient_min_bytes, self.live
        )

    def free(self, v: int) -> None:
        """Free the cached value ``v``."""
        self.cached[v] = False
        self.executor.free(v)

    def use(self, v: int) -> None:
        """One pending reader of ``v`` is served; free it after the last one. A transient
        value is freed as soon as no waiting op node reads it, and each of its uses is one
        use of its producer's recomputed inputs."""
        uses = self.uses
        uses[v] -= 1
        if self.transient[v]:
            for i in self.g.inputs[self.g.producer[v]]:
                if not self.kept[i]:
                    self.use(i)
            if self.waiting[v] > 0 and uses[v] > 0:
                return
        elif uses[v] > 0:
            return
        if self.cached[v]:
            self.free(v)

    def run(self, j: int) -> None:
        """Run op node ``j``: cache its outputs with a pending use, take a use of each
        recomputed input (Note [Use counts and freeing])."""
        ex, kept, uses, cached = self.executor, self.kept, self.uses, self.cached
        bound = self.bound if self.bound is not None and self.bound.limit > 0 else None
        self.ran[j] = True
        self.runs[j] += 1
        if bound is not None:
            bound.owed[j] = False
        ex.run(j)
        outs = self.g.outputs[j]
        for o in outs:
            if not kept[o] and uses[o] > 0 and not cached[o]:
                cached[o] = True
                ex.hold(o)
                if bound is not None:
                    bound.made(o)
            else:
                ex.discard(o)
        if outs and self.transient[outs[0]]:
            return  # its inputs are released with its value's uses
        for i in self.g.inputs[j]:
            if not kept[i]:
                self.use(i)
                if bound is not None:
                    bound.read(i)

    def _unpin(self, j: int) -> None:
        """Op node ``j`` ran (or was skipped): its transient inputs are no longer needed
        for it."""
        for i in self.g.inputs[j]:
            if self.transient[i]:
                self.waiting[i] -= 1
                if self.waiting[i] == 0 and self.cached[i]:
                    self.free(i)

    def realize(self, v: int) -> None:
        """Recompute ``v`` from the nearest kept or cached values. See Note [Realize
        order]: a bounded pass collects, then runs in forward order."""
        bound = self.bound
        # See Note [Bounded recompute cache], rule 1: decided at the first realize that caches.
        if bound is not None and bound.undecided and bound.decide(v, self.bound_min_bytes) is False:
            self.bound = bound = None
            self.mark_transient()
        if bound is not None and bound.limit > 0:
            bound.realize(v, self.run)
            return
        g, kept, cached, transient, ran = self.g, self.kept, self.cached, self.transient, self.ran
        inputs, outputs, producer = g.inputs, g.outputs, g.producer
        stack = [(producer[v], False)]
        while stack:
            j, expanded = stack.pop()
            outs = outputs[j]
            if outs and transient[outs[0]]:  # runs whenever its value is not cached
                if cached[outs[0]]:
                    continue
            elif ran[j]:
                if expanded:
                    self._unpin(j)
                continue
            if expanded:
                self.run(j)
                self._unpin(j)
                continue
            stack.append((j, True))
            for i in inputs[j]:
                if not kept[i]:
                    if transient[i]:
                        self.waiting[i] += 1
                    if not cached[i]:
                        stack.append((producer[i], False))
