"""An exact MILP for the memory-budget problem on small graphs (Checkmate-style, HiGHS).

# Note [Exact MILP of the backward liveness model]
# Checkmate (Jain et al. 2020) writes rematerialization as an integer program over stages x
# values: R[t, i] "computed in stage t", S[t, i] "resident", memory per stage bounded. Here
# the schedule is not free: the engine's realize order and use counts decide it (Note
# [Backward liveness model]); only the kept set is chosen. The MILP below encodes that
# model exactly on graphs where it can be linearised (:func:`exact_for`):
#   every op has one output, no views, no fixed values, no transient (pointwise) ops, no
#   gradient or workspace memory, an unbounded recompute cache (rule 8's segments drop and
#   run values again: not modelled), and every op's backward step saves all of its inputs
#   (and possibly its own output), nothing else.
# On such graphs memory only grows inside a backward step (a value's last use is an unpack
# at the step of its first consumer, where it is held until the step ends) and every value
# v is freed at the end of step m(v), the lowest step saving it; its peak is the maximum
# over steps of what is alive at the step's end. Variables (stages are backward steps s):
#   x[v]     binary, v kept (its op is a candidate);
#   C[s, v]  binary, v's op runs during step s (recompute);
#   D[s, v]  in [0, 1], v is demanded during step s: saved at s (constant 1), or an input of
#            an op that runs during s: D[s, v] >= C[s, u] for every consumer u;
#   A[s, v]  in [0, 1], v alive at the end of step s.
# Constraints: C[s, v] >= D[s, v] - x[v] - sum_{s' > s} C[s', v] (a demanded value not kept
# and not yet recomputed runs now; the simulator runs each op at most once per pass);
# A[s, v] >= x[v] and A[s, v] >= sum_{s' >= s} C[s', v] for s >= m(v); and
# sum_v bytes(v) A[s, v] <= budget for every step. Objective: sum cost(v) C[s, v].
# Minimising pushes C, D and A down to the simulator's values, so the optimum is the
# simulator's optimum (tests/planner/test_milp.py checks it against enumeration). On other graphs
# the MILP's plan is only a candidate: ``solve`` judges it with the simulator like any
# seed. Size: about 3 x steps x values variables; HiGHS solves 30-op graphs in well under a
# second, and ``time_limit`` bounds it (the best plan found so far is returned).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_graph.planner.liveness import SimGraph

__all__ = ["MilpResult", "exact_for", "milp_plan"]


@dataclass(frozen=True)
class MilpResult:
    """The MILP's plan: kept candidate ops, its objective, whether HiGHS proved it optimal."""

    kept_ops: frozenset[int]
    cost: float
    optimal: bool
    seconds: float


def exact_for(g: SimGraph) -> bool:
    """Whether the MILP is exact for ``g``. See Note [Exact MILP of the backward liveness model].

    Example:
        >>> exact_for(graph)  # doctest: +SKIP
        True
    """
    if g.cache_limit != "unbounded" or g.fixed or any(g.step_grad_bytes.values()):
        return False
    for v, val in enumerate(g.values):
        if val.storage != v or val.is_view:
            return False
    by_step: dict[int, set[int]] = {}
    for s, v in g.saved:
        by_step.setdefault(s, set()).add(v)
    for j, op in enumerate(g.ops):
        if len(op.outputs) != 1 or op.pointwise or op.workspace or op.run_workspace:
            return False
        if not set(op.inputs) <= by_step.get(j, set()) <= set(op.inputs) | set(op.outputs):
            return False
    return True


