"""Memory-budget planner on a 12-layer GPT-style model: peak vs budget, recompute vs torch.

For budgets from 20% to 90% of the activation memory autograd keeps without checkpointing,
one region over the whole model runs with ``memory_budget(budget)``: one step to plan, then
a measured step that applies the plan. Reported per budget: the planner's predicted activation peak, the engine's
activation peak (kept bytes + the most bytes of recomputed values cached at once), the
measured peak of the whole step (``ckpt_graph.memory.measure``, CPU allocator events), and
the recompute cost. The baseline is ``torch.utils.checkpoint`` (non-reentrant) on the first
``k`` blocks, k = 0..12: for each budget, the smallest k whose measured step peak is at most
the planner's, and its recompute cost (k x one block's forward).

Costs are memory_budget's (Note [Recompute cost model]): FLOPs from ``torch.utils.flop_counter``
formulas for ops that have one (matmuls, attention), bytes read and written times the
calibrated FLOPs per byte otherwise; view ops cost nothing.

Run: ``python benchmarks/bench_budget.py [--out benchmarks/results_budget.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
import warnings
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import ckpt_graph as cg
from ckpt_graph.compare.architectures import GPT
from ckpt_graph.engine import realize
from ckpt_graph.memory import measure
from ckpt_graph.planner import budget_planner as budget_mod
from ckpt_graph.planner.cost_model import calibrated_flops_per_byte, op_cost
from ckpt_graph.planner.from_region import from_region, kept_ops_of
from ckpt_graph.planner.liveness import simulate
from ckpt_graph.planner.memory_budget import memory_budget

LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 12, 64, 4, 64, 8, 256
BUDGETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def build() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(VOCAB, WIDTH, LAYERS, HEADS, SEQ).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients accumulate in place: not part of the peaks
    return model, torch.randint(0, VOCAB, (BATCH, SEQ))


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


class CostRecorder:
    """A policy that abstains and records each op's cost (see the module docstring)."""

    def __init__(self) -> None:
        self.costs: dict[int, int] = {}

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        moved = ctx.out_bytes + sum(
            a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)
        )
        self.costs[ctx.op_index] = op_cost(ctx.flops, moved, calibrated_flops_per_byte())


def block_cost(model: GPT, x: torch.Tensor) -> int:
    """Recompute cost of one block's forward (what torch.utils.checkpoint replays)."""
    h = model.tok(x) + model.pos(torch.arange(SEQ))
    rec = CostRecorder()
    with cg.save_recompute_policy(rec) as region:
        model.blocks[0](h)
    g = from_region(region, rec.costs)
    return sum(op.cost for op in g.ops)


def tuc_peak(model: GPT, x: torch.Tensor, k: int) -> int:
    def step() -> None:
        h = model.tok(x) + model.pos(torch.arange(SEQ))
        for i, block in enumerate(model.blocks):
            h = checkpoint(block, h, use_reentrant=False) if i < k else block(h)
        loss_of(model.head(model.ln_f(h))).backward()

    return measure(step).peak_bytes


class CacheProbe:
    """Measures the activation memory the engine holds during backward, per storage.

    Wraps ``ckpt_graph.engine.realize.run_node`` (benchmark only): around every recomputed op it
    takes the distinct storages of the region's kept values and of its cached recomputed
    values, before the op (its inputs) and after it (its outputs), and keeps the largest
    sum of their sizes. Values autograd holds after their last use are not seen.
    """

    def __init__(self) -> None:
        self.peak = 0
        self._orig = realize.run_node

    def __enter__(self) -> CacheProbe:
        orig = self._orig

        def probed(region: Any, node: Any) -> None:
            before = self._storages(region)
            orig(region, node)
            after = self._storages(region)
            before.update(after)
            self.peak = max(self.peak, sum(before.values()))

        realize.run_node = probed
        return self

    def __exit__(self, *exc: object) -> None:
        realize.run_node = self._orig

    @staticmethod
    def _storages(region: Any) -> dict[int, int]:
        out: dict[int, int] = {}
        for node in region.nodes:
            for h in node.outputs:
                if h is None:
                    continue
                t = h.cache if h.cache is not None else h.value
                if t is not None:
                    st = t.untyped_storage()
                    out[st.data_ptr()] = st.nbytes()
        return out


