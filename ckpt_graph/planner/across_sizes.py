"""Matching a region to a plan, op by op: cheaply, and across sizes.

# Note [Plans across sizes]
# Variable-length batches change every shape of a step but not its ops. Planning such a
# step from scratch costs tens of planned steps (graph, simulator, solver), so a plan is
# applied across sizes:
# 1. Matching. Op by op, a plan matches when the op name, the number of outputs and each
#    output's number of dimensions are the plan's at that position (the *structure*); the
#    sizes themselves are not compared, nor required to map consistently (the ops already
#    fix which value feeds which). Among the plans matching the structure, one whose sizes
#    are also equal so far is preferred (an exact match, as before).
# 2. Fractions. With a fraction, the budget scales with the step's activation bytes, and
#    so does the peak of the same kept set when the sizes scale together (batch, sequence
#    length of pointwise and matmul ops); so the plan is applied as it is, with no warning
#    and no new plan. ``report()`` then gives the plan's byte figures scaled by the ratio of
#    the region's activation bytes (rule 1) to the planned region's (``reuses`` counts it).
#    Terms that grow faster than the rest (attention scores with the sequence length) make
#    this an approximation: tests/planner/test_budget_shapes.py measures it.
# 3. Bytes. With an int budget, a kept set planned at some sizes fits at sizes no larger:
#    every value is no larger, so no simulated peak is. At each position the elements of
#    the outputs so far are compared with the plan's; once they exceed the plan's, the rest
#    of the region is decided by the heuristic and its step planned again (no warning: the
#    graph did not change), for the larger sizes. So a run plans once per new largest size,
#    not once per step, and that plan starts from the old one (Note [Warm start at a new
#    size]).
#
# Note [Warm start at a new size]
# Planning a step at a new largest size from scratch (int budget, rule 3 of Note [Plans
# across sizes]) cost about 20x a planned step (benchmarks/bench_budget_shapes.py: the
# solver's seeds and local search simulate the larger graph hundreds of times). The step
# has the ops of a planned one, only larger, so its plan starts from that one:
# 1. After growing past the plan, the region keeps following the plans' structure op by
#    op (``follow``); a plan that matches to the end becomes its graph's ``warm`` start.
#    (A structure that differs still warns, as rule 3 of Note [Memory budget policy].)
# 2. One region: the plan's kept positions, mapped to the new graph's ops, start
#    ``solve_from``: simulated at the new sizes; if the peak no longer fits (values grew,
#    the budget did not), the greedy descent drops the cheapest kept ops per byte until it
#    does; then local search within ``_WARM_EVALS`` evaluations (the step then costs about
#    2-2.6x a planned step on the benchmark, from 20.8x). The full solver runs only when
#    nothing reachable from the warm start fits.
# 3. Several regions: the menu of a graph with a warm start is the warm plan's graph's menu
#    (plus keeping nothing and keeping every candidate), mapped and simulated once each at
#    the new sizes, with no solver; each entry's figures are exact there. If the DP finds no
#    choice within the budget with such menus, they are rebuilt by the solver as before.
# 4. So the plan meets the budget as a fresh one does (its peak is simulated at the new
#    sizes); it may recompute more than a fresh plan would (measured on the benchmark's
#    GPT: 0-11% more, at 1-3 MiB and sizes up to 2x the planned one).
# 5. Refinement. A warm start's search that stopped at its evaluation limit goes on at the
#    start of each later step (one that needs no new plan) for ``_REFINE_EVALS`` more
#    (``local_search.Refinement``: replayed from its start, earlier evaluations cached),
#    until it ends or the step is planned again; a cheaper plan found replaces the step's
#    plan (the search keeps only plans simulated within the budget). Measured there: it
#    ended after 28-59 steps with plans 0-8% cheaper than a fresh plan, those steps costing
#    1.1-2x a planned step of the smaller size (the larger size's own work included).
# 6. A warm start that cannot fit (the values grew past what its greedy descent can bring
#    under the budget) goes on with the full solver limited to ``_WARM_EVALS`` evaluations
#    (its seeds, hand plans included, then a short search; a plan that fits is refined at
#    later steps as in 5). When nothing fits, the budget is below reach at that size and
#    the seeds alone give the plan with the lowest simulated total peak (step 7 of Note
#    [Memory budget planning]): on tests/planner/test_budget_shapes.py's GPT, about 40
#    simulations for a simulated total peak 5.5% above the unlimited solver's (about 200
#    simulations, 10-20x a planned step, which such a step ran before at every new largest
#    size; its step 6a lowers the peak further: 120 evaluations here would reach its plan,
#    at about 110 simulations a step).
# Known limitations: steps of several regions are not refined (their menus are the smaller
# size's entries, simulated); a plan found by rule 6 when the budget is still within reach
# may cost more than the unlimited solver's until the refinement of rule 5 catches up.
#
# Note [Following a plan]
# A planned step asks the policy about every op, so following a plan must cost little per
# op (it was the largest part of a planned step's forward on small models):
# 1. Per op the policy records the op's signature (name and output shapes), its position
#    and its answer; nothing else while a plan matches.
# 2. Recompute costs are not measured in the forward. When a block's graph is planned, they
#    are computed from its recorded op nodes (``cost_model.recorded_costs``: the FLOP
#    formulas applied to shape-only stand-ins of the op's tensors, bytes from the handles)
#    for the ops the policy answered. Only the heuristic reads ``ctx.flops``, for the op it
#    decides.
# 3. Nothing of the forward's tensors is read for it: the same costs come out whether the
#    graph is planned at the block's exit or later.
# 4. While the first exact plan matches op by op, ``match`` answers from it alone. The other
#    plans (exact, or of the same structure) and the element count of rule 3 of Note [Plans
#    across sizes] are brought up to date (``catch_up``) only when that plan stops
#    matching, or the block exits before its end: the same lists as filtering op by op,
#    computed once. A block that matched it to the end uses it, as filtering would.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph.planner.local_search import Refinement
from ckpt_graph.planner.records import Option, Plan, PlanReport, RegionGraph, Signature, numel
from ckpt_graph.planner.solve import solve, solve_from

if TYPE_CHECKING:
    from ckpt_graph.planner.records import Run

__all__ = ["catch_up", "cheap_start", "follow", "match", "op_shapes", "scaled", "structure"]


def match(run: Run, pos: int, sig: Signature, fraction: bool) -> bool | None:
    """The answer of the plan matching the region so far, or ``None`` (the heuristic
    decides from here). See Note [Plans across sizes] and rule 4 of Note [Following a plan]."""
    if run.exact:
        head = run.exact[0]
        if pos < len(head.signature) and head.signature[pos] == sig:
            return pos in head.kept  # the other plans are filtered when needed (catch_up)
    catch_up(run, pos)
    _filter(run, pos, sig)
    run.lag = pos + 1
    if run.exact:
        return pos in run.exact[0].kept
    if not run.plans:
        return None
    plan = run.plans[0]
    if not fraction and run.elements > plan.elements[pos]:
        run.grown = True  # larger than planned: an int budget needs a new plan
        return None
    return pos in plan.kept


def _filter(run: Run, pos: int, sig: Signature) -> None:
    """Keep the plans that match the region at ``pos``; count its output elements."""
    run.elements += numel(sig[1])
    if run.exact:
        run.exact = [p for p in run.exact if pos < len(p.signature) and p.signature[pos] == sig]
    shape = structure(sig)
    run.plans = [
        p
        for p in run.plans
        if pos < len(p.signature)
        and (p.signature[pos] == sig or structure(p.signature[pos]) == shape)
    ]


def catch_up(run: Run, end: int) -> None:
    """Filter the plans for the positions up to ``end`` that ``match`` answered from its
    first exact plan alone (rule 4 of Note [Following a plan])."""
    for pos in range(run.lag, min(end, len(run.signature))):
        _filter(run, pos, run.signature[pos])
    run.lag = max(run.lag, end)


def scaled(plan: Plan, run: Run, fraction: bool) -> PlanReport:
    """``plan``'s report with its byte figures scaled to the sizes of ``run``."""
    r = plan.report
    ratio = run.saved_bytes / max(r.baseline_bytes, 1)
    return replace(
        r,
        budget_bytes=int(r.budget_bytes * ratio) if fraction else r.budget_bytes,
        baseline_bytes=int(r.baseline_bytes * ratio),
        kept=tuple(replace(k, nbytes=int(k.nbytes * ratio)) for k in r.kept),
        predicted_peak_bytes=int(r.predicted_peak_bytes * ratio),
        predicted_total_peak_bytes=int(r.predicted_total_peak_bytes * ratio),
        predicted_recompute_flops=int(r.predicted_recompute_flops * ratio),
    )


