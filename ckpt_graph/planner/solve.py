"""The memory-budget solver: which op outputs to keep so backward fits a budget.

# Note [Memory budget planning]
# Problem: given a region's graph (``liveness.SimGraph``), candidate ops and a budget in
# bytes, choose the set K of candidate ops whose outputs are kept so that the simulated
# activation peak of backward (see Note [Backward liveness model]) stays within the budget
# and the recompute cost (summed cost of the ops backward must run) is least. Both sides are
# non-additive: the cost of dropping an op depends on which of its ancestors are kept (chains
# are recomputed from the nearest kept values), and the peak depends on the order autograd
# unpacks and on the intermediates cached in between; exact formulations (Checkmate's ILP)
# are far too slow for a policy that plans at region exit. The solver therefore makes a few
# *starting plans* (seeds), some from exact graph formulations of simplified problems, and
# improves each by local search verified by the simulator, which alone judges feasibility:
#   1. Keep every candidate (no recompute). If that fits, only drop kept ops that cost
#      nothing to recompute (local search, step 6), and stop.
#   2. Seed "greedy": repeatedly drop the kept op with the lowest marginal recompute cost per
#      byte freed (cost from the exact run-set sweep of the simulator, bytes from the storages
#      no other kept value shares); marginal costs only grow as more is dropped, so a lazy
#      priority queue re-evaluates just the head. The simulator checks the peak after each
#      drop (far above the budget: once the dropped bytes reach half the excess); the
#      descent stops at the first plan that fits.
#   3. Seed "simulated" (<= 48 candidates): the same descent, each drop chosen by simulating
#      every choice.
#   4. Seed "min-cut" (networkx): a minimum s-t cut minimises kept bytes + lam x recompute
#      cost exactly (Note [Min-cut and segment DP seeds] rule 2); lam is searched on the
#      simulated peak, giving the plan of the largest lam that fits and the next one.
#   5. Seed "segment DP": a DP over the forward order choosing cut positions whose crossing
#      values are kept, with segments' cached bytes bounded and a Lagrangian knapsack inside
#      segments (Note [Min-cut and segment DP seeds] rule 3), its multiplier searched on the
#      simulated peak. Seeds that do not fit are repaired by the greedy descent of step 2
#      (up to ``_REPAIR_SEEDS`` candidates; above, only the seeds that fit are used).
#   5a. Seed "milp" (graphs of <= ``_MILP_OPS`` ops): the plan of the MILP of Note [Exact
#      MILP of the backward liveness model], solved by HiGHS within ``_MILP_NODES``
#      branch-and-bound nodes; the optimum itself on the graphs where that MILP is exact
#      (when HiGHS proves it within the nodes), a candidate elsewhere. The node limit makes
#      the plan independent of the machine's load; ``_MILP_SECONDS`` of wall time only bounds
#      the planning time (HiGHS's root node is not bounded by nodes). (With a limit of 1 s of
#      wall time, plans of 30-op graphs changed with the load: on the shared 2-core machine
#      the MILP's 0.35 s of CPU took 3.5 s. Measured on bench_milp's random graphs: every
#      MILP of <= 30 ops is proved optimal within 60 nodes, in up to 3.5 s of CPU, 2.3 s of
#      it in the root; at 40 ops some take 15 s, hence 30 ops. Where the root outlasts the
#      wall time, the plan may still depend on the load; there the other seeds reached the
#      same optimum in every case measured, and ties go to them.)
#   5b. Hand seeds (Note [Hand seeds]: keep matmuls, block inputs, every k-th block output)
#      and ``recompute_all`` (keep no candidate), so that no plan a user can write with the
#      library's own policies (checkpoint per block, every k blocks, save matmuls,
#      recompute everything) is left out: each that fits is a candidate answer as is, so the answer never costs more than a
#      fitting hand plan; the cheapest one also starts a local search (step 6, with
#      ``max_evals / 4`` more) when it beats every local optimum found so far (a search
#      from it cost up to 3x the planning time of a 4-layer HF GPT-2 for no gain when it
#      was run always). Unlike the seeds above they are not repaired.
#   6. Local search from the greedy seeds that fit, sharing ``max_evals`` (simulations and
#      marginal-cost sweeps, each O(ops); simulations are cached), then from the cheapest
#      fitting plan of each graph seed with ``max_evals / 4`` more each (so the graph seeds
#      never take evaluations from the greedy search). ``max_evals`` is by default a fixed
#      amount of work, ``search_evals``: 1000 evaluations on graphs of >= 360 ops, more on
#      smaller ones (6,000 at 60 ops), whose evaluations are cheaper. (A fixed 1000 stopped
#      the search on 60-op graphs at +95% above the optimum where 20,000 reach it.) A pass
#      drops kept ops whose recompute costs nothing; then for each dropped op (most
#      expensive first) keeps it again and *repairs*: drops kept ops until the plan fits,
#      each drop the best of the ``_TRY`` cheapest per byte by simulation (large plans: the
#      cheapest per byte), and goes on past the first plan that fits while the descent is
#      cheaper than it (several cheap drops can beat one expensive drop that fits at once).
#      Up to ``EXCHANGE`` candidates a move may also keep ops again: inside the repair, when
#      no drop lowers the peak, the op whose keeping lowers it most cheaply (the peak is not
#      monotone in the kept set: keeping a value ends a recompute chain that backward would
#      otherwise cache at once), and after it (*fill*: each dropped op, most expensive
#      first, that still fits and saves cost). So a move is a chain "keep a, drop b, keep c"
#      that a descent cannot reach: on a 1-layer GPT (40 ops) the optimum at 45% of the
#      activations keeps GELU's output instead of the MLP's first matmul and then both
#      residual adds; without these moves the plan cost +35% (752,384 vs 559,104). (Warm
#      starts, Note [Warm start at a new size], search without chains.) Each pass first
#      *fills*: it simulates keeping each dropped op again (one evaluation each, the first
#      simulation of that op's move anyway) and keeps, in the order of the recompute they
#      save, those that still fit and save cost. Above ``EXCHANGE`` candidates a repair
#      stops once its cost reaches the plan's to beat (drops only add recompute, so such a
#      move cannot win), and ranks its drops by marginal cost once per move rather than at
#      every drop. (Measured on the Megatron anchor, benchmarks/bench_anchor.py at 0.3,
#      300 ops, 128 candidates: without them a repair of one expensive op took 365-426
#      evaluations, most of them marginal costs, the default 1,200 evaluations ran out
#      before the cheap moves, keeping the last layer's softmax and dropout outputs, whose
#      backward runs first, where they are recomputed anyway, and the plan cost 9.65 G
#      units (head size 32) / 7.33 G (64) where 8,000 evaluations found 8.11 / 5.82 G; now
#      7.88 / 5.39 G in the same planning time, what 30,000 evaluations find at head size
#      32.) A move is accepted when it is cheaper. Up to ``_PAIRS`` candidates it also tries keeping two dropped ops
#      at once. The cheapest local optimum wins (ties: the earliest seed above);
#      ``Solution.method`` names it.
#   6a. If no seed and no hand plan fits, the one with the lowest activation peak is changed
#      by ``Search.lower`` (``max_evals / 4``): the best of dropping, keeping or swapping
#      one op, until a plan fits (it then starts step 6 under the seed's name) or no move
#      lowers the peak. Descents only drop, and a swap can lower the peak where no drop
#      does: on the 1-layer GPT at 40% (29,900 B) every seed stayed at or above 40,960 B and
#      the plan fell back to 66,176 B, though plans fit down to 28,928 B.
#   7. If no plan fits (the budget is below what recompute can reach: inputs of every
#      backward step must exist at once), the plan with the lowest simulated *total* peak
#      (activations, gradients and workspaces; ties: fewer kept bytes) among all those tried
#      (seeds, step 6a, hand plans, ``recompute_all``) is returned with ``feasible=False`` and
#      the caller warns (``below_reach="total"``, a single region's plan; the step budget's
#      menus compare regions by activation peak and get the lowest of that).
#      ``recompute_all`` is among them, so the answer's simulated peak is never above it. The total, not
#      the activation peak: a user below reach wants the lowest real peak, and the total is
#      the simulator's estimate of it. (Before, the choice was the lowest activation peak
#      among the seeds only: on the 4-layer GPT of notebook 03 it measured 3.68 MiB where
#      keeping every block input measures 3.41 MiB, above ``torch.utils.checkpoint`` per
#      block's 3.56 MiB.)
#   8. The answer recomputes no more counted FLOPs than the fitting hand plan with the
#      fewest: Note [Counted FLOPs cap].
# What each part contributes (measured, simulator of this commit; details in
# benchmarks/results_budget.md): on random 16-op graphs (tests' generator, 150 graphs x 3
# budgets, <= 18 candidates) the greedy + simulated seeds alone were more than 5% above the
# brute-force optimum in 3 of 450 cases (worst +150%); with every seed none is (every case
# optimal). The 3 fixes come from the segment DP; min-cut seeds never won strictly there.
# On the 12-layer GPT of benchmarks/bench_budget.py (381 ops, 125 candidates) the min-cut
# seed's local optimum was 4.4% cheaper at 20%; at 30-90% the greedy seed's was the cheapest
# (or tied). There the graph seeds add about 1 s of planning (1.0-1.7 s per plan in all on a
# shared 2-core machine, vs 0.2-0.5 s with the greedy seeds only). On a 2000-op elementwise
# chain at 30% only the segment DP found a plan that fits (7 s). On bench_milp's random graphs
# (12-60 ops, 120 cases, benchmarks/results_milp.md) the plans are at the MILP optimum in 115,
# below HiGHS's unproved plan in 2, at most 4.6% above it in 3 (60 ops); with 1000
# evaluations and the moves of step 6 before chains, 109 of 120 on that run's budgets (worst
# +95%), and on a recorded 1-layer GPT the plan missed by 35% or found none (steps 6, 6a).
# ``brute_force`` enumerates every subset (reference for tests on graphs of <= 18 candidates).

# Note [Counted FLOPs cap]
# Two measures of a plan's recompute: the cost model's (Note [Recompute cost model]: a
# roofline estimate of the time, where a batch norm or an activation costs the bytes it
# moves) and the FLOPs ``torch.utils.flop_counter.FlopCounterMode`` counts, which are those
# of matmul-class ops alone (mm, addmm, bmm, convolution, attention: ``counted_flops``). Users
# and benchmarks compare plans by the second, and the two disagree on convolutional nets: at
# the peak of torch's selective checkpointing (keep matmul-class outputs, recompute the rest)
# on transformers' MobileNetV2, the cheapest plan by the cost model recomputed 15 depthwise
# convolutions (0.045 GFLOP counted, 149 M units) to spare batch norms and ReLU6s that
# torch's plan recomputes (0 counted, 219 M units); on EfficientNet one convolution (6.3 M
# counted, 34 M units against 81 M). Neither plan beats the other on both measures, and the
# step times do not settle it: at bench_zoo_time's MobileNetV2 size both are within the
# per-round noise of torch's.
# The rule: among the hand plans that fit (Note [Hand seeds], ``recompute_all`` included),
# take the fewest counted FLOPs, C. An answer over C is replaced by the cheapest plan within
# C among: step 6's plans and the hand plans already within it, and one more local search
# (step 6, ``max_evals / 4`` more) under C as a cap (``Search.cap``: a plan over it does not
# fit; a drop whose recompute runs a counted op is not taken, since drops only add runs).
# That search starts from the answer with the counted ops it recomputes kept again, brought
# back within the budget by the greedy descent of step 2 (drops over the cap excluded), else
# from the cheapest fitting hand plan at C. The answer therefore recomputes no more counted
# FLOPs than any fitting hand plan, and costs no more by the cost model than the cheapest
# hand plan at C: where torch's plan is a hand seed that fits, the answer is no worse than it
# on either measure (on the two models above: 182 M and 38 M units, 0 counted). Where no hand
# plan fits, or the cheapest answer is already within C, nothing changes. Not capped: warm
# starts (Note [Warm start at a new size]), which start from a plan that was, and plans below
# reach (step 7).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from ckpt_graph.planner.liveness import SimGraph, SimResult
from ckpt_graph.planner.local_search import SIM_GUIDED, Refinement, Search
from ckpt_graph.planner.milp import milp_plan
from ckpt_graph.planner.records import Solution
from ckpt_graph.planner.seeds import (
    brute_force,
    candidate_ops,
    mincut_sweep,
    segment_dp_sweep,
)

__all__ = [
    "SEEDS",
    "brute_force",
    "candidate_ops",
    "search_evals",
    "solve",
    "solve_from",
]

#: Starting points of the local search (see Note [Memory budget planning]).
SEEDS = ("greedy", "simulated", "min-cut", "segment DP", "milp")

# The hand plan that keeps no candidate: what ``recompute_all`` decides for the same ops.
_RECOMPUTE_ALL = "recompute_all"
# Seeds whose local searches share ``max_evals`` (step 6 of the Note).
_GREEDY = ("all", "greedy", "simulated")
# Up to this many candidates, graph seeds that do not fit are repaired by greedy descent.
_REPAIR_SEEDS = 400
# Up to this many ops, the exact MILP (Note [Exact MILP of the backward liveness model]) is a
# seed, given _MILP_NODES branch-and-bound nodes and, as a bound on the planning time only,
# _MILP_SECONDS of wall time (see step 5a of the Note).
_MILP_OPS = 30
_MILP_NODES = 100
_MILP_SECONDS = 5.0
# The local search's evaluations: _SEARCH_WORK op visits, at least _MIN_EVALS (search_evals).
_MIN_EVALS = 1000
_SEARCH_WORK = 360_000


class Candidate(NamedTuple):
    """A plan the solver considers: where it came from, its simulated backward, its kept ops.

    ``method`` names the seed (:data:`SEEDS`), ``"all"`` or ``"hand: <name>"``.
    """

    method: str
    result: SimResult
    kept: frozenset[int]


def solve(
    g: SimGraph,
    candidates: Sequence[int],
    budget: int,
    *,
    max_evals: int | None = None,
    seeds: Sequence[str] = SEEDS,
    hand: Mapping[str, Iterable[int]] | None = None,
    milp_seconds: float = _MILP_SECONDS,
    below_reach: str = "activations",
    total: bool = False,
) -> Solution:
    """Plan the kept ops among ``candidates``. See Note [Memory budget planning].

    Args:
        g: the region's graph.
        candidates: ops the plan may keep (see :func:`candidate_ops`).
        budget: bytes the simulated activation peak of backward may reach.
        max_evals: simulations and marginal-cost sweeps the local search may spend;
            ``None``: :func:`search_evals` (step 6 of the Note).
        seeds: starting points to try, among :data:`SEEDS`.
        hand: hand plans by name (see Note [Hand seeds]): the answer costs at most as much
            as each of them that fits (their method is ``"hand: <name>"``).
        milp_seconds: wall-time limit of the "milp" seed (graphs of at most ``_MILP_OPS``
            ops), a bound on the planning time; its deterministic limit is ``_MILP_NODES``.
        below_reach: when no plan fits, return the one with the lowest simulated
            ``"activations"`` peak (what the step budget's menus compare) or ``"total"`` peak
            (a single region's plan; step 7 of the Note).
        total: the budget bounds the simulated total peak (activations, gradient buffers
            and workspaces: ``SimResult.peak_total_bytes``), as for a step of one region
            (Note [Memory budget policy] rule 1), instead of the activation peak.

    Example:
        >>> sol = solve(graph, candidate_ops(graph), budget=graph.saved_bytes() // 2)  # doctest: +SKIP
        >>> sol.feasible, sol.result.recompute_cost, sol.method  # doctest: +SKIP
    """
    if max_evals is None:
        max_evals = search_evals(g)
    search = Search(g, budget, max_evals, total=total)
    kept = frozenset(candidates)
    first = search.sim(kept)
    hand_fit: list[Candidate] = []
    hand_all: list[Candidate] = []
    if search.peak(first) <= budget:
        starts = [Candidate("all", first, kept)]
    else:
        starts = _starts(search, candidates, seeds, milp_seconds)
        spent = search.evals
        # the hand plans (Note [Hand seeds]) and keeping nothing: every plan a user would
        # write is a candidate answer, judged by the same simulator (step 5b)
        by_hand = {**(hand or {}), _RECOMPUTE_ALL: frozenset[int]()}
        hand_all = [
            Candidate(f"hand: {name}", search.sim(frozenset(plan) & kept), frozenset(plan) & kept)
            for name, plan in by_hand.items()
        ]
        hand_fit = [c for c in hand_all if search.peak(c.result) <= budget]
        search.extra += search.evals - spent  # not taken from the greedy search
    tried = starts + hand_all
    if tried and not hand_fit and all(search.peak(c.result) > budget for c in tried):
        # step 6a: lower the lowest plan by drops, keeps and swaps (not from greedy's share)
        low = min(tried, key=lambda c: (search.peak(c.result), c.result.recompute_cost))
        spent = search.evals
        search.limit = search.evals + max_evals // 4
        starts.append(_candidate(low.method, search.lower(candidates, set(low.kept))))
        search.extra += search.evals - spent
    fitting: dict[frozenset[int], Candidate] = {}
    for c in starts:
        if search.peak(c.result) <= budget:
            fitting.setdefault(c.kept, c)
    if not fitting and not hand_fit:  # step 7: the lowest peak of every plan tried
        tried = starts + hand_all
        if below_reach == "total":
            low = min(tried, key=lambda c: (c.result.peak_total_bytes, c.result.kept_bytes))
        else:
            low = min(tried, key=lambda c: (c.result.peak_bytes, c.result.recompute_cost))
        return Solution(low.kept, low.result, False, low.method)
    # The greedy seeds share max_evals (the first may spend it all); then the cheapest start
    # of each graph seed gets a quarter of it on top, so graph seeds never take evaluations
    # from the greedy search.
    greedy = [c for c in fitting.values() if c.method in _GREEDY]
    graph: dict[str, Candidate] = {}
    for c in sorted(fitting.values(), key=lambda c: c.result.recompute_cost):
        if c.method not in _GREEDY:
            graph.setdefault(c.method, c)
    plans: list[Candidate] = []
    search.limit = max_evals + search.extra
    for c in greedy:
        plans.append(_candidate(c.method, search.improve(candidates, c.result, set(c.kept))))
    for c in graph.values():
        search.limit = search.evals + max_evals // 4
        plans.append(_candidate(c.method, search.improve(candidates, c.result, set(c.kept))))
    if hand_fit:  # each fitting hand plan as is, then a search from the cheapest if it wins
        cheapest = min(hand_fit, key=lambda c: c.result.recompute_cost)
        if not plans or cheapest.result.recompute_cost < min(
            p.result.recompute_cost for p in plans
        ):
            search.limit = search.evals + max_evals // 4
            found = search.improve(candidates, cheapest.result, set(cheapest.kept))
            plans.append(_candidate(cheapest.method, found))
        plans += hand_fit
    # ties go to the earliest method of SEEDS, then hand plans: a seed "wins" only when
    # strictly cheaper
    order = {m: i for i, m in enumerate(("all", *SEEDS))}

    def least(pool: list[Candidate]) -> Candidate:
        return min(pool, key=lambda c: (c.result.recompute_cost, order.get(c.method, len(order))))

    best = least(plans)
    if hand_fit:  # step 8: See Note [Counted FLOPs cap].
        cap = min(search.counted(c.result) for c in hand_fit)
        if search.counted(best.result) > cap:
            search.cap = cap
            # the answer with the counted ops it recomputes kept again, descended to fit;
            # else the cheapest fitting hand plan at the cap
            counted = search.counted_ops()
            ran = {j for j in candidates if counted[j] and best.result.runs[j]}
            start = _candidate(best.method, search.descend(set(best.kept) | ran))
            if not search.fits(start.result):
                start = least([c for c in hand_fit if search.counted(c.result) == cap])
            search.limit = search.evals + max_evals // 4
            found = search.improve(candidates, start.result, set(start.kept))
            plans.append(_candidate(start.method, found))
            search.cap = None
            best = least([c for c in plans if search.counted(c.result) <= cap])
    return Solution(best.kept, best.result, True, best.method)


def search_evals(g: SimGraph) -> int:
    """Evaluations of the local search on ``g``: a fixed amount of work, not of moves.

    An evaluation walks the graph once (O(ops)), so ``_SEARCH_WORK`` op visits are 1000
    evaluations on graphs of 360 ops and more (the 381-op GPT of bench_budget plans as
    before) and more evaluations on smaller graphs. See Note [Memory budget planning] step 6.

    Example:
        >>> search_evals(graph_of_60_ops)  # doctest: +SKIP
        6000
    """
    return max(_MIN_EVALS, _SEARCH_WORK // max(len(g.ops), 1))


def solve_from(
    g: SimGraph,
    candidates: Sequence[int],
    budget: int,
    start: Iterable[int],
    *,
    max_evals: int,
    total: bool = False,
) -> Refinement | None:
    """Plan from ``start``, a plan of the same ops at other sizes; ``None`` if none fits.

    The warm start of Note [Warm start at a new size]: no seeds, only the greedy descent
    of step 2 of Note [Memory budget planning] from ``start`` (when it does not fit) and the
    local search of step 6 within ``max_evals`` evaluations in all (its first pass, which
    tries dropping each kept op once, always runs). The search can be continued later with
    ``Refinement.run``.

    Args:
        g: the region's graph.
        candidates: ops the plan may keep.
        budget: bytes the simulated activation peak of backward may reach.
        start: kept ops to start from (those not in ``candidates`` are ignored).
        max_evals: simulations and marginal-cost sweeps the search may spend.
        total: the budget bounds the total peak (see :func:`solve`).

    Example:
        >>> ref = solve_from(graph, candidates, budget, old_kept, max_evals=40)  # doctest: +SKIP
        >>> ref is None or ref.result.peak_bytes <= budget  # doctest: +SKIP
        True
    """
    search = Search(g, budget, max_evals, cache_marginals=True, chains=False, total=total)
    kept = set(start) & set(candidates)
    r = search.sim(kept)
    if search.peak(r) > budget:
        r, kept = search.descend(kept)
        if search.peak(r) > budget:
            return None
    ref = Refinement(search, candidates, r, kept)
    ref.run(max(max_evals - search.evals, 0))
    return ref


def _starts(
    search: Search, candidates: Sequence[int], seeds: Sequence[str], milp_seconds: float
) -> list[Candidate]:
    """Starting plans of the local search, each repaired to fit when it can be."""
    g, budget = search.g, search.budget
    kept = set(candidates)
    starts: list[Candidate] = []
    if "greedy" in seeds:
        starts.append(_candidate("greedy", search.descend(kept)))
    if "simulated" in seeds and len(kept) <= SIM_GUIDED:
        starts.append(_candidate("simulated", search.repair(kept, -1)))
    greedy_evals = search.evals

    def peak(k: frozenset[int]) -> int:
        return search.peak(search.sim(k))

    graph_seeds: list[tuple[str, list[frozenset[int]]]] = []
    if "min-cut" in seeds:
        graph_seeds.append(("min-cut", mincut_sweep(g, candidates, peak, budget)))
    if "segment DP" in seeds:
        graph_seeds.append(("segment DP", segment_dp_sweep(g, candidates, peak, budget)))
    if "milp" in seeds and len(g.ops) <= _MILP_OPS:
        exact = milp_plan(g, candidates, budget, time_limit=milp_seconds, node_limit=_MILP_NODES)
        graph_seeds.append(("milp", [] if exact is None else [exact.kept_ops]))
    for name, plans in graph_seeds:
        for plan in plans:
            r = search.sim(plan)
            if search.peak(r) <= budget:
                starts.append(Candidate(name, r, frozenset(plan)))
            elif len(candidates) <= _REPAIR_SEEDS:  # large graphs: repairs cost O(n) sims
                starts.append(_candidate(name, search.descend(set(plan))))
    search.extra = search.evals - greedy_evals  # spent on graph seeds, not on greedy ones
    return starts


def _candidate(method: str, found: tuple[SimResult, set[int]]) -> Candidate:
    """The record of a plan a search returned as (result, kept ops)."""
    return Candidate(method, found[0], frozenset(found[1]))