class SolveProbe:
    """Wraps the solver the policy calls (benchmark only): also solves with the greedy seeds.

    Records, per plan, the recompute cost and time of ``solve`` with only the greedy and
    simulator-guided starting plans (the solver before the min-cut and segment-DP seeds) and
    with every seed (the plan the policy uses).
    """

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, int, float, str]] = []
        self._orig = budget_mod.solve  # type: ignore[attr-defined]

    def __enter__(self) -> SolveProbe:
        orig = self._orig

        def probed(g: Any, candidates: Any, budget: int, **kwargs: Any) -> Any:
            t = time.perf_counter()
            greedy = orig(g, candidates, budget, seeds=("greedy", "simulated"))
            t_greedy = time.perf_counter() - t
            t = time.perf_counter()
            sol = orig(g, candidates, budget, **kwargs)
            t_all = time.perf_counter() - t
            cost = greedy.result.recompute_cost if greedy.feasible else -1
            self.rows.append((cost, t_greedy, sol.result.recompute_cost, t_all, sol.method))
            return sol

        budget_mod.solve = probed  # type: ignore[attr-defined,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        budget_mod.solve = self._orig  # type: ignore[attr-defined]


def budget_row(model: GPT, x: torch.Tensor, fraction: float) -> dict[str, Any]:
    policy = memory_budget(fraction)
    box: list[Any] = []

    def step() -> None:
        with cg.save_recompute_policy(policy) as region:
            y = model(x)
        box.append(region)
        loss_of(y).backward()

    planning: list[float] = []
    costs: dict[int, int] = {}
    planner = policy.planner
    op_costs, plan_step = planner.op_costs, planner.plan_step

    def recorded_costs(region: Any, run: Any) -> dict[int, int]:
        out = op_costs(region, run)
        costs.update(out)  # the per-op costs the policy plans with
        return out

    def timed_plan() -> bool:
        t = time.perf_counter()
        out = plan_step()
        planning.append(time.perf_counter() - t)
        return out

    planner.op_costs = recorded_costs  # type: ignore[method-assign]
    planner.plan_step = timed_plan  # type: ignore[method-assign]
    t0 = time.perf_counter()
    with warnings.catch_warnings(), SolveProbe() as solves:
        warnings.simplefilter("ignore")
        step()  # heuristic
        policy.report()  # plans the step (otherwise done when the next step starts)
    step1_s = time.perf_counter() - t0 - solves.rows[0][1]  # without the extra greedy solve
    greedy_cost, greedy_s, _, all_s, _ = solves.rows[0]
    first = box[-1]
    first_sim = simulate(from_region(first, costs), kept_ops_of(first))
    heuristic, heuristic_flops = first_sim.peak_bytes, first_sim.recompute_cost
    box.clear()
    with CacheProbe() as probe:
        step()
    box.clear()
    measured = measure(step)
    region = box[-1]
    report = policy.report()
    assert report is not None
    sim = simulate(from_region(region), kept_ops_of(region))
    return {
        "fraction": fraction,
        "budget": report.budget_bytes,
        "baseline": report.baseline_bytes,
        "predicted": report.predicted_peak_bytes,
        "engine": probe.peak,
        "step_peak": measured.peak_bytes,
        "sim_total": sim.peak_total_bytes,
        "flops": report.predicted_recompute_flops,
        "ops": region.pass_state.recomputed_ops,
        "feasible": report.feasible,
        "method": report.method,
        "candidates": report.candidates,
        "ops_total": len(first.nodes),
        "plan_s": sum(planning) - greedy_s,
        "solve_s": all_s,
        "greedy_cost": greedy_cost,
        "greedy_s": greedy_s,
        "step1_s": step1_s,
        "heuristic": heuristic,
        "heuristic_flops": heuristic_flops,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results_budget.md")
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    model, x = build()
    per_block = block_cost(model, x)
    tuc = [tuc_peak(model, x, k) for k in range(LAYERS + 1)]
    rows = [budget_row(model, x, f) for f in BUDGETS]
    mib = 2.0**20
    lines = [
        "# memory_budget on a 12-layer GPT-style model",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(2 threads), Python {platform.python_version()}. Generated by "
        "`benchmarks/bench_budget.py` in "
        f"{time.perf_counter() - start:.0f} s.",
        "",
        f"Model: GPT(vocab={VOCAB}, width={WIDTH}, layers={LAYERS}, heads={HEADS}), batch "
        f"{BATCH} x {SEQ} tokens, float32, CPU. Activation memory without checkpointing "
        f"(bytes autograd saves in the model): {rows[0]['baseline'] / mib:.2f} MiB. One block "
        f"forward costs {per_block:,} (FLOPs where known, elements otherwise).",
        "",
        "Columns: *predicted* = simulated activation peak of backward (kept + cached + held "
        "recomputed values); *engine* = measured activation peak of backward: the largest "
        "sum of distinct storages of kept and cached recomputed values around each "
        "recomputed op (real tensors, ``CacheProbe``); *step peak* = measured peak of the whole step "
        "(forward + backward, includes gradient buffers, logits and autograd temporaries); "
        "*TUC k* = fewest blocks under torch.utils.checkpoint with a measured step peak <= the "
        "planner's; *recompute cost* = the plan's simulated recompute cost per step; "
        "*recomputed ops* = ops the engine ran again in the measured step.",
        "",
        "| budget | budget MiB | predicted MiB | engine MiB | engine / budget | step peak MiB "
        "| recompute cost | recomputed ops | TUC k | TUC step peak MiB | TUC recompute cost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seeds = [
        "",
        "Solver and first step. *greedy only* = the solver with only its greedy and "
        "simulator-guided starting plans (as before the graph seeds); *all seeds* = with the "
        "min-cut and segment-DP seeds as well (the plan used above); *won by* = the starting "
        "plan whose local optimum was cheapest (ties go to the greedy one); times are "
        "wall-clock seconds of `solve` on the region "
        f"({rows[0]['ops_total']} ops, {rows[0]['candidates']} candidates) on a shared "
        "2-core machine. *step 1* = the first step, decided by the online heuristic: "
        "simulated activation peak of its decisions and their recompute cost; *plan s* = "
        "the planning at region exit (graph, solve, report).",
        "",
        "| budget | greedy only: cost | s | all seeds: cost | s | won by | plan s "
        "| step 1 predicted MiB | step 1 / budget | step 1 recompute cost | step 1 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = next((k for k, p in enumerate(tuc) if p <= r["step_peak"]), None)
        tuc_cols = (
            f"{k} | {tuc[k] / mib:.2f} | {k * per_block:,}"
            if k is not None
            else f"> {LAYERS} (min {min(tuc) / mib:.2f} MiB) | - | -"
        )
        lines.append(
            f"| {r['fraction']:.0%}{'' if r['feasible'] else ' (infeasible)'} "
            f"| {r['budget'] / mib:.2f} | {r['predicted'] / mib:.2f} | {r['engine'] / mib:.2f} "
            f"| {r['engine'] / r['budget']:.3f} | {r['step_peak'] / mib:.2f} | {r['flops']:,} "
            f"| {r['ops']} | {tuc_cols} |"
        )
        seeds.append(
            f"| {r['fraction']:.0%} | {r['greedy_cost']:,} | {r['greedy_s']:.1f} "
            f"| {r['flops']:,} | {r['solve_s']:.1f} | {r['method']} | {r['plan_s']:.1f} "
            f"| {r['heuristic'] / mib:.2f} | {r['heuristic'] / r['budget']:.2f} "
            f"| {r['heuristic_flops']:,} | {r['step1_s']:.1f} |"
        )
    lines += seeds
    lines += [
        "",
        "torch.utils.checkpoint step peaks by k (MiB): "
        + ", ".join(f"{k}: {p / mib:.2f}" for k, p in enumerate(tuc)),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
