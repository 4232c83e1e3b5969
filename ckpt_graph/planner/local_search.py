"""Local search on plans, verified by the simulator: greedy descent, repair, improvement.

The moves of steps 2, 6 and 6a of Note [Memory budget planning] (in ``solve``), with an
evaluation limit and a simulation cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

from ckpt_graph.planner.hand_seeds import counted_flops
from ckpt_graph.planner.liveness import SimGraph, SimResult, count_uses, simulate

__all__ = ["EXCHANGE", "SIM_GUIDED", "Refinement", "Search"]

# Up to this many kept ops, repairs pick each drop by simulating every choice.
SIM_GUIDED = 48
# Up to this many candidates, local search also tries keeping two dropped ops at once.
_PAIRS = 24
# Repairs simulate at most this many drops (keeps) per step (the cheapest per byte).
_TRY = 8
# Up to this many candidates, a move of the local search may also keep dropped ops again:
# inside its repair and after it (fill). See Note [Memory budget planning] step 6.
EXCHANGE = 64
# A repair without a cost to beat (small graphs: its keeps may lower the cost again).
_NO_BOUND = float("inf")


def _ran(g: SimGraph, kept: Sequence[bool]) -> list[bool]:
    """Which ops a plan runs in backward, given per-value kept flags (the simulator's run
    sweep)."""
    uses = [0] * len(g.values)
    for _, v in g.saved:
        if not kept[v]:
            uses[v] += 1
    return [bool(n) for n in count_uses(g.pass_graph, kept, uses)]


def _run_cost(g: SimGraph, kept: Sequence[bool]) -> int:
    """Recompute cost of a plan given per-value kept flags (the simulator's run sweep)."""
    return sum(op.cost for op, ran in zip(g.ops, _ran(g, kept), strict=True) if ran)


def _flags(g: SimGraph, kept_ops: Iterable[int]) -> list[bool]:
    kept = [v.producer < 0 for v in g.values]
    for v in g.fixed:
        kept[v] = True
    for o in kept_ops:
        for v in g.ops[o].outputs:
            kept[v] = True
    return kept


def _own_bytes(g: SimGraph, op: int) -> int:
    return sum(g.values[o].nbytes for o in g.ops[op].outputs if g.values[o].storage == o)


class Search:
    """Simulator-verified moves on plans, with an evaluation limit and a simulation cache."""

    def __init__(
        self,
        g: SimGraph,
        budget: int,
        max_evals: int,
        *,
        cache_marginals: bool = False,
        chains: bool = True,
        total: bool = False,
    ) -> None:
        self.g = g
        # the peak the budget bounds: activations, or with gradients and workspaces (a step
        # of one region; See Note [Memory budget policy] rule 1)
        self.total = total
        # moves as chains (step 6 of Note [Memory budget planning]): repairs go on past the
        # first plan that fits and, up to EXCHANGE candidates, keep ops again. Off for warm
        # starts, whose search runs a few evaluations per training step: there chains
        # tripled the steps to the search's end (35 -> 103 on the 2-layer GPT of
        # tests/planner/test_budget_shapes.py) for the same plan.
        self.chains = chains
        self.budget = budget
        self.limit = max_evals
        self.evals = 0
        self.extra = 0
        self._cache: dict[frozenset[int], SimResult] = {}
        # a bound on the plan's counted FLOPs (None: none); See Note [Counted FLOPs cap].
        self.cap: int | None = None
        self._counted: tuple[int, ...] | None = None
        # for Refinement's replays; off for solve, whose evaluation counts it would change
        self._marginals: dict[tuple[int, frozenset[int]], float] | None = (
            {} if cache_marginals else None
        )

    def peak(self, r: SimResult) -> int:
        """The simulated peak of ``r`` that the budget bounds."""
        return r.peak_total_bytes if self.total else r.peak_bytes

    def counted_ops(self) -> tuple[int, ...]:
        """Counted FLOPs of one run of each op (``hand_seeds.counted_flops``)."""
        if self._counted is None:
            self._counted = counted_flops(self.g)
        return self._counted

    def counted(self, r: SimResult) -> int:
        """FLOPs of ``r``'s recompute as ``FlopCounterMode`` counts them (matmul-class op
        runs). See Note [Counted FLOPs cap]."""
        return sum(c * n for c, n in zip(self.counted_ops(), r.runs, strict=False) if c and n)

    def capped(self, r: SimResult) -> bool:
        """Whether ``r`` is within the counted-FLOPs cap (always, without one)."""
        return self.cap is None or self.counted(r) <= self.cap

    def fits(self, r: SimResult) -> bool:
        """Whether ``r`` is an answer: within the budget and the counted-FLOPs cap."""
        return self.peak(r) <= self.budget and self.capped(r)

    def sim(self, kept: Iterable[int]) -> SimResult:
        key = frozenset(kept)
        r = self._cache.get(key)
        if r is None:
            self.evals += 1
            r = self._cache[key] = simulate(self.g, key)
        return r

    @property
    def spent(self) -> bool:
        return self.evals >= self.limit

    def marginal(self, op: int, kept: set[int]) -> float:
        """Extra recompute cost per byte of dropping ``op`` from ``kept``."""
        g = self.g
        key = (op, frozenset(kept))
        if self._marginals is not None and key in self._marginals:
            return self._marginals[key]
        self.evals += 1
        ran = _ran(g, _flags(g, kept - {op}))
        if self.cap is not None:  # a drop that makes a counted op run: never worth it
            counted = self.counted_ops()
            if sum(c for c, x in zip(counted, ran, strict=True) if x) > self.cap:
                return float("inf")
        after = sum(o.cost for o, x in zip(g.ops, ran, strict=True) if x)
        cost = after - _run_cost(g, _flags(g, kept))
        value = cost / max(_own_bytes(g, op), 1)
        if self._marginals is not None:
            self._marginals[key] = value
        return value

    def descend(self, kept: set[int]) -> tuple[SimResult, set[int]]:
        """Lazy greedy descent (step 2 of Note [Memory budget planning]); far above the
        budget, drops are simulated once their bytes reach half the excess (a kept value
        lowers the peak by at most its bytes)."""
        g = self.g
        heap = [(self.marginal(op, kept), op) for op in kept]
        heapq.heapify(heap)
        r = lowest = self.sim(kept)
        lowest_kept = set(kept)
        batch = 0
        while heap and self.peak(r) > self.budget:
            _, op = heapq.heappop(heap)
            fresh = self.marginal(op, kept)
            if fresh == float("inf"):  # over the counted-FLOPs cap now, and after more drops
                continue
            if heap and fresh > heap[0][0] + 1e-12:
                heapq.heappush(heap, (fresh, op))
                continue
            kept = kept - {op}
            batch += _own_bytes(g, op)
            if heap and 2 * batch < self.peak(r) - self.budget:
                continue
            batch = 0
            r = self.sim(kept)
            if self.peak(r) < self.peak(lowest):
                lowest, lowest_kept = r, kept
        if self.peak(r) > self.budget and batch:
            r = self.sim(kept)  # the heap ran out mid-batch
            if self.peak(r) < self.peak(lowest):
                lowest, lowest_kept = r, kept
        return (r, kept) if self.peak(r) <= self.budget else (lowest, lowest_kept)

    def repair(
        self,
        trial: set[int],
        added: int,
        adds: Iterable[int] = (),
        bound: float = _NO_BOUND,
    ) -> tuple[SimResult, set[int]]:
        """Change kept ops until the plan fits; the cheapest plan that fits on the way.

        Each step drops the kept op that costs least per byte of peak it removes or, when no
        drop lowers the peak, keeps an op of ``adds`` again if that lowers it (keeping a value
        can end a recompute chain whose values backward would otherwise cache at once). Once
        a step could fit, the descent goes on while it stays cheaper than that plan (a 1-for-3
        swap of cheap drops beats one expensive drop that fits at once). Each op changes at
        most once; ``added`` is never dropped. The move stops once its cost reaches
        ``bound`` (the plan to beat). See Note [Memory budget planning] step 6.
        """
        r = self.sim(trial)
        frozen = {added}
        fit: tuple[SimResult, set[int]] | None = None  # the cheapest plan seen that fits
        # without keeps (large graphs), the drops are ranked by marginal cost once per move
        ranked: list[int] | None = None if adds else []
        while not self.fits(r) and not self.spent:
            if fit is not None and r.recompute_cost >= fit[0].recompute_cost:
                break
            if r.recompute_cost >= bound:
                break
            pool = trial - frozen
            if self.cap is not None:  # dropping a counted op makes it run
                pool = {o for o in pool if not self.counted_ops()[o]}
            if not pool:
                break
            if len(pool) > SIM_GUIDED:
                op = min(pool, key=lambda o: self.marginal(o, trial))
                frozen.add(op)
                after = self.sim(trial - {op})
                if self.capped(after):  # else the drop makes a counted op run: not a way on
                    trial, r = trial - {op}, after
                continue
            if len(pool) > _TRY and ranked is not None:  # ranked once per move
                if not ranked:
                    ranked = sorted(pool, key=lambda o: (self.marginal(o, trial), o))
                pool = set([o for o in ranked if o in pool][:_TRY])
            elif len(pool) > _TRY:  # simulate only the cheapest drops per byte
                pool = set(sorted(pool, key=lambda o: self.marginal(o, trial))[:_TRY])
            trials = [(self.sim(trial - {o}), o) for o in sorted(pool)]
            # a drop over the cap stays over it (drops only add runs): not a way on
            trials = [t for t in trials if self.capped(t[0])]
            if all(self.peak(t[0]) >= self.peak(r) for t in trials):
                more = set(adds) - trial - frozen
                if len(more) > _TRY:  # the most recompute saved per byte
                    more = set(sorted(more, key=lambda o: -self.marginal(o, trial | {o}))[:_TRY])
                ups = [(self.sim(trial | {o}), o) for o in sorted(more)]
                trials += [t for t in ups if self.peak(t[0]) < self.peak(r)]
            if not trials:
                break
            fits = [t for t in trials if self.fits(t[0])]
            if fits:
                t = min(fits, key=lambda t: t[0].recompute_cost)
                if fit is None or t[0].recompute_cost < fit[0].recompute_cost:
                    fit = (t[0], trial ^ {t[1]})
                if not self.chains:
                    return fit
            before = r
            r, op = min(
                trials,
                key=lambda t: (
                    (t[0].recompute_cost - before.recompute_cost + 1)
                    / max(self.peak(before) - self.peak(t[0]), 1e-3)
                ),
            )
            trial = trial ^ {op}
            frozen.add(op)
        if fit is not None and (not self.fits(r) or fit[0].recompute_cost < r.recompute_cost):
            return fit
        return r, trial

    def lower(self, candidates: Sequence[int], kept: set[int]) -> tuple[SimResult, set[int]]:
        """Lower the peak of a plan that does not fit (Note [Memory budget planning] step 6a).

        Each step makes the best move of one op dropped, kept again or swapped for another:
        the cheapest that fits (and stop), else the lowest peak; it stops when no move lowers
        the peak. Above ``_TRY`` kept (dropped) ops, only the ``_TRY`` cheapest per byte
        (saving most per byte) are tried.
        """
        r = self.sim(kept)
        cands = set(candidates)
        while self.peak(r) > self.budget and not self.spent:
            drops, adds = sorted(kept), sorted(cands - kept)
            if len(drops) > _TRY:
                drops = sorted(drops, key=lambda o: self.marginal(o, kept))[:_TRY]
            if len(adds) > _TRY:
                adds = sorted(adds, key=lambda o: -self.marginal(o, kept | {o}))[:_TRY]
            moves = [kept - {o} for o in drops] + [kept | {o} for o in adds]
            moves += [(kept - {a}) | {b} for a in drops for b in adds]
            tried: list[tuple[SimResult, set[int]]] = []
            for m in moves:
                if self.spent:
                    break
                tried.append((self.sim(m), m))
            fits = [t for t in tried if self.peak(t[0]) <= self.budget]
            if fits:
                return min(fits, key=lambda t: t[0].recompute_cost)
            low = min(tried, key=lambda t: (self.peak(t[0]), t[0].recompute_cost), default=None)
            if low is None or self.peak(low[0]) >= self.peak(r):
                break
            r, kept = low
        return r, kept

    def fill(
        self, candidates: Sequence[int], r: SimResult, kept: set[int]
    ) -> tuple[SimResult, set[int]]:
        """Keep dropped ops again, in the order of ``candidates``, each that keeps the plan
        within the budget and makes it cheaper."""
        for op in [o for o in candidates if o not in kept]:
            if self.spent:
                break
            t = self.sim(kept | {op})
            if self.fits(t) and t.recompute_cost < r.recompute_cost:
                r, kept = t, kept | {op}
        return r, kept

    def _by_saving(self, dropped: set[int], kept: set[int]) -> list[int]:
        """``dropped`` ordered by the recompute their keeping saves, most first (ties: the
        op's own cost); each keep is simulated once (the first simulation of its move)."""
        saving: dict[int, int] = {}
        for op in dropped:
            if self.spent:
                break
            saving[op] = self.sim(kept | {op}).recompute_cost
        return sorted(dropped, key=lambda o: (saving.get(o, 1 << 62), -self.g.ops[o].cost, o))

    def improve(
        self, candidates: Sequence[int], best: SimResult, kept: set[int]
    ) -> tuple[SimResult, set[int]]:
        """Local search from a feasible plan (step 6 of Note [Memory budget planning])."""
        improved = True
        while improved and not self.spent:
            improved = False
            for op in sorted(kept):  # free memory where it costs nothing
                r = self.sim(kept - {op})
                if r.recompute_cost <= best.recompute_cost and self.fits(r):
                    kept, best = kept - {op}, r
            r, trial = self.fill(self._by_saving(set(candidates) - kept, kept), best, kept)
            if r.recompute_cost < best.recompute_cost:  # keeps that fit as they are
                kept, best, improved = trial, r, True
            dropped = sorted(set(candidates) - kept, key=lambda o: -self.g.ops[o].cost)
            exchange = self.chains and len(candidates) <= EXCHANGE
            for op in dropped:
                if self.spent:
                    break
                if op in kept:
                    continue
                r, trial = self.repair(
                    kept | {op},
                    op,
                    candidates if exchange else (),
                    _NO_BOUND if exchange else best.recompute_cost,
                )
                if self.fits(r) and exchange:
                    order = sorted(candidates, key=lambda o: -self.g.ops[o].cost)
                    r, trial = self.fill(order, r, trial)
                if self.fits(r) and r.recompute_cost < best.recompute_cost:
                    kept, best, improved = trial, r, True
            if improved or len(candidates) > _PAIRS:
                continue
            dropped = sorted(set(candidates) - kept)
            for a, b in itertools.combinations(dropped, 2):
                if self.spent:
                    break
                r, trial = self.repair(kept | {a, b}, a)
                if self.fits(r) and r.recompute_cost < best.recompute_cost:
                    kept, best, improved = trial, r, True
                    break
        return best, kept


class Refinement:
    """The local search of ``Search.improve`` from a plan that fits, a few evaluations at a time.

    Each :meth:`run` replays the search from the same start with a higher evaluation limit:
    what earlier runs evaluated is cached (simulations and marginal costs, free to look up
    again), so a run spends its evaluations on new moves only, and the search ends with the
    plan one uninterrupted search would reach. See Note [Warm start at a new size] rule 5.

    Attributes:
        kept: the kept ops of the best plan found so far.
        result: its simulated backward (within the search's budget).
        done: whether the search ended (no further run can improve the plan).

    Example:
        >>> ref = Refinement(Search(g, budget, 0, cache_marginals=True), cands, r, kept)  # doctest: +SKIP
        >>> while not ref.done:  # doctest: +SKIP
        ...     ref.run(10)
    """

    def __init__(
        self, search: Search, candidates: Sequence[int], result: SimResult, kept: Iterable[int]
    ) -> None:
        self._search = search
        self._candidates = list(candidates)
        self._start = (result, frozenset(kept))
        self.kept = self._start[1]
        self.result = result
        self.done = False

    def run(self, evals: int) -> bool:
        """Spend up to ``evals`` more evaluations; whether the best plan became cheaper."""
        search = self._search
        search.limit = search.evals + evals
        start, start_kept = self._start
        best, kept = search.improve(self._candidates, start, set(start_kept))
        self.done = not search.spent
        if best.recompute_cost < self.result.recompute_cost:
            self.result, self.kept = best, frozenset(kept)
            return True
        return False
