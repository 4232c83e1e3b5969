"""Distance to the optimum: the solver's plans against the exact MILP (HiGHS) on small graphs.

Issue 13: an exact formulation of the plan (``ckpt_graph.planner.milp``, a MILP with the
simulator's cost and liveness rules, as Checkmate does with an ILP) solved on graphs small
enough, reported next to the solver's plan. The MILP is exact only where
``milp.exact_for(g)`` holds (Note [Exact MILP of the backward liveness model]: one output per
op, no views, no pointwise ops, every backward step saves its op's inputs, no gradient or
workspace memory, an unbounded recompute cache); elsewhere its plan is only a candidate.

Per case:

- *solver*: ``planner.solve.solve`` as ``memory_budget`` calls it (default seeds; a recorded
  region's hand plans; its default search effort, ``search_evals``). On graphs of at most
  30 ops its seeds include the MILP itself, limited to 100 branch-and-bound nodes (and 5 s
  of wall time), so it reaches the optimum whenever HiGHS proves it within them;
- *heuristics*: ``solve`` without the MILP seed (greedy, simulated, min-cut, segment DP):
  the heuristics' own distance, and the solver's on graphs above 30 ops;
- *optimum*: ``milp_plan`` with ``--time-limit`` seconds (*proved*: HiGHS proved it optimal;
  else it is the best plan found and the gap is to that plan), or enumeration of every plan.
  Checks: the MILP's plan must simulate to its objective within the budget, enumeration
  (graphs of at most ``--enumerate`` candidates) must agree with the MILP, and no plan may
  cost less than a proved optimum;
- gap = cost / optimum - 1; times are process CPU seconds (the machine is shared).

Budgets: at ``--fractions`` of the way from the lowest activation peak of any plan (by
enumeration when small, else the lowest the heuristics find) to the highest of keeping all
or nothing. (The tests' range, keep-all to keep-nothing, is empty on real regions: keeping
nothing caches every recomputed value until its step, as high a peak as keeping all.)

Graphs: (a) seeded random DAGs of the MILP's exact class, the tests' generator
(``milp_graph`` of ``tests/planner/sim_graphs.py``), several sizes (60 ops: above the solver's
MILP seed, so the solver is its heuristics there); (b) small real regions
recorded under ``memory_budget`` (the planner's own graph, candidates and hand plans, from
``region_graph``), reported with why the MILP is not exact for them. Where only gradient
buffers stand in the way (they count in the total peak, not in the activation peak the
budget bounds: Note [Backward liveness model] rule 4), the MILP is solved on the graph
without them once enumeration has shown that every plan has the same peak and cost there;
other small regions get the optimum by enumeration.

Prints a markdown section on stdout, progress on stderr; ``--out`` also writes it to a file.

Run: ``python benchmarks/bench_milp.py [--sizes 12 20 30 40 60] [--seeds 6] [--out FILE]``
(about 6 min on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import scipy
import torch

import ckpt_graph as cg
from ckpt_graph.compare.zoo import build_workload
from ckpt_graph.planner.budget_planner import BudgetPlanner
from ckpt_graph.planner.liveness import SimGraph, simulate
from ckpt_graph.planner.milp import exact_for, milp_plan
from ckpt_graph.planner.solve import SEEDS, candidate_ops, solve

# The solver tests' random graphs (tests/planner/sim_graphs.py): one generator for both.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "planner"))
from sim_graphs import milp_graph

HEURISTICS = tuple(s for s in SEEDS if s != "milp")


# --------------------------------------------------------------------------- graphs


Plans = list[tuple[int, int]]  # (activation peak, recompute cost) of every plan


def every_plan(g: SimGraph, cands: Sequence[int]) -> Plans:
    """The simulated peak and cost of each of the 2^n plans (enumeration)."""
    out = []
    for mask in range(1 << len(cands)):
        r = simulate(g, [c for i, c in enumerate(cands) if mask >> i & 1])
        out.append((r.peak_bytes, r.recompute_cost))
    return out


def lowest_peak(g: SimGraph, cands: Sequence[int], plans: Plans | None) -> int:
    """The lowest activation peak of any plan: exact from ``plans``, else the lowest the
    heuristics find (``solve`` at budget 0 returns it), or keeping all / nothing if lower."""
    peaks = [simulate(g, cands).peak_bytes, simulate(g, []).peak_bytes]
    if plans is not None:
        peaks += [p for p, _ in plans]
    else:
        peaks.append(solve(g, cands, 0, seeds=HEURISTICS).result.peak_bytes)
    return min(peaks)


def budgets(
    g: SimGraph, cands: Sequence[int], lowest: int, fractions: Sequence[float]
) -> list[tuple[float, int]]:
    """Budgets at ``fractions`` of the way from the lowest peak to the highest of keeping
    all or nothing. (Keeping nothing is not the lowest: backward then caches every value
    it recomputes until its step, which on a chain is all of them.)"""
    hi = max(simulate(g, cands).peak_bytes, simulate(g, []).peak_bytes)
    return [(f, int(lowest + f * (hi - lowest))) for f in fractions]


def not_exact_because(g: SimGraph) -> list[str]:
    """Which conditions of ``exact_for`` a graph fails, in words."""
    why = []
    if g.cache_limit != "unbounded":
        why.append(f"cache_limit={g.cache_limit!r}")
    if g.fixed:
        why.append(f"{len(g.fixed)} fixed values")
    if any(g.step_grad_bytes.values()):
        why.append("gradient buffers")
    views = sum(1 for v, val in enumerate(g.values) if val.storage != v or val.is_view)
    if views:
        why.append(f"{views} views or aliases")
    by_step: dict[int, set[int]] = {}
    for s, v in g.saved:
        by_step.setdefault(s, set()).add(v)
    multi = pointwise = partial = workspace = 0
    for j, op in enumerate(g.ops):
        multi += len(op.outputs) != 1
        pointwise += op.pointwise
        workspace += bool(op.workspace or op.run_workspace)
        partial += not set(op.inputs) <= by_step.get(j, set()) <= set(op.inputs) | set(op.outputs)
    for n, what in (
        (multi, "ops with several outputs"),
        (pointwise, "pointwise ops"),
        (partial, "ops whose step does not save exactly their inputs (and output)"),
        (workspace, "ops with workspaces"),
    ):
        if n:
            why.append(f"{n} {what}")
    return why


class DeepLinear(torch.nn.Module):
    """A bottleneck MLP without activations or biases: ``torch.mm`` by varied widths."""

    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(a, b) / math.sqrt(a))
            for a, b in itertools.pairwise(widths)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.mm(x, w)
        return x


@contextmanager
def planner_graphs() -> Iterator[list[Any]]:
    """Collect the ``RegionGraph`` of every region ``memory_budget`` plans."""
    graphs: list[Any] = []
    original = BudgetPlanner.graph

    def collect(self: BudgetPlanner, region: Any, run: Any) -> Any:
        graph = original(self, region, run)
        graphs.append(graph)
        return graph

    BudgetPlanner.graph = collect  # type: ignore[method-assign]
    try:
        yield graphs
    finally:
        BudgetPlanner.graph = original  # type: ignore[method-assign]


def recorded(step: Callable[[], torch.Tensor], cache_limit: int | str | None = None) -> Any:
    """The planner's graph of one region (``memory_budget(0.5)``, 2 FLOPs per byte moved)."""
    policy = cg.policies.memory_budget(0.5, flops_per_byte=2.0)
    with planner_graphs() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # the first step records; the plan is made at the second's start
            with cg.save_recompute_policy(policy, cache_limit=cache_limit):
                out = step()
            out.float().pow(2).mean().backward()
        policy.report()
    return graphs[-1]


