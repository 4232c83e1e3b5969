"""memory_budget against torch's hand configurations, at each configuration's own peak.

For each embedded model (gpt, mlp, cnn at small sizes), the torch configurations of
``ckpt-graph compare``: ``torch-ckpt`` (torch.utils.checkpoint per block), ``torch-sqrt``
(over groups of k = round(sqrt(N)) blocks) and ``torch-sac`` (selective checkpointing per
block, saving matmul / convolution / attention outputs). For each one, ``memory_budget`` on
one region over the whole model with its budget bisected (as a fraction, 7 steps) to the
largest whose measured step peak is at or under that configuration's. Three figures per
row, measured in the same process, side by side:

- peak: ``ckpt_graph.memory.measure`` of one training step (forward + backward);
- recompute: ``torch.utils.flop_counter.FlopCounterMode`` FLOPs of one step minus those of
  the step without checkpointing (with formulas for the CPU flash-attention ops, which
  torch's counter lacks);
- time: median process CPU time of ``--steps`` steps, the configurations interleaved
  round-robin (one thread).

The goal: at each torch peak, ckpt_graph recomputes no more FLOPs and takes no more time.
Prints a markdown table; ``--out`` writes it, ``--plot`` draws peak vs recompute
(matplotlib, optional).

``--models gpt-wide`` adds a GPT 4x wider with 2x longer sequences (not run by default: about
2 min more), where ops are large enough that per-op recording overhead stops deciding step time;
``hf-gpt2`` and ``hf-llama`` are transformers' models from small configs (needs transformers),
architectures the project did not write.

Run: ``python -m benchmarks.bench_pareto [--models gpt mlp cnn gpt-wide] [--out
benchmarks/results_pareto.md] [--plot p.png]``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import ckpt_graph as cg
from ckpt_graph.compare.strategies import StrategySkipped, make_forward
from ckpt_graph.compare.zoo import Workload, build_workload
from ckpt_graph.memory import measure
from ckpt_graph.policies import MemoryBudget, memory_budget

aten = torch.ops.aten

MODELS: dict[str, dict[str, int]] = {
    "gpt": dict(layers=6, width=64, batch=4, seq_len=64),
    "mlp": dict(layers=6, width=256, batch=256),
    "cnn": dict(layers=6, width=16, batch=8, seq_len=32),
    # the same GPT 4x wider with 2x longer sequences: ops large enough that the recording's
    # per-op overhead no longer decides the step time (see BENCHMARKS.md §4)
    "gpt-wide": dict(layers=6, width=256, batch=4, seq_len=128),
    # models the project did not write (transformers' GPT-2 and Llama from small configs):
    # the planner has no knowledge of their structure beyond what it records
    "hf-gpt2": dict(layers=4, width=128, batch=4, seq_len=64),
    "hf-llama": dict(layers=4, width=128, batch=4, seq_len=64),
}
ZOO = {"gpt-wide": "gpt"}  # benchmark name -> zoo model, where they differ
DEFAULT_MODELS = ("gpt", "mlp", "cnn")
TORCH = ("torch-ckpt", "torch-sqrt", "torch-sac")
BISECT_STEPS = 7


def _sdpa_fwd(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(q, k, v))


def _sdpa_bwd(grad: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad, q, k, v))


_CPU_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_bwd,
}


def step(w: Workload, forward: Callable[[], object]) -> None:
    for p in w.model.parameters():
        p.grad = None
    w.loss(forward()).backward()


def one_region(w: Workload, policy: MemoryBudget) -> Callable[[], object]:
    def forward() -> object:
        with cg.save_recompute_policy(policy):
            return w.model(*w.inputs)

    return forward


def peak_of(w: Workload, forward: Callable[[], object]) -> int:
    gc.collect()
    return int(measure(functools.partial(step, w, forward)).peak_bytes)


def flops_of(w: Workload, forward: Callable[[], object]) -> int:
    counter = FlopCounterMode(display=False, custom_mapping=_CPU_SDPA)
    with counter:
        step(w, forward)
    return int(counter.get_total_flops())


def budget_forward(w: Workload, fraction: float) -> tuple[Callable[[], object], MemoryBudget]:
    """A planned one-region forward: the first step plans, the forward applies the plan."""
    policy = memory_budget(fraction)
    forward = one_region(w, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(w, forward)
    return forward, policy


def bisect_budget(w: Workload, target: int) -> tuple[float, Callable[[], object], MemoryBudget]:
    """The largest budget fraction whose measured step peak is at most ``target``."""
    lo, hi = 0.0, 1.0
    best: tuple[float, Callable[[], object], MemoryBudget] | None = None
    forward, policy = budget_forward(w, 1.0)
    if peak_of(w, forward) <= target:
        return 1.0, forward, policy
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        forward, policy = budget_forward(w, mid)
        if peak_of(w, forward) <= target:
            lo, best = mid, (mid, forward, policy)
        else:
            hi = mid
    if best is None:  # nothing fits: report the smallest budget tried
        return lo or hi, forward, policy
    return best


@dataclass
class Row:
    model: str
    config: str
    peak: int
    flops: int
    cpu_s: float = 0.0
    note: str = ""


def run_model(name: str, sizes: dict[str, int], steps: int) -> list[Row]:
    w = build_workload(ZOO.get(name, name), **sizes)  # type: ignore[arg-type]
    forwards: dict[str, Callable[[], object]] = {"none": make_forward("none", w)}
    for t in TORCH:
        try:
            forwards[t] = make_forward(t, w)
        except StrategySkipped as e:  # e.g. HF blocks take more than a tensor: no groups
            print(f"{name}: {t} skipped ({e})")
    torch_configs = [t for t in TORCH if t in forwards]
    for f in forwards.values():
        step(w, f)  # warm-up
    rows: dict[str, Row] = {}
    base_flops = flops_of(w, forwards["none"])
    for key, f in forwards.items():
        rows[key] = Row(name, key, peak_of(w, f), flops_of(w, f) - base_flops)
    for t in torch_configs:
        t0 = time.perf_counter()
        fraction, f, policy = bisect_budget(w, rows[t].peak)
        plan_s = time.perf_counter() - t0
        key = f"memory_budget @ {t}"
        forwards[key] = f
        report = policy.report()
        method = report.method if report is not None else "?"
        rows[key] = Row(
            name,
            key,
            peak_of(w, f),
            flops_of(w, f) - base_flops,
            note=f"budget {fraction:.3f}, plan from {method}, bisection {plan_s:.1f} s",
        )
    cpu: dict[str, list[float]] = {k: [] for k in forwards}
    for _ in range(steps):
        for key, f in forwards.items():
            c0 = time.process_time()
            step(w, f)
            cpu[key].append(time.process_time() - c0)
    for key in forwards:
        rows[key].cpu_s = statistics.median(cpu[key])
    return list(rows.values())


def table(rows: list[Row]) -> str:
    mib, g = 2.0**20, 1e9
    none = {r.model: r for r in rows if r.config == "none"}
    by = {(r.model, r.config): r for r in rows}
    out = [
        "| model | configuration | peak MiB | peak / none | recompute GFLOP | CPU ms / step "
        "| time / none | vs torch at its peak | note |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        n = none[r.model]
        verdict = ""
        if r.config.startswith("memory_budget @ "):
            t = by[(r.model, r.config.removeprefix("memory_budget @ "))]
            verdict = (
                f"peak {'<=' if r.peak <= t.peak else '>'} ({r.peak / t.peak:.2f}x), "
                f"FLOPs {'<=' if r.flops <= t.flops else '>'} "
                f"({(r.flops - t.flops) / g:+.4f} G), "
                f"time {r.cpu_s / t.cpu_s:.2f}x"
            )
        out.append(
            f"| {r.model} | {r.config} | {r.peak / mib:.2f} | {r.peak / n.peak:.2f} | "
            f"{r.flops / g:.4f} | {r.cpu_s * 1e3:.1f} | {r.cpu_s / n.cpu_s:.2f} | {verdict} "
            f"| {r.note} |"
        )
    return "\n".join(out)


def plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4))
    for ax, m in zip(axes if len(models) > 1 else [axes], models, strict=True):
        for r in rows:
            if r.model != m or r.config == "none":
                continue
            cgb = r.config.startswith("memory_budget")
            ax.scatter(
                r.peak / 2**20, r.flops / 1e9, marker="o" if cgb else "s", c="C0" if cgb else "C1"
            )
            ax.annotate(r.config.replace("memory_budget", "mb"), (r.peak / 2**20, r.flops / 1e9))
        ax.set_title(m)
        ax.set_xlabel("step peak (MiB)")
        ax.set_ylabel("recompute GFLOP")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--plot", help="write a peak vs recompute plot here (matplotlib)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows: list[Row] = []
    for m in args.models:
        rows += run_model(m, MODELS[m], args.steps)
        print(f"{m} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    head = (
        f"bench_pareto: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{torch.__version__}, {platform.machine()}, 1 thread; sizes { {m: MODELS[m] for m in args.models} }; "
        f"{time.perf_counter() - t0:.0f} s in all\n\n"
    )
    text = head + table(rows) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