def op_shapes(out: Any) -> tuple[tuple[int, ...], ...]:
    """The shape of each output of an op (``()`` for a non-tensor output)."""
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape),)
    if isinstance(out, (tuple, list)):
        return tuple(tuple(o.shape) if isinstance(o, torch.Tensor) else () for o in out)
    return ()


def structure(sig: Signature) -> tuple[str, tuple[int, ...]]:
    """Op name and the number of dimensions of each output. See Note [Plans across sizes]."""
    return sig[0], tuple(len(s) for s in sig[1])


def follow(run: Run, pos: int, sig: Signature) -> None:
    """Keep the plans whose structure matches the region so far, after it grew past them.

    See Note [Warm start at a new size] rule 1.
    """
    shape = structure(sig)
    run.plans = [
        p for p in run.plans if pos < len(p.signature) and structure(p.signature[pos]) == shape
    ]


def cheap_start(graph: RegionGraph, limit: int, max_evals: int) -> tuple[Refinement | None, Option]:
    """Where a warm start that cannot fit goes on (Note [Warm start at a new size] rule 6).

    Returns:
        The solver's plan within ``max_evals`` evaluations (the warm start's), and a search from it to
        continue at later steps when it fits (else ``None``: it has the lowest simulated
        total peak found, not feasible).
    """
    sol = solve(
        graph.g,
        graph.candidates,
        limit,
        hand=graph.hand,
        below_reach="total",
        max_evals=max_evals,
        total=True,
    )
    option = Option(sol.kept_ops, sol.result, sol.method, sol.feasible)
    if not sol.feasible:
        return None, option
    return solve_from(
        graph.g, graph.candidates, limit, sol.kept_ops, max_evals=0, total=True
    ), option