def real_graphs() -> list[tuple[str, Any]]:
    """Small real regions: (name, RegionGraph)."""
    torch.manual_seed(0)
    widths = (64, 256, 32, 128, 16, 192, 48, 96, 64)
    net = DeepLinear(widths)
    x = torch.randn(16, widths[0], requires_grad=True)  # a block's input: it has a gradient
    out = [
        ("deep linear (8 x mm, widths 16-256, batch 16)", recorded(lambda: net(x))),
        (
            'deep linear, cache_limit="unbounded" (the same)',
            recorded(lambda: net(x), cache_limit="unbounded"),
        ),
    ]
    mlp = build_workload("mlp", layers=2, width=32, batch=16)
    out.append(("zoo mlp (2 layers, width 32, batch 16)", recorded(lambda: mlp.model(*mlp.inputs))))
    gpt = build_workload("gpt", layers=1, width=32, batch=2, seq_len=16)
    out.append(("zoo gpt (1 layer, width 32, seq 16)", recorded(lambda: gpt.model(*gpt.inputs))))
    return out


# --------------------------------------------------------------------------- one case


@dataclass(frozen=True)
class Case:
    """One graph at one budget: the solver's plans against the MILP optimum."""

    source: str
    graph: str
    ops: int
    candidates: int
    fraction: float
    budget: int
    solver: int | None  # recompute cost, None if no plan fits
    method: str
    solver_s: float
    heuristics: int | None
    heuristics_s: float
    optimum: int | None  # the MILP's (or enumeration's) cost, None if infeasible
    proved: bool
    reference: str  # "milp", "milp (no grads)", "enumeration", "none"
    milp_s: float
    notes: tuple[str, ...] = ()

    def gap(self, cost: int | None) -> float | None:
        """Relative distance of ``cost`` above the optimum (None: nothing to compare)."""
        if cost is None or self.optimum is None:
            return None
        if self.optimum == 0:
            return 0.0 if cost == 0 else math.inf
        return (cost - self.optimum) / self.optimum


