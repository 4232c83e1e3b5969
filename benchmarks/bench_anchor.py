"""memory_budget where attention scores dominate activations, against Megatron's selective recompute.

The research anchor of the planner (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"): recomputing only the attention core (QK^T,
softmax, dropout, attention x V) and keeping the linear layers' outputs cuts activation
memory by about 70% for +2.7% FLOPs when the T x T scores dominate. The model is the
embedded ``gpt`` with attention spelt out op by op (``eager_attention=True``), attention and
residual dropout, and sizes chosen so that the scores dominate as in the paper's setting
(head size 8, a sequence half as long as the width: the attention core is about 2/3 of the
activations and 2-3% of the FLOPs; 12 layers, so that one layer's recompute in backward is
small next to what the others keep). One training step under each configuration:

- ``none``: no checkpointing;
- ``save_matmuls()``: one region keeping every matmul-class output (bmm included);
- ``torch-sac``: torch selective checkpointing per block, saving matmul outputs;
- ``megatron``: one region keeping the outputs of ``addmm`` / ``mm`` (the linear layers)
  and recomputing everything else, the attention core included (the paper's plan, as a
  ``policies.save_ops`` policy);
- ``memory_budget(f)``: one region, planned at the first step, measured at the next.

Per row: peak (``ckpt_graph.memory.measure`` of forward + backward) over the peak without
checkpointing, and recompute FLOPs (``torch.utils.flop_counter.FlopCounterMode``, forward +
backward, minus the step without checkpointing) as a percentage of that step's FLOPs. The
measuring helpers are ``bench_pareto``'s. The goal: a budget at or below 0.30x of the peak
for at most +2.7% FLOPs, and at the megatron row's peak no more recompute than it.

Run: ``python -m benchmarks.bench_anchor [--budgets 0.2 0.25 0.3] [--out results.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import ckpt_graph as cg
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import Workload, build_workload
from ckpt_graph.policies import save_matmuls, save_ops

if __package__ in (None, ""):  # run as a file (run_all.py): make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_pareto import budget_forward, flops_of, peak_of, step

aten = torch.ops.aten

SIZES: dict[str, int] = dict(layers=12, width=256, heads=32, batch=2, seq_len=128)
DROPOUT = 0.1
BUDGETS = (0.25, 0.3, 0.5)


def anchor_workload(**sizes: int) -> Workload:
    """The eager-attention GPT of this benchmark (``SIZES`` unless given)."""
    return build_workload(
        "gpt",
        **{**SIZES, **sizes},  # type: ignore[arg-type]
        dropout=DROPOUT,
        eager_attention=True,
    )


def megatron_policy() -> object:
    """Megatron's selective recompute as a policy: keep the linear layers' outputs."""
    return save_ops(aten.addmm, aten.mm)


def _region(w: Workload, policy: object) -> Callable[[], object]:
    def forward() -> object:
        with cg.save_recompute_policy(policy):  # type: ignore[arg-type]
            return w.model(*w.inputs)

    return forward


def run(budgets: tuple[float, ...]) -> list[tuple[str, float, float, str]]:
    """Rows ``(configuration, peak / none, recompute % of the step, note)``."""
    w = anchor_workload()
    forwards: dict[str, Callable[[], object]] = {
        "none": make_forward("none", w),
        "save_matmuls()": _region(w, save_matmuls()),
        "torch-sac": make_forward("torch-sac", w),
        "megatron (keep addmm/mm)": _region(w, megatron_policy()),
    }
    notes = dict.fromkeys(forwards, "")
    for f in forwards.values():
        step(w, f)  # warm-up
    for b in budgets:
        t0 = time.perf_counter()
        forward, policy = budget_forward(w, b)
        report = policy.report()
        key = f"memory_budget({b})"
        forwards[key] = forward
        notes[key] = (
            f"plan from {report.method if report else '?'}, first step and plan "
            f"{time.perf_counter() - t0:.1f} s"
        )
    base_peak = peak_of(w, forwards["none"])
    base_flops = flops_of(w, forwards["none"])
    rows = []
    for key, f in forwards.items():
        peak = peak_of(w, f)
        extra = flops_of(w, f) - base_flops
        rows.append((key, peak / base_peak, 100 * extra / base_flops, notes[key]))
    rows.insert(0, ("(none: absolute)", base_peak / 2**20, base_flops / 1e9, "MiB, GFLOP"))
    return rows


def table(rows: list[tuple[str, float, float, str]]) -> str:
    out = [
        "| configuration | peak / none | recompute % of step FLOPs | note |",
        "|---|---:|---:|---|",
    ]
    first, *rest = rows
    out.append(f"| {first[0]} | {first[1]:.1f} MiB | {first[2]:.2f} GFLOP | |")
    out += [f"| {k} | {p:.3f} | {fl:+.2f}% | {n} |" for k, p, fl, n in rest]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="*", type=float, default=list(BUDGETS))
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = run(tuple(args.budgets))
    head = (
        f"bench_anchor: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{torch.__version__}, {platform.machine()}, 1 thread; gpt with eager attention, "
        f"{SIZES}, dropout {DROPOUT}; {time.perf_counter() - t0:.0f} s in all\n\n"
    )
    text = head + table(rows) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