def milp_plan(
    g: SimGraph,
    candidates: Sequence[int],
    budget: int,
    *,
    time_limit: float = 1.0,
    node_limit: int | None = None,
) -> MilpResult | None:
    """The kept ops minimising recompute cost within ``budget``, by ``scipy.optimize.milp``.

    Exact when :func:`exact_for` holds; otherwise a plan to be checked by the simulator.
    Returns ``None`` when HiGHS finds no feasible plan within its limits: ``time_limit``
    seconds of wall time and, if given, ``node_limit`` branch-and-bound nodes (a limit that,
    unlike the time, does not depend on the machine's load).

    Example:
        >>> r = milp_plan(graph, candidate_ops(graph), budget=4096)  # doctest: +SKIP
        >>> r.kept_ops, r.optimal  # doctest: +SKIP
    """
    import numpy as np  # late: scipy and numpy load only when a plan is solved
    from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
    from scipy.sparse import csr_array  # type: ignore[import-untyped]

    t0 = time.perf_counter()
    values, ops = g.values, g.ops
    n = len(ops)
    cands = set(candidates)
    saved_at: dict[int, set[int]] = {}
    for s, v in g.saved:
        saved_at.setdefault(v, set()).add(s)
    consumers: dict[int, list[int]] = {}
    for j, op in enumerate(ops):
        for i in op.inputs:
            consumers.setdefault(i, []).append(j)
    # values the plan is about: op outputs that some step saves (others are never needed)
    vals = [v for v in range(len(values)) if values[v].producer >= 0 and v in saved_at]
    low = {v: min(saved_at[v]) for v in vals}  # m(v)
    steps = {v: range(low[v], n) for v in vals}
    col: dict[tuple[str, int, int], int] = {}

    def var(kind: str, s: int, v: int) -> int:
        key = (kind, s, v)
        k = col.get(key)
        if k is None:
            k = col[key] = len(col)
        return k

    for v in vals:
        if values[v].producer in cands:
            var("x", 0, v)
        for s in steps[v]:
            var("C", s, v)
            var("D", s, v)
            var("A", s, v)
    rows: list[tuple[dict[int, float], float, float]] = []  # (coefficients, lower, upper)
    inf = np.inf
    for v in vals:
        x = col.get(("x", 0, v))
        producer_inputs = [i for i in ops[values[v].producer].inputs if i in low]
        for s in steps[v]:
            c, d, a = col["C", s, v], col["D", s, v], col["A", s, v]
            if s in saved_at[v]:
                rows.append(({d: 1.0}, 1.0, inf))
            # C[s,v] + x[v] + sum_{s'>s} C[s',v] - D[s,v] >= 0
            coef = {c: 1.0, d: -1.0}
            if x is not None:
                coef[x] = 1.0
            for s2 in range(s + 1, n):
                coef[col["C", s2, v]] = 1.0
            rows.append((coef, 0.0, inf))
            # inputs of a run op are demanded in the same step
            for i in producer_inputs:
                if s >= low[i]:
                    rows.append(({col["D", s, i]: 1.0, c: -1.0}, 0.0, inf))
                else:  # the input would be gone: the op cannot run then
                    rows.append(({c: 1.0}, -inf, 0.0))
            if x is not None:
                rows.append(({a: 1.0, x: -1.0}, 0.0, inf))
            coef = {a: 1.0}
            for s2 in range(s, n):
                coef[col["C", s2, v]] = -1.0
            rows.append((coef, 0.0, inf))
    for s in range(n):
        coef = {col["A", s, v]: float(values[v].nbytes) for v in vals if s >= low[v]}
        if coef:
            rows.append((coef, -inf, float(budget)))
    nvar = len(col)
    if nvar == 0:  # nothing saved is made by an op: keeping nothing is the only plan
        return MilpResult(frozenset(), 0.0, True, time.perf_counter() - t0)
    cost = np.zeros(nvar)
    integrality = np.zeros(nvar)
    upper = np.ones(nvar)
    for (kind, _s, v), k in col.items():
        if kind == "C":
            cost[k] = ops[values[v].producer].cost
            integrality[k] = 1
        elif kind == "x":
            integrality[k] = 1
    data, ri, ci = [], [], []
    lb, ub = [], []
    for r, (coef, lo, hi) in enumerate(rows):
        for k, a_ in coef.items():
            ri.append(r)
            ci.append(k)
            data.append(a_)
        lb.append(lo)
        ub.append(hi)
    matrix = csr_array((data, (ri, ci)), shape=(len(rows), nvar))
    res = milp(
        cost,
        constraints=LinearConstraint(matrix, lb, ub),
        integrality=integrality,
        bounds=Bounds(np.zeros(nvar), upper),
        options={
            "time_limit": time_limit,
            "disp": False,
            **({} if node_limit is None else {"node_limit": node_limit}),
        },
    )
    if res.x is None:
        return None
    kept = frozenset(
        values[v].producer for v in vals if ("x", 0, v) in col and res.x[col["x", 0, v]] > 0.5
    )
    return MilpResult(kept, float(res.fun), res.status == 0, time.perf_counter() - t0)