def cpu_timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def run_case(
    source: str,
    name: str,
    g: SimGraph,
    cands: Sequence[int],
    fraction: float,
    budget: int,
    *,
    time_limit: float,
    max_evals: int | None,
    plans: Plans | None,
    exact_graph: SimGraph | None,
    hand: Any = None,
) -> Case:
    """Solve one case every way.

    ``plans``: every plan's peak and cost (enumeration), or None; ``exact_graph``: a graph the
    MILP is exact on (``g`` or one with the same peak and cost for every plan), or None.
    """
    notes: list[str] = []
    sol, solver_s = cpu_timed(lambda: solve(g, cands, budget, max_evals=max_evals, hand=hand))
    heur, heur_s = cpu_timed(
        lambda: solve(g, cands, budget, max_evals=max_evals, seeds=HEURISTICS, hand=hand)
    )
    solver = sol.result.recompute_cost if sol.feasible else None
    heuristics = heur.result.recompute_cost if heur.feasible else None
    optimum: int | None = None
    proved = False
    milp_s = 0.0
    reference = "none"
    if exact_graph is not None:
        reference = "milp" if exact_graph is g else "milp (no grads)"
        res, milp_s = cpu_timed(
            lambda: milp_plan(exact_graph, cands, budget, time_limit=time_limit)
        )
        if res is not None:
            optimum, proved = round(res.cost), res.optimal
            r = simulate(g, res.kept_ops)
            if r.peak_bytes > budget or r.recompute_cost != optimum:
                notes.append(
                    f"MILP plan simulates to peak {r.peak_bytes} / cost {r.recompute_cost}, "
                    f"objective {res.cost:g}"
                )
    if plans is not None:
        enum = min((c for p, c in plans if p <= budget), default=None)
        if reference == "none":
            optimum, proved, reference = enum, True, "enumeration"
        elif enum != optimum:
            notes.append(f"enumeration optimum {enum} != MILP {optimum}")
    elif reference == "none" and exact_graph is None:
        # not exact and too many candidates to enumerate: the MILP's plan as a candidate
        res, milp_s = cpu_timed(lambda: milp_plan(g, cands, budget, time_limit=time_limit))
        if res is not None:
            r = simulate(g, res.kept_ops)
            fits = r.peak_bytes <= budget
            notes.append(
                f"no optimum: MILP plan (not exact) simulates to cost {r.recompute_cost}"
                + ("" if fits else f", peak {r.peak_bytes} > budget")
            )
    for label, cost in (("solver", solver), ("heuristics", heuristics)):
        if proved and optimum is not None and cost is not None and cost < optimum:
            notes.append(f"{label} {cost} below the proved optimum {optimum}")
    if optimum is not None and solver is None:
        notes.append(f"solver: no plan fits (lowest peak found {sol.result.peak_bytes:,})")
    return Case(
        source,
        name,
        len(g.ops),
        len(cands),
        fraction,
        budget,
        solver,
        sol.method if sol.feasible else "-",
        solver_s,
        heuristics,
        heur_s,
        optimum,
        proved,
        reference,
        milp_s,
        tuple(notes),
    )


def same_plans(plans: Plans, bare: SimGraph, cands: Sequence[int]) -> bool:
    """Whether every plan has the same activation peak and cost on ``bare`` as in ``plans``."""
    return every_plan(bare, cands) == plans


# --------------------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "+inf"
    return f"{100 * x:+.1f}%" if x else "0"


