"""memory_budget with variable-length batches: the cost of a step with unseen shapes.

A 4-layer GPT-style model trains under one ``memory_budget(0.5)`` policy (and 0.3, and an int
budget) with batches whose sequence length changes every step. Reported: the median step time
with shapes seen before (a planned step), the median time of steps whose shapes were never
seen before, their ratio and the worst ratio. A step's time includes the planning it causes
(``policy.report()`` at its end plans it, instead of the next step's start). With an int
budget, an unseen size above the planned one (56 here) is planned again, starting from the
smaller size's plan: see Note [Plans across sizes] and Note [Warm start at a new size] in
``ckpt_graph/planner/across_sizes.py``. "plans made" counts the regions recorded for a new
plan.

Measured (2-core shared machine, one thread): fractions 0.9-1.3x; the int budget's step at a
new largest size 2.0-2.6x a planned step over 4 runs (before the warm start: 20.8x, a plan
from scratch).

Run: ``python benchmarks/bench_budget_shapes.py`` (about 10 s on one core).
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import torch

import ckpt_graph as cg
from ckpt_graph.compare.architectures import GPT
from ckpt_graph.planner.budget_planner import BudgetPlanner
from ckpt_graph.planner.memory_budget import MemoryBudget, memory_budget

LAYERS, WIDTH, HEADS, BATCH, VOCAB, MAX_SEQ = 4, 64, 4, 4, 256, 128
PLANNED_SEQ = 48
NEW_SEQS = (24, 32, 40, 56)


def step(model: GPT, policy: MemoryBudget, seq: int) -> float:
    idx = torch.randint(0, VOCAB, (BATCH, seq))
    t0 = time.process_time()
    with cg.save_recompute_policy(policy):
        loss = model(idx).float().pow(2).mean()
    loss.backward()
    policy.report()  # plans the step now if it needs a plan (else: at the next step)
    return time.process_time() - t0


PLANS: list[int] = []
_graph = BudgetPlanner.graph


def _counting_graph(self: BudgetPlanner, region: Any, run: Any) -> Any:
    PLANS.append(1)
    return _graph(self, region, run)


BudgetPlanner.graph = _counting_graph  # type: ignore[method-assign]


def run(budget: int | float) -> dict[str, Any]:
    PLANS.clear()
    torch.manual_seed(0)
    model = GPT(VOCAB, WIDTH, LAYERS, HEADS, MAX_SEQ).train()
    # Step times across sizes, not the measured check (whose profiled step would be timed).
    policy = memory_budget(budget, check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(model, policy, PLANNED_SEQ)  # the first step plans
        planned = [step(model, policy, PLANNED_SEQ) for _ in range(3)]
        new = [step(model, policy, s) for s in NEW_SEQS]
    p = statistics.median(planned)
    n = statistics.median(new)
    per_size = " ".join(f"{s}:{t / p:.2f}x" for s, t in zip(NEW_SEQS, new, strict=True))
    return {
        "planned_ms": 1e3 * p,
        "unseen_ms": 1e3 * n,
        "ratio": n / p,
        "worst": max(new) / p,
        "plans": len(PLANS),
        "per_size": per_size,  # type: ignore[dict-item]
    }


def main() -> None:
    torch.set_num_threads(1)
    for budget in (0.5, 0.3, 2 << 20):
        r = run(budget)
        print(
            f"memory_budget({budget!r}): planned step {r['planned_ms']:.1f} ms, unseen-shape "
            f"step {r['unseen_ms']:.1f} ms (median), ratio {r['ratio']:.2f}x, worst "
            f"{r['worst']:.2f}x; plans made {r['plans']} (first step included); per unseen "
            f"sequence length: {r['per_size']}"
        )


if __name__ == "__main__":
    main()
