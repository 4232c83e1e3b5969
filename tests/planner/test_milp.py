"""The exact MILP of the memory-budget problem on synthetic graphs (no framework in the loop)."""

from __future__ import annotations

import dataclasses

import pytest
from sim_graphs import milp_graph

from ckpt_graph.planner.liveness import SimGraph, SimValue, simulate
from ckpt_graph.planner.milp import exact_for, milp_plan
from ckpt_graph.planner.solve import brute_force, candidate_ops, search_evals, solve


def budgets(g: SimGraph) -> list[int]:
    cands = candidate_ops(g)
    full = simulate(g, cands).peak_bytes
    none = simulate(g, []).peak_bytes
    lo, hi = min(full, none), max(full, none)
    return [int(lo + f * (hi - lo)) for f in (0.1, 0.3, 0.5, 0.8)]


@pytest.mark.parametrize("seed", range(20))
def test_milp_optimum_equals_enumeration(seed: int) -> None:
    g = milp_graph(seed, 12)
    assert exact_for(g)
    cands = candidate_ops(g)
    for budget in budgets(g):
        best = brute_force(g, cands, budget)
        got = milp_plan(g, cands, budget, time_limit=30.0)
        if best is None:
            assert got is None
            continue
        assert got is not None and got.optimal
        r = simulate(g, got.kept_ops)
        assert r.peak_bytes <= budget
        assert r.recompute_cost == best.result.recompute_cost == round(got.cost)


NO_MILP = ("greedy", "simulated", "min-cut", "segment DP")


def test_solver_gap_to_the_milp_optimum_on_30_op_graphs() -> None:
    # measured on 15 graphs x 4 budgets: the heuristic seeds alone were optimal in 59 of 60
    # cases, 11% above it in one (this graph, 10 vs 9); with the MILP seed: optimal (the
    # MILP takes 0.6 s median, 3 s at most there on the loaded 2-core machine: not timed here)
    g = milp_graph(3, 30)
    cands = candidate_ops(g)
    best = milp_plan(g, cands, 613, time_limit=30.0)
    assert best is not None and best.optimal and round(best.cost) == 9
    heuristic = solve(g, cands, 613, seeds=NO_MILP)
    assert heuristic.feasible and heuristic.result.recompute_cost == 10
    exact = solve(g, cands, 613, milp_seconds=30.0)
    assert exact.feasible and exact.result.recompute_cost == 9 and exact.method == "milp"


@pytest.mark.parametrize("seed", range(6))
def test_solver_reaches_the_milp_optimum_on_small_graphs(seed: int) -> None:
    g = milp_graph(100 + seed, 24)
    cands = candidate_ops(g)
    for budget in budgets(g):
        best = milp_plan(g, cands, budget, time_limit=30.0)
        sol = solve(g, cands, budget, milp_seconds=30.0)
        if best is None:
            assert not sol.feasible
            continue
        assert best.optimal and sol.feasible
        heuristic = solve(g, cands, budget, seeds=NO_MILP)
        assert heuristic.result.recompute_cost >= round(best.cost)  # never below the optimum
        assert sol.result.recompute_cost == round(best.cost)


def test_milp_is_not_exact_for_views_or_partial_saves() -> None:
    g = milp_graph(0, 8)
    assert exact_for(g)
    views = SimGraph(g.values + (SimValue(8, 7, g.ops[7].outputs[0]),), g.ops, g.saved)
    assert not exact_for(views)
    partial = SimGraph(g.values, g.ops, g.saved[1:])
    assert not exact_for(partial)


def test_milp_is_not_exact_with_a_bounded_cache() -> None:
    # The MILP does not model rule 8 of Note [Backward liveness model] (segments of a bounded
    # cache are dropped and run again). Before exact_for checked it, this graph passed: at
    # budget 156 the MILP "proved" 19 while its plan simulates to 20 (the enumerated
    # optimum), and at 126 it found no plan though one costing 71 fits. The optima below are
    # the enumerated ones under the bounded pass with planned cuts (Note [Planned segment
    # cuts]); the solver must reach them whatever the MILP says.
    g = dataclasses.replace(milp_graph(6, 14), cache_limit=8)
    assert exact_for(dataclasses.replace(g, cache_limit="unbounded"))
    assert not exact_for(g)
    cands = candidate_ops(g)
    for budget, optimum in ((126, 121), (156, 19)):
        best = brute_force(g, cands, budget)
        assert best is not None and best.result.recompute_cost == optimum
        sol = solve(g, cands, budget)  # the MILP's plan is only a seed, judged by the simulator
        assert sol.feasible and sol.result.recompute_cost == optimum


def test_search_effort_grows_as_graphs_shrink() -> None:
    # The local search's evaluations are a fixed amount of work (search_evals): with 1000
    # evaluations at any size it stopped here at 337 (+95%); with 20,000 it reached 173.
    g = milp_graph(60004, 60)
    assert search_evals(g) == 360_000 // 60 == 6000
    assert search_evals(milp_graph(0, 360)) == 1000
    cands = candidate_ops(g)
    best = 173  # proved optimal by HiGHS (benchmarks/results_milp.md)
    sol = solve(g, cands, 473)
    assert sol.feasible and sol.result.recompute_cost == best