def _cost(c: int | None) -> str:
    return "no fit" if c is None else f"{c:,}"


def summary(cases: Sequence[Case], key: Callable[[Case], int | None]) -> str:
    comparable = [c for c in cases if c.optimum is not None]
    gaps = [g for c in comparable if (g := c.gap(key(c))) is not None]
    at_opt = sum(1 for g in gaps if g == 0)
    missed = sum(1 for c in comparable if key(c) is None)
    finite = [g for g in gaps if not math.isinf(g)]
    worst = max(gaps, default=None)
    med = statistics.median(gaps) if gaps else None
    above = [g for g in finite if g > 0]
    text = f"{at_opt} of {len(comparable)} at the optimum"
    if missed:
        text += f", {missed} with no plan that fits"
    text += f"; worst gap {_pct(worst)}, median {_pct(med)}"
    if above:
        text += f", mean of the {len(above)} above it {_pct(statistics.mean(above))}"
    return text


def _optimum(c: Case) -> str:
    if c.optimum is not None:
        return f"{c.optimum:,}"
    return "-" if c.reference == "none" else "infeasible"


def table(cases: Sequence[Case]) -> list[str]:
    lines = [
        "| graph | ops | cand. | budget (frac.) | solver | won by | heuristics | optimum "
        "| proved (by) | gap solver | gap heur. | solver s | heur. s | optimum s | notes |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c.graph} | {c.ops} | {c.candidates} | {c.budget:,} ({c.fraction:.0%}) "
            f"| {_cost(c.solver)} | {c.method} | {_cost(c.heuristics)} | {_optimum(c)} "
            f"| {'yes' if c.proved else 'no'} ({c.reference}) | {_pct(c.gap(c.solver))} "
            f"| {_pct(c.gap(c.heuristics))} | {c.solver_s:.2f} | {c.heuristics_s:.2f} "
            f"| {c.milp_s:.2f} | {'; '.join(c.notes)} |"
        )
    return lines


