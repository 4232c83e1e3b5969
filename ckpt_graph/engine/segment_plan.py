"""Where a bounded pass closes its segments: cut positions planned from the pass's values.

A pure function of the pass's recomputed storages (no framework objects), used by the
bounded pass of ``pass_core``, which the engine and the liveness simulator both run, so both
bound the same pass the same way.

# Note [Planned segment cuts]
# A bounded pass (Note [Bounded recompute cache]) closes a segment after fixed op positions,
# its *cuts*, planned when the pass starts from the storages its recomputed values use:
# per storage, the op that makes it, the last op that will read it in the pass, its bytes and
# whether autograd saved it (a later unpack reads it). For a cut after op ``c``:
# - the *segment* before it holds the saved storages made since the previous cut; they are
#   dropped when the cut closes the segment and made again when backward reaches them;
# - the cut's *checkpoints* are the storages made since the previous cut that an op after
#   ``c`` reads: they stay cached until that op ran again (older ones are already
#   checkpoints of an earlier cut).
# Backward runs the segments again from the last to the first; while segment ``j`` is cached
# again, the checkpoints of the cuts before it are too, so the cache holds about
# ``max_j (checkpoints of cuts 1..j-1 + segment j)``; the first realize ends with every
# checkpoint and the last segment, the case ``j`` = last. Every op runs at most twice
# whatever the cuts: once in the first realize, once when its segment is cached again.
# 1. Cuts for a peak ``M``: of the cuts keeping the checkpoints so far plus each segment
#    within ``M``, those with the fewest checkpoint bytes in all, found over segment starts
#    in forward order (per start, the fewest checkpoint bytes of cuts that reach it; a
#    segment grows from a start while it fits; the latest of equals). Every checkpoint is
#    cached with the last segment when backward begins, and stays cached through the
#    backward of the blocks after it: a model whose heavy steps come late in the forward
#    (ConvNeXt's last depthwise ``convolution_backward``, with a workspace of ~6 MiB for
#    an 8 KiB input) peaks there. A greedy pass finds feasible peaks fast and bounds that
#    search (paths with more checkpoint bytes than its cuts are dropped): from the first
#    op, a segment grows while it fits, and the cut goes where it adds the fewest
#    checkpoint bytes per byte of segment (the latest of equals). Alone, the greedy cut a
#    ConvNeXt inside a stage-one MLP, whose 4x activation stayed cached as a checkpoint
#    through the last block's convolution backward: 0.9% above checkpointing every block,
#    0.5% below with the fewest checkpoint bytes within the same peak (a GPT-2 3% lower).
#    ``M`` is feasible when the greedy reaches the end.
# 2. Automatically the pass takes the least feasible ``M`` (bisection to 1/256; the
#    fewest-checkpoint search within the least ``M`` found; a bisection of that search too
#    reached 2.1% below on the ConvNeXt but cost 5-10x the greedy's time on 500-op graphs,
#    paid at every simulated plan of a budget's search): the least
#    cache that two forwards allow, found on the pass's own values rather than from a mean
#    (a mean frontier, used before, sized segments for the costlier cuts inside blocks and
#    peaked 13% above checkpointing every block of a 24-block transformer). The first
#    realize that closes segments ends holding every checkpoint while the gradients of its
#    step are alive (``extra``: its reader's outputs and the values crossing it; a language
#    model's logits): larger peaks, with fewer greedy cuts, are tried up to no cut, and the
#    one with the least ``max(M, checkpoints + extra)`` is taken. Plans are kept per profile
#    for the process (a training loop's passes have the same one).
# 3. An explicit ``cache_limit`` ``L`` is ``M = L`` when feasible; otherwise the least
#    feasible ``M`` is used and the engine warns.
# 4. The tail cut. The first realize that closes segments runs during the backward step of
#    its target's reader, near the end of the forward: the gradients of the region's last
#    values are alive then (a language model's logits, its head's weight), and the last
#    segment would stay cached with every checkpoint on top of them (a GPT with an
#    ``nn.Linear`` head peaked above checkpointing every block, whose last block is not
#    recomputed before the head's step ends). That realize therefore cuts once more, between
#    the last planned cut and its target's producer, where the new checkpoints plus the
#    saved bytes after the cut are least: the rest of the last segment is dropped and
#    cached again when backward reaches it, with the checkpoints of rule 1 (no new peak,
#    still at most two runs per op).
# 5. A bound on the fewest-checkpoint search. It grows a segment from every start it
#    reaches, so it visits about ``n x L`` ops, ``L`` the ops a segment spans within the
#    peak: fine where a segment spans tens of ops (the zoo models measured), quadratic
#    where a region is thousands of tiny ops (transformers' Mamba without its CUDA
#    kernels: its selective scan runs hundreds of small ops per layer, a segment spans
#    hundreds of them, and a search over its 1,464-op region made ~370,000 op visits).
#    The planner simulates a pass per plan it evaluates (Note [One pass core]), so the
#    search ran ~700 times per budget point and planning took 27-159 s where other models
#    take 2-4 s. The search therefore
#    stops after ``LEAST_KEPT_WORK`` op visits per op of the region and the greedy cuts of
#    rule 1 are taken: the same peak, a few per cent more checkpoint bytes (rule 1's
#    ConvNeXt and GPT-2 figures), and a cost linear in the ops. The bound is a count of
#    visits, not of time, so the cuts do not depend on the machine's load. The zoo's
#    regions stay under it (their searches make 24-36 visits per op, greedy scans
#    included): hf-gpt2, hf-convnext and torch-loop get the same ``memory_budget`` plans as
#    without it, and so does Mamba (BENCHMARKS.md, "Planning time on Mamba").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["LEAST_KEPT_WORK", "PLANS", "PLANS_LIMIT", "SegmentPlan", "SegmentProfile"]

_GRID = 16  # peaks tried between the least and no cut, when the first realize holds more
# Op visits per op of the region the fewest-checkpoint search may spend (Note [Planned
# segment cuts] rule 5).
LEAST_KEPT_WORK = 64
# Plans by profile: a pure function of it, the same at every step of a training loop, and
# the least-kept search costs a few milliseconds per hundred op nodes (integers only).
PLANS: dict[tuple[object, ...], SegmentPlan] = {}
PLANS_LIMIT = 256


@dataclass(frozen=True)
class SegmentPlan:
    """Cut positions of a bounded pass. See Note [Planned segment cuts].

    Attributes:
        peak: bytes the bounded cache is planned to hold at most (checkpoints plus one
            segment); the total saved bytes when no cut is needed.
        cuts: op indices after which a segment closes, ascending.
        feasible: whether the requested peak could be met (always true automatically).
    """

    peak: int
    cuts: tuple[int, ...]
    feasible: bool = True


class SegmentProfile:
    """The recomputed storages of a pass, by op position: what planning cuts needs.

    Args:
        n: number of ops of the region.
        storages: per recomputed storage of the pass, ``(producer, last reader, bytes,
            saved)``: the op that makes it, the last op of the pass that reads it (the producer
            if none), its bytes, and whether autograd saved it.

    Attributes:
        saved_bytes: bytes of the saved storages (the unbounded cache's worst case).

    Example:
        >>> chain = [(i, i + 1, 10, True) for i in range(8)]  # 8 ops, each output read next
        >>> profile = SegmentProfile(8, chain)
        >>> plan = profile.plan()
        >>> plan.peak, plan.cuts, profile.saved_bytes, profile.tail_cut(plan.cuts, 7)
        (40, (3, 6), 80, None)
    """

    def __init__(self, n: int, storages: Sequence[tuple[int, int, int, bool]]) -> None:
        self.n = n
        self.key = (n, tuple(storages))
        self.saved_at = saved_at = [0] * (n + 1)
        self.born = born = [0] * (n + 1)  # bytes made at an op and read after it
        self.ending: list[list[tuple[int, int]]] = [[] for _ in range(n + 1)]
        for producer, last, nbytes, saved in storages:
            if saved:
                saved_at[producer] += nbytes
            if last > producer:
                born[producer] += nbytes
                self.ending[last].append((producer, nbytes))
        self.suffix = suffix = [0] * (n + 2)
        for p in range(n, -1, -1):
            suffix[p] = suffix[p + 1] + saved_at[p]
        self.saved_bytes = suffix[0]

    def plan(self, limit: int | None = None, extra: int = 0) -> SegmentPlan:
        """Cuts for a peak of ``limit`` bytes (an explicit ``cache_limit``), or for the least
        peak when ``None`` or infeasible; automatically, ``extra`` bytes (gradients) are
        alive beside every checkpoint during the first closing realize. See Note [Planned
        segment cuts], rules 1-3."""
        key = (self.key, limit, extra)
        plan = PLANS.get(key)
        if plan is None:
            plan = self._plan(limit, extra)
            if len(PLANS) >= PLANS_LIMIT:
                PLANS.clear()
            PLANS[key] = plan
        return plan

    def _plan(self, limit: int | None, extra: int) -> SegmentPlan:
        if limit is not None:
            planned = self._least_kept_within(limit)
            if planned is not None:
                return SegmentPlan(planned[0], tuple(planned[2]))
        lo, hi = 0, self.saved_bytes
        best: tuple[int, int, list[int]] = (hi, 0, [])
        while hi - lo > max(1, hi // 256):
            mid = (lo + hi) // 2
            planned = self._cuts_within(mid)
            if planned is None:
                lo = mid
            else:
                hi, best = mid, planned
        if best[2]:  # the fewest checkpoint bytes within the greedy's least peak
            best = self._least_kept_within(hi) or best
        if limit is None and extra > 0 and best[2]:
            # Fewer checkpoints for a larger segment when the first realize is the peak.
            least, top = best[0], self.saved_bytes
            score = max(best[0], best[1] + extra)
            for k in range(1, _GRID + 1):
                planned = self._cuts_within(int(least * (top / least) ** (k / _GRID)))
                if planned is not None and max(planned[0], planned[1] + extra) < score:
                    best, score = planned, max(planned[0], planned[1] + extra)
        return SegmentPlan(best[0], tuple(best[2]), limit is None)

    def tail_cut(self, cuts: Sequence[int], target: int) -> int | None:
        """Where the first closing realize, of a value made by op ``target``, cuts once more
        (``None``: nowhere better than leaving the segment open). See Note [Planned segment
        cuts], rule 4."""
        start = 0
        for c in cuts:
            if c < target:
                start = c + 1
        suffix = self.suffix
        best, best_bytes = -1, 0
        for p, _, frontier in self._grow(start, target, self.saved_bytes):
            held = frontier + suffix[p + 1] - suffix[target + 1]
            if best < 0 or held <= best_bytes:
                best, best_bytes = p, held
        open_bytes = suffix[start] - suffix[target + 1]  # the segment, left open
        return best if best >= 0 and best_bytes < open_bytes else None

    def _least_kept_within(self, peak: int) -> tuple[int, int, list[int]] | None:
        """Cuts keeping checkpoints plus each segment within ``peak`` bytes with the least
        checkpoint bytes in all (rule 1): the peak reached, the checkpoint bytes and the
        cuts, or ``None`` if no cuts can."""
        greedy = self._cuts_within(peak)
        n, suffix = self.n, self.suffix
        work = LEAST_KEPT_WORK * max(n, 1)  # See Note [Planned segment cuts] rule 5.
        # checkpoint bytes only grow along the cuts: paths above the greedy's are dropped
        upper = greedy[1] if greedy is not None else peak  # each segment fits: kept <= peak
        best = [-1] * (n + 1)  # per segment start: least checkpoint bytes of the cuts before
        prev = [-1] * (n + 1)
        reach = [0] * (n + 1)
        best[0] = 0
        end = -1
        for s in range(n):
            kept = best[s]
            if kept < 0 or kept > upper:
                continue
            room = peak - kept
            if suffix[s] <= room and (end < 0 or kept <= best[end]):
                end, upper = s, kept
                continue
            for p, seg, frontier in self._grow(s, n - 1, room):
                work -= 1
                if work < 0:
                    return greedy
                k = kept + frontier
                if seg > 0 and k <= upper and (best[p + 1] < 0 or k <= best[p + 1]):
                    best[p + 1] = k
                    prev[p + 1] = s
                    reach[p + 1] = max(reach[s], kept + seg)
        if end < 0:
            return greedy
        cuts: list[int] = []
        s = end
        while s > 0:
            cuts.append(s - 1)
            s = prev[s]
        cuts.reverse()
        return max(reach[end], best[end] + suffix[end]), best[end], cuts

    def _cuts_within(self, peak: int) -> tuple[int, int, list[int]] | None:
        """Greedy cuts keeping checkpoints plus each segment within ``peak`` bytes (rule 1):
        the peak reached, the checkpoint bytes of all cuts and the cuts, or ``None`` if it
        cannot."""
        n, suffix = self.n, self.suffix
        cuts: list[int] = []
        kept = 0  # checkpoint bytes of the cuts so far
        start = 0
        reached = 0
        while True:
            room = peak - kept
            if suffix[start] <= room:
                return max(reached, kept + suffix[start]), kept, cuts
            best = -1
            best_frontier = best_seg = 0
            for p, seg, frontier in self._grow(start, n, room):
                # checkpoint bytes per byte of segment: the least, the latest of equals
                if seg > 0 and (best < 0 or frontier * best_seg <= best_frontier * seg):
                    best, best_frontier, best_seg = p, frontier, seg
            if best < 0:
                return None
            reached = max(reached, kept + best_seg)
            kept += best_frontier
            cuts.append(best)
            start = best + 1

    def _grow(self, start: int, stop: int, room: int) -> Iterator[tuple[int, int, int]]:
        """A segment grown from op ``start``, one op at a time up to ``stop`` (excluded), while
        its saved bytes fit in ``room``: per op ``p``, ``(p, saved bytes of ops start..p,
        frontier)``, where the frontier is the bytes made in ops ``start..p`` that an op after
        ``p`` reads, the checkpoints of a cut after ``p`` (rule 1). The one scan behind the
        greedy, the least-kept search and the tail cut."""
        saved_at, born, ending = self.saved_at, self.born, self.ending
        seg = frontier = 0
        for p in range(start, stop):
            seg += saved_at[p]
            if seg > room:
                return
            frontier += born[p]
            for producer, nbytes in ending[p]:
                if producer >= start:
                    frontier -= nbytes
            yield p, seg, frontier
