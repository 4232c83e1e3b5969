"""Graph formulations that seed the memory-budget solver: a min-cut sweep and a segment DP.

Both work on the simulator's graph (``liveness.SimGraph``) and return candidate plans (sets
of kept ops); neither checks the budget itself: ``solve.solve`` simulates every seed,
repairs the ones that do not fit and runs its local search from the cheapest.
See Note [Memory budget planning]. Also: candidate_ops, brute_force.

# Note [Min-cut and segment DP seeds]
# 1. Recompute model shared by both. An op runs in backward iff one of its outputs is not
#    kept and is needed (saved, or an input of an op that runs); the cost of a plan is the sum
#    of the costs of the ops that run, once each (the simulator's run-set, Note [Backward
#    liveness model] rule 2; cheap pointwise ops the simulator runs again at each use are
#    counted once here). Kept bytes are the own storages of the kept candidates.
# 2. Min-cut (in the spirit of AOTAutograd's min-cut partitioner, with a recompute price).
#    Each needed op j becomes an edge ``in_j -> out_j`` whose capacity is the bytes of its
#    own outputs if j is a candidate (cutting it = keeping them), 0 if its outputs are kept
#    anyway, infinite otherwise (views: they cannot be kept on their own). Data edges
#    ``out_p -> in_j`` are infinite (a recomputed op needs its inputs: kept or recomputed),
#    each saved value's producer has ``out_p -> sink`` (backward needs it), and
#    ``source -> in_j`` costs ``lam x cost(j)``: ops on the sink side are the ones that run.
#    A minimum cut therefore minimises ``kept bytes + lam x recompute cost`` exactly for rule
#    1's model (tests/planner/test_budget.py checks it against enumeration); sweeping ``lam`` traces
#    the lower convex hull of (kept bytes, recompute cost). What it ignores is the peak's
#    other half, the recomputed values cached during backward, so ``lam`` is chosen on the
#    simulated peak: a grid of 5 values, then 4 bisection steps towards the largest ``lam``
#    whose plan fits (rule 4). Identical layers tie at the same ``lam`` and would switch all
#    at once, so op j's price is tilted by ``1 + 0.1 j / n`` (later layers are kept first).
# 3. Segment DP (Chen et al.'s sqrt(n) checkpointing / Griewank's segments, as a DP). Cuts are
#    positions in forward order; a cut after op i keeps every candidate produced at or before
#    i that an op or a saved tensor after i needs (the values crossing it), so backward's
#    recompute chains never cross it. Between two cuts, backward recomputes the segment at
#    once and caches its needed values: the segment's *transient* bytes (not kept, needed).
#    Inside a segment, candidate c is kept when ``mu x bytes(c) < cost(c)`` (a Lagrangian
#    knapsack on (bytes, cost): keeping c saves exactly its own cost under rule 1). The DP
#    minimises ``recompute cost + mu x kept bytes`` over cut sequences whose segments'
#    transient bytes stay within ``T``; values crossing several cuts are paid at each (an
#    over-estimate). O(ops x segment length) per DP. For a budget B it runs for T = 0.15 B
#    and 0.35 B, each with ``mu`` searched on the simulated peak (rule 4).
# 4. Search over the trade-off parameter (``_bisect``): peaks are not monotone in it (keeping
#    nothing recomputes everything at once), so a grid finds the fitting value on the cheap
#    side, bisection narrows it; the last plan that fits and the first that does not are
#    returned (the solver repairs the latter).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

from ckpt_graph.planner.liveness import SimGraph, count_uses, simulate
from ckpt_graph.planner.records import Solution

__all__ = [
    "brute_force",
    "candidate_ops",
    "mincut_plan",
    "mincut_sweep",
    "segment_dp",
    "segment_dp_sweep",
]


_INF = float("inf")


_TILT = 0.1


def _needed(g: SimGraph) -> list[bool]:
    """Values backward may need: saved, or inputs of ops producing needed values."""
    uses = [0] * len(g.values)
    for _, v in g.saved:
        uses[v] += 1
    count_uses(g.pass_graph, [False] * len(g.values), uses, all_inputs=True)
    return [u > 0 for u in uses]


def candidate_ops(g: SimGraph, ops: Iterable[int] | None = None) -> list[int]:
    """Ops worth deciding: they have a non-fixed, non-view output that backward may need.

    Example:
        >>> candidate_ops(graph)  # doctest: +SKIP
        [0, 2, 5]
    """
    needed = _needed(g)
    pool = range(len(g.ops)) if ops is None else ops
    return [
        j
        for j in pool
        if any(
            needed[o] and g.values[o].storage == o and o not in g.fixed for o in g.ops[j].outputs
        )
    ]


def _free(g: SimGraph, v: int) -> bool:
    """Whether value ``v`` is kept whatever the plan (a region input or fixed)."""
    return g.values[v].producer < 0 or v in g.fixed


def _own_bytes(g: SimGraph, op: int) -> int:
    return sum(
        g.values[o].nbytes
        for o in g.ops[op].outputs
        if g.values[o].storage == o and o not in g.fixed
    )


def mincut_plan(
    g: SimGraph, candidates: Sequence[int], lam: float, *, tilt: float = 0.0
) -> frozenset[int]:
    """Kept ops minimising ``kept bytes + lam x recompute cost``.

    See Note [Min-cut and segment DP seeds] rule 2.

    ``tilt`` > 0 prices op j's recompute ``1 + tilt x j / len(ops)`` times its cost (ties
    between identical layers then break towards keeping later ones).

    Example:
        >>> mincut_plan(graph, candidate_ops(graph), lam=1e-3)  # doctest: +SKIP
        frozenset({3, 7})
    """
    import networkx as nx

    needed = _needed(g)
    cands = set(candidates)
    net = nx.DiGraph()
    n = max(len(g.ops), 1)
    src, sink = "s", "t"
    for j, op in enumerate(g.ops):
        if not any(needed[o] for o in op.outputs):
            continue
        a, b = ("i", j), ("o", j)
        if all(_free(g, o) for o in op.outputs):
            net.add_edge(a, b, capacity=0)
        elif j in cands:
            net.add_edge(a, b, capacity=_own_bytes(g, j))
        else:
            net.add_edge(a, b)  # no capacity attribute: infinite
        price = lam * op.cost * (1 + tilt * j / n)
        if price > 0:
            net.add_edge(src, a, capacity=price)
        for i in op.inputs:
            p = g.values[i].producer
            if not _free(g, i) and p >= 0:
                net.add_edge(("o", p), a)
    for _, v in g.saved:
        p = g.values[v].producer
        if not _free(g, v) and p >= 0:
            net.add_edge(("o", p), sink)
    if src not in net or sink not in net:
        return frozenset()
    _, (s_side, _) = nx.minimum_cut(net, src, sink)
    return frozenset(j for j in cands if ("i", j) in s_side and ("o", j) not in s_side)


def mincut_sweep(
    g: SimGraph, candidates: Sequence[int], peak: Callable[[frozenset[int]], int], budget: int
) -> list[frozenset[int]]:
    """Min-cut plans around the largest ``lam`` whose plan's ``peak`` fits ``budget``.

    Op costs are tilted by up to ``_TILT`` along the forward order so that identical layers
    (ties) switch one after the other as ``lam`` grows, not all at once.

    Example:
        >>> def peak(kept):
        ...     return simulate(graph, kept).peak_bytes
        >>> plans = mincut_sweep(graph, cands, peak, budget)  # doctest: +SKIP
    """
    ratios = [_own_bytes(g, j) / g.ops[j].cost for j in candidates if g.ops[j].cost > 0]
    ratios = [r for r in ratios if r > 0]
    if not ratios:
        return []
    return _bisect(
        lambda x: mincut_plan(g, candidates, math.exp(x), tilt=_TILT),
        math.log(min(ratios) / 4),
        math.log(max(ratios) * 4),
        lambda k: peak(k) <= budget,
        grows=True,
    )


def _bisect(
    plan_of: Callable[[float], frozenset[int]],
    lo: float,
    hi: float,
    fits: Callable[[frozenset[int]], bool],
    *,
    grows: bool,
    grid: int = 5,
    steps: int = 4,
) -> list[frozenset[int]]:
    """Plans at the cheap edge of the fitting range of a parameter ``x`` in ``[lo, hi]``.

    ``grows``: whether plans keep more as ``x`` grows. See rule 4 of Note [Min-cut and
    segment DP seeds]; if no grid plan fits, every grid plan is returned. At most ``grid +
    steps`` plans are made.
    """
    xs = [lo + (hi - lo) * k / (grid - 1) for k in range(grid)]
    if not grows:
        xs.reverse()  # from keeping least to keeping most
    plans = [plan_of(x) for x in xs]
    ok = [fits(p) for p in plans]
    if not any(ok):
        return list(dict.fromkeys(plans))
    k = max(i for i, f in enumerate(ok) if f)
    if k == grid - 1:
        return [plans[k]]
    good, bad = (xs[k], plans[k]), (xs[k + 1], plans[k + 1])
    for _ in range(steps):
        mid = (good[0] + bad[0]) / 2
        plan = plan_of(mid)
        if fits(plan):
            good = (mid, plan)
        else:
            bad = (mid, plan)
    return [good[1], bad[1]]


class _Segments:
    """Per-position tables of the segment DP (rule 3 of Note [Min-cut and segment DP seeds])."""

    def __init__(self, g: SimGraph, candidates: Sequence[int]) -> None:
        needed = _needed(g)
        self.cands = sorted(j for j in candidates if any(needed[o] for o in g.ops[j].outputs))
        self.nbytes = [_own_bytes(g, j) for j in self.cands]
        self.cost = [g.ops[j].cost for j in self.cands]
        index = {j: k for k, j in enumerate(self.cands)}
        # anchors[v]: candidates that must be kept for value v to be available (views lead
        # to their base's producer).
        anchors: list[frozenset[int]] = []
        for v, val in enumerate(g.values):
            if _free(g, v) or val.producer < 0:
                anchors.append(frozenset())
            elif val.producer in index:
                anchors.append(frozenset((index[val.producer],)))
            else:
                anchors.append(frozenset().union(*(anchors[i] for i in g.ops[val.producer].inputs)))
        last = [-1] * len(self.cands)  # last position (op or saved step) needing each candidate
        for j, op in enumerate(g.ops):
            for i in op.inputs:
                for k in anchors[i]:
                    last[k] = max(last[k], j)
        for step, v in g.saved:
            for k in anchors[v]:
                last[k] = max(last[k], step)
        self.n = len(g.ops)
        self.last = last
        # crossing[i]: candidates produced at or before op i and needed after it.
        self.crossing: list[list[int]] = [[] for _ in range(self.n)]
        for k, j in enumerate(self.cands):
            for i in range(j, last[k]):
                self.crossing[i].append(k)
        self.pos = [bisect.bisect_right(self.cands, i) for i in range(self.n)]


def segment_dp(tables: _Segments, mu: float, transient: float) -> tuple[frozenset[int], int]:
    """Kept ops of the best cut sequence for ``mu`` and ``transient`` and their kept bytes.

    Example:
        >>> tables = _Segments(graph, candidate_ops(graph))  # doctest: +SKIP
        >>> segment_dp(tables, mu=1e-3, transient=2**20)  # doctest: +SKIP
    """
    t = tables
    inner = [mu * b < c for b, c in zip(t.nbytes, t.cost, strict=True)]
    # prefix sums over candidates in forward order: Lagrangian cost and transient bytes
    pc = [0.0]
    pt = [0]
    for k, keep in enumerate(inner):
        pc.append(pc[-1] + (mu * t.nbytes[k] if keep else t.cost[k]))
        pt.append(pt[-1] + (0 if keep else t.nbytes[k]))
    best = [_INF] * (t.n + 1)  # best[i + 1]: a cut after op i; best[0]: the region start
    back = [-1] * (t.n + 1)
    best[0] = 0.0
    for i in range(t.n):
        cut_cost = 0.0
        cut_k: list[int] = []  # candidates this cut keeps that the inner rule does not
        cut_b = [0]  # cut_b[m]: bytes of cut_k[:m]
        for k in t.crossing[i]:
            if not inner[k]:
                cut_cost += mu * t.nbytes[k] - t.cost[k]
                cut_k.append(k)
                cut_b.append(cut_b[-1] + t.nbytes[k])
        end = t.pos[i]
        for j in range(i, -2, -1):  # previous cut after op j (-1: region start)
            start = t.pos[j] if j >= 0 else 0
            # transient: needed bytes of the segment that neither rule keeps (monotone in j)
            tr = pt[end] - pt[start] - (cut_b[-1] - cut_b[bisect.bisect_left(cut_k, start)])
            if tr > transient:
                break
            prev = best[j + 1]
            if prev == _INF:
                continue
            total = prev + pc[end] - pc[start] + cut_cost
            if total < best[i + 1]:
                best[i + 1], back[i + 1] = total, j
    if best[t.n] == _INF:
        return frozenset(), 0
    kept = {k for k, keep in enumerate(inner) if keep}
    i = t.n - 1
    while i >= 0:
        kept.update(t.crossing[i])
        i = back[i + 1]
    return frozenset(t.cands[k] for k in kept), sum(t.nbytes[k] for k in kept)


def segment_dp_sweep(
    g: SimGraph,
    candidates: Sequence[int],
    peak: Callable[[frozenset[int]], int],
    budget: int,
    fractions: Sequence[float] = (0.15, 0.35),
) -> list[frozenset[int]]:
    """Segment-DP plans for transient allowances ``f x budget``, ``mu`` bisected on ``peak``.

    Example:
        >>> def peak(kept):
        ...     return simulate(graph, kept).peak_bytes
        >>> plans = segment_dp_sweep(graph, cands, peak, budget)  # doctest: +SKIP
    """
    tables = _Segments(g, candidates)
    ratios = [c / b for b, c in zip(tables.nbytes, tables.cost, strict=True) if b > 0 and c > 0]
    if not ratios:
        return []
    plans: list[frozenset[int]] = []
    for f in fractions:

        def plan_of(x: float, transient: float = f * budget) -> frozenset[int]:
            return segment_dp(tables, math.exp(x), transient)[0]

        for plan in _bisect(
            plan_of,
            math.log(min(ratios) / 4),
            math.log(max(ratios) * 4),
            lambda k: peak(k) <= budget,
            grows=False,
        ):
            if plan not in plans:
                plans.append(plan)
    return plans


def brute_force(g: SimGraph, candidates: Sequence[int], budget: int) -> Solution | None:
    """The cheapest plan that fits, by enumerating every subset (tests only: 2^n runs)."""
    best: Solution | None = None
    n = len(candidates)
    for mask in range(1 << n):
        kept = [candidates[i] for i in range(n) if mask >> i & 1]
        r = simulate(g, kept)
        if r.peak_bytes > budget:
            continue
        if best is None or r.recompute_cost < best.result.recompute_cost:
            best = Solution(frozenset(kept), r, True)
    return best