def report(
    cases: Sequence[Case], args: argparse.Namespace, seconds: float, real_notes: list[str]
) -> str:
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    evals = "search_evals (360,000 / ops, >= 1000)" if args.max_evals is None else args.max_evals
    lines = [
        "## Distance to the optimum (bench_milp.py)",
        "",
        f"{date}; {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, scipy {scipy.__version__} "
        f"(HiGHS); load average at the end {load}; {seconds:.0f} s in all. Random graphs: "
        f"sizes {args.sizes}, {args.seeds} seeds each; budgets at {args.fractions} of the way "
        f"from the lowest peak to the highest; solve's max_evals {evals}; MILP time "
        f"limit {args.time_limit:g} s; times "
        "are process CPU seconds.",
        "",
        "*solver* = `solve` as `memory_budget` calls it (its seeds include the MILP, 100 "
        "nodes, on graphs of <= 30 ops); *heuristics* = `solve` without the MILP seed; "
        "*optimum* = `milp_plan` (*proved*: HiGHS proved it optimal) or enumeration; gap = "
        "cost / optimum - 1.",
        "",
        "Summary:",
        "",
    ]
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.source, []).append(c)
    random_cases = [c for c in cases if c.source.startswith("random")]
    if len(groups) > 2 and random_cases:
        groups["all random graphs"] = random_cases
    for source, group in groups.items():
        solver_s = [c.solver_s for c in group]
        milp_s = [c.milp_s for c in group if c.reference.startswith("milp")]
        proved = sum(c.proved for c in group if c.optimum is not None)
        timing = f"solver {statistics.median(solver_s):.2f} s median, {max(solver_s):.2f} s max"
        if milp_s:
            timing += f"; MILP {statistics.median(milp_s):.2f} s median, {max(milp_s):.2f} s max"
        lines.append(
            f"- {source}: {len(group)} cases, {sum(c.optimum is not None for c in group)} "
            f"with an optimum ({proved} proved). Solver: {summary(group, lambda c: c.solver)}. "
            f"Heuristics alone: {summary(group, lambda c: c.heuristics)}. {timing}."
        )
    no_fit = [c for c in cases if c.optimum is not None and c.solver is None]
    failed = [c for c in cases if any(not n.startswith(("solver:", "no optimum")) for n in c.notes)]
    lines.append(
        "- consistency checks (the MILP's plan simulates to its objective within the budget, "
        f"enumeration agrees with the MILP, no plan below a proved optimum): {len(failed)} "
        "case(s) failed; cases where the solver found no plan that fits though one does: "
        f"{len(no_fit)}."
    )
    off = [
        c
        for c in cases
        if c.optimum is not None and (c.gap(c.solver) != 0 or c.gap(c.heuristics) != 0)
    ]
    lines += ["", "Cases off the optimum (solver or heuristics):", ""]
    lines += table(off) if off else ["(none)"]
    if real_notes:
        lines += ["", "Real regions:", "", *real_notes]
    lines += ["", "All cases:", "", *table(cases)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[12, 20, 30, 40, 60])
    parser.add_argument("--seeds", type=int, default=6, help="random graphs per size")
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.1, 0.3, 0.5, 0.8],
        help="budgets, as fractions of the way from the lowest peak to the highest",
    )
    parser.add_argument(
        "--max-evals",
        type=int,
        default=None,
        help="solve's max_evals (default: solve's own, search_evals: 360,000 / ops, >= 1000)",
    )
    parser.add_argument("--time-limit", type=float, default=60.0, help="MILP seconds per case")
    parser.add_argument(
        "--enumerate", type=int, default=14, help="check by enumeration up to this many candidates"
    )
    parser.add_argument(
        "--enumerate-real", type=int, default=16, help="the same for recorded regions"
    )
    parser.add_argument("--no-real", action="store_true", help="synthetic graphs only")
    parser.add_argument("--out", help="also write the markdown to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cases: list[Case] = []
    for n in args.sizes:
        for seed in range(args.seeds):
            g = milp_graph(1000 * n + seed, n)
            assert exact_for(g)
            cands = candidate_ops(g)
            plans = every_plan(g, cands) if len(cands) <= args.enumerate else None
            lowest = lowest_peak(g, cands, plans)
            for frac, budget in budgets(g, cands, lowest, args.fractions):
                print(f"random {n} ops, seed {seed}, {frac:.0%}", file=sys.stderr, flush=True)
                cases.append(
                    run_case(
                        f"random {n} ops",
                        f"random n={n} s={seed}",
                        g,
                        cands,
                        frac,
                        budget,
                        time_limit=args.time_limit,
                        max_evals=args.max_evals,
                        plans=plans,
                        exact_graph=g,
                    )
                )
    real_notes: list[str] = []
    if not args.no_real:
        for name, rg in real_graphs():
            g, cands = rg.g, list(rg.candidates)
            why = not_exact_because(g)
            bare = dataclasses.replace(
                g, step_grad_bytes={}, step_grad_in_bytes={}, cache_limit="unbounded"
            )
            exact_graph: SimGraph | None = g if exact_for(g) else None
            verdict = "exact" if exact_graph is not None else "not exact: " + ", ".join(why)
            up_to = args.enumerate_real
            plans = every_plan(g, cands) if len(cands) <= up_to else None
            unbounded = g.cache_limit == "unbounded"
            if exact_graph is None and exact_for(bare) and plans is not None:
                what = "them" if unbounded else "them and the automatic recompute-cache bound"
                if same_plans(plans, bare, cands):
                    exact_graph = bare
                    verdict += (
                        f"; exact without {what}, and all {2 ** len(cands)} plans have the same "
                        "activation peak and cost either way: MILP solved on that graph"
                    )
                else:
                    verdict += (
                        f"; exact without {what}, but some plans' activation peak or cost "
                        f"differs then: optimum by enumeration ({2 ** len(cands)} plans)"
                    )
            elif exact_graph is None:
                verdict += (
                    f"; optimum by enumeration ({2 ** len(cands)} plans)"
                    if len(cands) <= up_to
                    else "; too many candidates to enumerate: no optimum"
                )
            real_notes.append(f"- {name}: {len(g.ops)} ops, {len(cands)} candidates; {verdict}.")
            for frac, budget in budgets(g, cands, lowest_peak(g, cands, plans), args.fractions):
                print(f"{name}, {frac:.0%}", file=sys.stderr, flush=True)
                cases.append(
                    run_case(
                        "real regions",
                        name.split(" (")[0].replace(" (the same)", ""),
                        g,
                        cands,
                        frac,
                        budget,
                        time_limit=args.time_limit,
                        max_evals=args.max_evals,
                        plans=plans,
                        exact_graph=exact_graph,
                        hand=rg.hand,
                    )
                )
    text = report(cases, args, time.perf_counter() - t0, real_notes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
