"""One backward pass over an integer-indexed graph: the realize/run/use loop, written once.

The engine (``passes``, ``realize``) and the liveness simulator (``planner/liveness.py``)
both run a backward pass as a :class:`Pass`: the engine over a ``PassGraph`` it numbers from
a region (``passes.pass_graph``), the simulator over one built from its ``SimGraph``.
Values and op nodes are integers; per-value state (use counts, whether a value is kept or
cached) is held in plain lists. Nothing here runs an op or holds a tensor: an *executor*
does (the engine's runs the recorded op and holds tensors, the simulator's adds bytes), and
the engine-only events (a second read of a saved tensor, live forward tensors, kept values
changed after the region, a partial backward) stay hooks of the engine.

# Note [One pass core]
# The rules of Notes [Use counts and freeing], [Transient values], [Bounded recompute
# cache] and [Releasing kept values] are functions of the graph's shape and of per-value
# counters only: which op nodes read and make which values, which values are kept, views,
# bytes. Written over integers they serve both sides, so the simulator predicts what the
# engine does by construction instead of by a copy kept close by a drift test:
# 1. ``pass_graph.count_uses``: one sweep from the last op node back; a node runs when a
#    recomputed output has a pending use, and then adds one use to each of its inputs
#    (recomputed ones for a pass, all for the live uses at region exit). ``taken`` lets the
#    engine serve a value from the program's live forward tensor instead (Note [Live
#    forward tensors]). The planner's recompute-cost sweep and its needed values use it too.
# 2. ``pass_graph.collect``: the walk back from values through producers to the nearest
#    kept or cached values, with the reads of each value; the bounded realize, the decision
#    to bound, a second read (``realize_again``) and the analysis of recompute chains use it.
# 3. ``pass_graph.mark_transient``: Note [Transient values].
# 4. ``cache_bound.Bound``: Note [Bounded recompute cache] (profile, decision, cuts,
#    segments, owed runs, the collected realize in forward order).
# 5. :class:`Pass`: the realize/run/use loop of an unbounded or bounded pass against an
#    :class:`Executor`; the engine's is ``realize.Runner``, the simulator's its memory
#    accountant.
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from typing import Protocol

from ckpt_graph.engine.cache_bound import Bound
from ckpt_graph.engine.pass_graph import PassGraph, mark_transient
from ckpt_graph.engine.segment_plan import SegmentPlan

__all__ = ["Executor", "Pass"]


class Executor(Protocol):
    """What runs a pass's op nodes: the engine's runs recorded ops and holds tensors, the
    simulator's adds bytes."""

    def run(self, j: int) -> None:
        """Run op node ``j``: its outputs exist until ``hold`` or ``discard``."""

    def hold(self, o: int) -> None:
        """Cache output ``o`` of the node just run."""

    def discard(self, o: int) -> None:
        """Output ``o`` of the node just run is not cached."""

    def done(self, j: int) -> None:
        """Every output of op node ``j`` is held or discarded."""

    def free(self, v: int) -> None:
        """Free the cached value ``v``."""


class Pass:
    """One backward pass: use counts, transient values, the bounded cache, and the
    realize/run/use loop against an executor. See Note [One pass core].

    Args:
        g: the graph.
        kept: per value, whether it is kept.
        uses: per value, the pass's use counts (``pass_graph.count_uses``).
        cached: per value, whether it is cached (the pass updates it).
        executor: runs op nodes and holds or frees their values.
        live: per value, whether the pass reads it as the program's live forward tensor
            (the engine's Note [Live forward tensors]); ``None``: none is.
        transient_min_bytes: smaller values are never transient.
        bound_min_bytes: an automatic bound leaves a pass unbounded when its first caching
            realize caches less.

    Attributes:
        transient: per value, whether it is transient (set by ``mark_transient``).
        any_transient: whether some value is.
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
        *,
        live: Sequence[bool] | None = None,
        transient_min_bytes: int = 0,
        bound_min_bytes: int = 0,
    ) -> None:
        self.g, self.kept, self.uses, self.cached, self.executor = g, kept, uses, cached, executor
        self.live = live
        self.transient_min_bytes = transient_min_bytes
        self.bound_min_bytes = bound_min_bytes
        self.transient = [False] * len(g.producer)
        self.any_transient = False  # nothing to unpin after a run without transient values
        self.waiting = [0] * len(g.producer)
        self.ran = [False] * len(g.outputs)
        self.runs = [0] * len(g.outputs)
        self.bound: Bound | None = None
        # Bound once: ``run`` calls them for every op node (no reference back to the pass).
        self._run, self._hold, self._discard, self._done = (
            executor.run,
            executor.hold,
            executor.discard,
            executor.done,
        )

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
                self.g,
                self.kept,
                self.uses,
                self.cached,
                self.executor.free,
                last,
                saved,
                self.live,
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
        self.any_transient = any(self.transient)

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
        kept, uses, cached, transient = self.kept, self.uses, self.cached, self.transient
        bound = self.bound
        if bound is not None and bound.limit <= 0:
            bound = None
        self._run(j)
        self.ran[j] = True
        self.runs[j] += 1
        if bound is not None:
            bound.owed[j] = False
        outs = self.g.outputs[j]
        for o in outs:
            if not kept[o] and uses[o] > 0 and not cached[o]:
                cached[o] = True
                self._hold(o)
                if bound is not None:
                    bound.made(o)
            else:
                self._discard(o)
        self._done(j)
        if outs and transient[outs[0]]:
            return  # its inputs are released with its value's uses
        for i in self.g.inputs[j]:
            if not kept[i]:
                if transient[i]:
                    self.use(i)
                else:  # ``use``, inlined for the common value
                    uses[i] -= 1
                    if uses[i] <= 0 and cached[i]:
                        self.free(i)
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
                if expanded and self.any_transient:
                    self._unpin(j)
                continue
            if expanded:
                self.run(j)
                if self.any_transient:
                    self._unpin(j)
                continue
            stack.append((j, True))
            for i in inputs[j]:
                if not kept[i]:
                    if transient[i]:
                        self.waiting[i] += 1
                    if not cached[i]:
                        stack.append((producer[i], False))
