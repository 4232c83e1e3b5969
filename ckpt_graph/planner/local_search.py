"""Local search on plans, verified by the simulator: greedy descent, repair, improvement.

The moves of steps 2 and 6 of Note [Memory budget planning] (in ``solve``), with an
evaluation limit and a simulation cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

from ckpt_graph.planner.liveness import SimGraph, SimResult, simulate

__all__ = ["SIM_GUIDED", "Refinement", "Search"]

# Up to this many kept ops, repairs pick each drop by simulating every choice.
SIM_GUIDED = 48
# Up to this many candidates, local search also tries keeping two dropped ops at once.
_PAIRS = 24
# Repairs simulate at most this many drops per step (the cheapest per byte).
_TRY = 8


def _run_cost(g: SimGraph, kept: Sequence[bool]) -> int:
    """Recompute cost of a plan given per-value kept flags (the simulator's run sweep)."""
    pass_uses = [0] * len(g.values)
    for _, v in g.saved:
        if not kept[v]:
            pass_uses[v] += 1
    cost = 0
    for j in range(len(g.ops) - 1, -1, -1):
        op = g.ops[j]
        for o in op.outputs:
            if not kept[o] and pass_uses[o] > 0:
                cost += op.cost
                for i in op.inputs:
                    if not kept[i]:
                        pass_uses[i] += 1
                break
    return cost


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
        self, g: SimGraph, budget: int, max_evals: int, *, cache_marginals: bool = False
    ) -> None:
        self.g = g
        self.budget = budget
        self.limit = max_evals
        self.evals = 0
        self.extra = 0
        self._cache: dict[frozenset[int], SimResult] = {}
        # for Refinement's replays; off for solve, whose evaluation counts it would change
        self._marginals: dict[tuple[int, frozenset[int]], float] | None = (
            {} if cache_marginals else None
        )

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
        cost = _run_cost(g, _flags(g, kept - {op})) - _run_cost(g, _flags(g, kept))
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
        while heap and r.peak_bytes > self.budget:
            _, op = heapq.heappop(heap)
            fresh = self.marginal(op, kept)
            if heap and fresh > heap[0][0] + 1e-12:
                heapq.heappush(heap, (fresh, op))
                continue
            kept = kept - {op}
            batch += _own_bytes(g, op)
            if heap and 2 * batch < r.peak_bytes - self.budget:
                continue
            batch = 0
            r = self.sim(kept)
            if r.peak_bytes < lowest.peak_bytes:
                lowest, lowest_kept = r, kept
        if r.peak_bytes > self.budget and batch:
            r = self.sim(kept)  # the heap ran out mid-batch
            if r.peak_bytes < lowest.peak_bytes:
                lowest, lowest_kept = r, kept
        return (r, kept) if r.peak_bytes <= self.budget else (lowest, lowest_kept)

    def repair(self, trial: set[int], added: int) -> tuple[SimResult, set[int]]:
        """Drop kept ops until the plan fits: the cheapest per byte of peak it removes."""
        r = self.sim(trial)
        while r.peak_bytes > self.budget and not self.spent:
            pool = trial - {added}
            if not pool:
                break
            if len(pool) > SIM_GUIDED:
                op = min(pool, key=lambda o: self.marginal(o, trial))
                trial = trial - {op}
                r = self.sim(trial)
                continue
            if len(pool) > _TRY:  # simulate only the cheapest drops per byte
                pool = set(sorted(pool, key=lambda o: self.marginal(o, trial))[:_TRY])
            trials = [(self.sim(trial - {o}), o) for o in sorted(pool)]
            fits = [t for t in trials if t[0].peak_bytes <= self.budget]
            if fits:
                r, op = min(fits, key=lambda t: t[0].recompute_cost)
            else:
                r, op = min(
                    trials,
                    key=lambda t: (
                        (t[0].recompute_cost - r.recompute_cost + 1)
                        / max(r.peak_bytes - t[0].peak_bytes, 1e-3)
                    ),
                )
            trial = trial - {op}
        return r, trial

    def improve(
        self, candidates: Sequence[int], best: SimResult, kept: set[int]
    ) -> tuple[SimResult, set[int]]:
        """Local search from a feasible plan (step 6 of Note [Memory budget planning])."""
        improved = True
        while improved and not self.spent:
            improved = False
            for op in sorted(kept):  # free memory where it costs nothing
                r = self.sim(kept - {op})
                if r.recompute_cost <= best.recompute_cost and r.peak_bytes <= self.budget:
                    kept, best = kept - {op}, r
            dropped = sorted(set(candidates) - kept, key=lambda o: -self.g.ops[o].cost)
            for op in dropped:
                if self.spent:
                    break
                r, trial = self.repair(kept | {op}, op)
                if r.peak_bytes <= self.budget and r.recompute_cost < best.recompute_cost:
                    kept, best, improved = trial, r, True
            if improved or len(candidates) > _PAIRS:
                continue
            dropped = sorted(set(candidates) - kept)
            for a, b in itertools.combinations(dropped, 2):
                if self.spent:
                    break
                r, trial = self.repair(kept | {a, b}, a)
                if r.peak_bytes <= self.budget and r.recompute_cost < best.recompute_cost:
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
