"""The bounded recompute cache: the decision to bound, segments, checkpoints and owed runs.

:class:`Bound` is the state of a bounded pass over a ``pass_graph.PassGraph`` (integers, no
framework objects): ``pass_core.Pass`` runs it, in the engine and in the liveness
simulator alike. ``save_recompute_policy(cache_limit=...)`` is validated by
:func:`parse_cache_limit`.

# Note [Bounded recompute cache]
# Caching every recomputed value until its last use (Note [Use counts and freeing]) makes
# one region over a whole model hold as much as no checkpointing: with nothing kept but its
# inputs, the first unpack of backward realizes a value near the end of the forward, and
# every value before it stays cached until its own backward step. A pass therefore bounds
# what realize holds, with Chen et al.'s (2016) segments applied online:
# 1. Whether and where to bound. ``begin_pass`` profiles the storages of the recomputed
#    values the pass needs (``segment_plan.SegmentProfile``): T, the bytes of those autograd
#    saved, and where segments can be cut (Note [Planned segment cuts]). Automatically
#    (``cache_limit=None``) the decision waits for the pass's first realize that would leave
#    values cached for later unpacks or ops: the realizes before it (the transposed weight
#    of the last linear layer, a view of a kept value, comes first in most models) cache
#    nothing, and guessing which saved tensor is unpacked first (the last one saved, once)
#    left one region over most models unbounded. A realize that would cache less than
#    ``BOUND_MIN_BYTES`` decides nothing either when the pass's recomputed storages hold
#    more (CLIP's first such realize caches its 4-byte logit scale, and deciding there left
#    the pass unbounded at no checkpointing's peak, 2.6x torch per block's). That realize is collected (rule 2) and
#    the bytes it would cache counted exactly, by storage; the cuts are planned then, for
#    the least peak P of the cache (with the gradients alive at that unpack, see
#    ``step_gradient_bytes``). The pass is bounded when that realize would cache at least
#    2 P and at least ``BOUND_MIN_BYTES``; below, bounding saves less than half, or a few
#    bytes, and costs a recompute, so a small region (one block of ``wrap``) or a policy that
#    keeps enough (``save_matmuls``) caches as before, transient values included (marked
#    then, as an unbounded pass marks them at its start). An explicit ``cache_limit`` L bounds whenever T > L, with cuts planned at the
#    pass's start for a peak of L; when two forwards cannot meet L, a warning names the
#    least peak they can, which is used instead. ``cache_limit="unbounded"`` caches every
#    value until its last use.
# 2. A bounded realize first collects the op nodes to run (from its target back to kept or
#    cached values) and counts, per value, the collected ops that read it (``need``); then it
#    runs them in forward order. A value that no remaining op of the realize reads, but a
#    later unpack or op will (a use left), joins the open *segment*. When the realize
#    passes a planned cut, the segment is closed: every value of this realize that a
#    remaining op still reads (the frontier: with the kept values it suffices for every
#    later op) becomes a *checkpoint*, cached until its use count reaches zero, and the
#    values of the segment are dropped. Checkpoints hold one use more until the next close
#    (or the realize's end): the ops of the segment after them read them, and when that
#    segment is dropped in turn its producers are owed runs that read them again (freed at
#    once, they were made again from the cut before, and so on back: ops of a BERT ran
#    seven times). A realize closes nothing when the values it leaves cached fit in P (it
#    runs a closed segment again), nor after its last op: the open segment stays cached,
#    backward uses it next.
# 3. Dropping a value with pending uses means its producer will run again: the producer is
#    *owed* a run and each of its recomputed inputs gets one more use; an input that is not
#    cached owes a run of its own producer, and so on (a node is owed at most one run;
#    running clears it). Use counts thus still count exactly the future unpacks and runs,
#    and a checkpoint is freed once the last segment that reads it ran again.
# 4. A later unpack of a dropped value realizes it from the checkpoints. Backward runs in
#    reverse, so the first unpack in a segment asks for its latest value and runs the
#    segment again, whose values fit in P and stay cached until used. Each op therefore
#    runs at most twice: in the first realize, and when its segment runs again. Ops off the
#    path to the first target run when needed, from whatever is cached: they can add runs,
#    and cache at most what their own realize needs.
# 5. Exactness and termination: a dropped value is recomputed by the same op from the same
#    values (kept, cached, or recomputed by the same rule), random ops with their recorded
#    generator state (Note [RNG replay]), in-place ops on a copy unless no other pending use
#    (owed runs included) needs their input. An unpack runs each node of its collected set
#    once, so every pass ends.
# Transient values (Note [Transient values]) are not marked in a bounded pass: segments
# already bound the residual stream, and a transient producer would run once per use.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, MutableSequence, Sequence

from ckpt_graph._errors import CkptGraphError
from ckpt_graph._sizes import parse_size
from ckpt_graph.engine.pass_graph import PassGraph, collect, roots
from ckpt_graph.engine.segment_plan import SegmentPlan, SegmentProfile

__all__ = [
    "BOUND_MIN_BYTES",
    "Bound",
    "parse_cache_limit",
    "step_gradient_bytes",
]


def parse_cache_limit(limit: object) -> int | str | None:
    """Validate a ``cache_limit``: bytes, ``None`` (automatic) or ``"unbounded"``.

    See Note [Bounded recompute cache].

    Returns:
        A positive number of bytes, ``None`` or ``"unbounded"``.

    Raises:
        CkptGraphError: for anything else (0, negative, bool, unknown unit).

    Example:
        >>> parse_cache_limit("256MiB"), parse_cache_limit(None), parse_cache_limit(4096)
        (268435456, None, 4096)
    """
    hint = (
        'pass a positive number of bytes (4096, "256MiB", "1.5GB"), None for the automatic '
        'bound, or "unbounded" to cache every recomputed value until its last use'
    )
    if limit is None or limit == "unbounded":
        return limit  # type: ignore[return-value]
    if isinstance(limit, int) and not isinstance(limit, bool):
        if limit > 0:
            return limit
        raise CkptGraphError(f"ckpt_graph: cache_limit={limit!r} is not a valid bound; {hint}")
    if isinstance(limit, str):
        size = parse_size(limit)
        if size is not None and size > 0:
            return size
    raise CkptGraphError(f"ckpt_graph: cache_limit={limit!r} is not a valid bound; {hint}")


# A pass whose first caching realize would cache less stays unbounded: running its ops again
# costs ~10 us of Python each, more than holding a few small values is worth (the same
# trade as ``passes.TRANSIENT_MIN_BYTES``). See Note [Bounded recompute cache], rule 1.
BOUND_MIN_BYTES = 64 * 1024


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
        cached: MutableSequence[bool],
        free: Callable[[int], None],
        last: Sequence[int],
        saved: Sequence[bool],
        live: Sequence[bool] | None = None,
    ) -> None:
        self.g, self.kept, self.uses, self.cached = g, kept, uses, cached
        self._free = free  # the executor's: no reference back to the pass (no cycle)
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

    def free(self, v: int) -> None:
        """Free the cached value ``v``."""
        self.cached[v] = False
        self._free(v)

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
        assert self.profile is not None
        order, need = collect(self.g, (v,), self.kept, self.cached)
        held = self.held_bytes(order, need)
        if held == 0 or (held < min_bytes and self.profile.saved_bytes >= min_bytes):
            return None  # a scalar (CLIP's logit scale) says nothing of the pass: wait
        self.undecided = False
        if held < min_bytes:
            self.profile = None
            return False
        plan = self.profile.plan(extra=step_gradient_bytes(self.g, v))
        if not plan.cuts or held < 2 * plan.peak:
            self.profile = None
            return False
        self.limit, self.cuts = max(plan.peak, 1), list(plan.cuts)
        return True

    def realize(self, v: int, run: Callable[[int], None]) -> None:
        """Realize ``v`` (rule 2): collect its op nodes, ``run`` them in forward order,
        close the segments at the cuts passed; the last segment stays cached."""
        order, self.need = collect(self.g, (v,), self.kept, self.cached)
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
