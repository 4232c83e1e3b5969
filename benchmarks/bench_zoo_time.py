"""CPU step time of ``memory_budget`` against torch's configurations, at sizes where ops are not tiny.

``benchmarks/bench_zoo.py`` measures peaks and FLOPs at the zoo's default sizes, where a step
is 40-250 ms and many ops take a few microseconds: there the region's recording (a Python
dispatch mode and saved-tensor hooks on every op) is a visible part of the step. This
benchmark asks the issue's time question on sizes where one step without checkpointing takes
about 0.3-1.1 s on one thread (:data:`SIZES`), so the time of the ops themselves dominates:

- ``none``, and torch's configurations ``torch-ckpt`` (per block), ``torch-sqrt`` (groups of
  round(sqrt(N)) chained blocks) and ``torch-sac`` (selective checkpointing of matmul-class
  ops per block);
- ``memory_budget @ T``: one region with ``memory_budget(B)`` where ``B`` is configuration
  ``T``'s measured step peak in bytes, ``flops_per_byte`` pinned as in bench_zoo, the default
  measured check (``check="auto"``) let settle before timing (bench_zoo's ``planned``: four
  steps, the last plan measured).

Each forward is measured once (peak, gradients, FLOPs) by a
:class:`~ckpt_graph.compare.runner.WorkloadRun`; then ``--repeat`` rounds time one step of
every configuration round-robin, as process CPU time with one thread. The report gives, per
model and torch configuration ``T``, the ratio of medians ``memory_budget @ T`` / ``T`` and the
ratio within each round (the two steps of a round ran seconds apart, so on a shared machine
the spread of the per-round ratios is the noise to read the median against).

Run: ``python benchmarks/bench_zoo_time.py [--models NAME ...] [--repeat 5]
[--out benchmarks/results_zoo_time.md]`` (the rows also go to the ``.json`` beside it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ckpt_graph.compare.runner import StrategyResult, WorkloadRun
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import build_workload

if __package__ in (None, ""):  # run as a file (run_all.py): make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_zoo import FLOPS_PER_BYTE, TORCH, Said, planned

# Sizes at which one training step without checkpointing takes about 0.3-1 s of one core
# (measured on the project's 2-core machine, 2026-11-28; batches halved after GPT-2 so that
# a run fits beside seven other jobs): matmuls of 512 x 512 x 512 and larger, convolutions
# over 56 x 56 maps and larger.
SIZES: dict[str, dict[str, int]] = {
    "hf-gpt2": dict(layers=4, width=512, batch=4, seq_len=256),
    "hf-llama": dict(layers=4, width=512, batch=2, seq_len=256),
    "hf-bert": dict(layers=4, width=512, batch=2, seq_len=256),
    "hf-vit": dict(layers=4, width=512, batch=2, seq_len=64),  # 256 patches of 4 x 4
    "hf-resnet": dict(layers=8, width=32, batch=8, seq_len=224),
    "hf-mobilenetv2": dict(layers=16, width=32, batch=4, seq_len=224),
    "hf-convnext": dict(layers=4, width=64, batch=8, seq_len=128),
    "diffusers-unet": dict(layers=1, width=32, batch=4, seq_len=64),
}


def run_model(name: str, repeat: int) -> list[StrategyResult]:
    """``none``, torch's configurations and ``memory_budget`` at each of their peaks on one
    model at :data:`SIZES`, timed side by side; a budget row's note is its planning note."""
    torch.manual_seed(0)
    w = build_workload(name, **SIZES[name])  # type: ignore[arg-type]
    run = WorkloadRun(w, seed=0)
    said = Said()
    run.add("none", lambda: make_forward("none", w))
    for t in TORCH:
        run.add(t, lambda t=t: make_forward(t, w))  # type: ignore[misc]
    for t in TORCH:
        if (peak := run.peak_bytes(t)) is not None:
            key = f"memory_budget @ {t}"
            run.add(key, lambda peak=peak, key=key: planned(w, peak, key, said))  # type: ignore[misc]
    # The planning note (plan, check steps, any warning) in place of the runner's empty one.
    return [
        dataclasses.replace(r, note=said.notes[r.strategy]) if r.strategy in said.notes else r
        for r in run.results(repeat)
    ]


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def table(rows: dict[str, list[StrategyResult]]) -> str:
    """Per model and torch configuration: peaks, recompute and CPU time of ``memory_budget``
    at its peak against it, with the per-round ratios."""
    out = [
        "| model | sizes | none ms | T | T ms (/ none) | mb@T ms (/ none) | peak mb@T / T "
        "| recompute GFLOP T / mb@T | CPU mb@T / T (median of rounds) | per round: min-max "
        "| per-round ratios |",
        "|---|---|---:|---|---:|---:|---:|---|---:|---|---|",
    ]
    for model, results in rows.items():
        by = {r.strategy: r for r in results}
        none = by["none"]
        sizes = ", ".join(f"{k} {v}" for k, v in SIZES[model].items())
        for t in TORCH:
            tr, mb = by.get(t), by.get(f"memory_budget @ {t}")
            if tr is None or mb is None or tr.status != "ok" or mb.status != "ok":
                note = "; ".join(f"{r.strategy}: {r.note}" for r in (tr, mb) if r is not None)
                out.append(f"| {model} | {sizes} | | {t} | | | | | | | {note[:200]} |")
                continue
            assert tr.peak_bytes and mb.peak_bytes and none.cpu_time_s
            assert tr.cpu_time_s and mb.cpu_time_s
            per_round = [a / b for a, b in zip(mb.cpu_times_s, tr.cpu_times_s, strict=True)]
            out.append(
                f"| {model} | {sizes} | {none.cpu_time_s * 1e3:.0f} | {t} "
                f"| {tr.cpu_time_s * 1e3:.0f} ({tr.cpu_time_s / none.cpu_time_s:.2f}) "
                f"| {mb.cpu_time_s * 1e3:.0f} ({mb.cpu_time_s / none.cpu_time_s:.2f}) "
                f"| {mb.peak_bytes / tr.peak_bytes:.3f} "
                f"| {(tr.extra_flops or 0) / 1e9:.2f} / {(mb.extra_flops or 0) / 1e9:.2f} "
                f"| {statistics.median(per_round):.3f} | {_spread(per_round)} "
                f"| {' '.join(f'{x:.2f}' for x in per_round)} |"
            )
    return "\n".join(out)


def as_json(rows: dict[str, list[StrategyResult]], settings: dict[str, Any]) -> str:
    """The run's settings and every :class:`StrategyResult` of every model."""
    return json.dumps(
        {
            **settings,
            "sizes": SIZES,
            "rows": [{"model": m, **dataclasses.asdict(r)} for m, rs in rows.items() for r in rs],
        },
        indent=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--out", help="write the markdown report here, and the rows as .json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*should be kept in float32.*")
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()
    loads = [os.getloadavg()[0]]
    rows: dict[str, list[StrategyResult]] = {}
    text = ""
    for m in args.models:
        t = time.perf_counter()
        rows[m] = run_model(m, args.repeat)
        loads.append(os.getloadavg()[0])
        print(f"{m} done ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
        text = (
            f"bench_zoo_time: {started:%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
            f"{platform.machine()}, {os.cpu_count()} CPUs, 1 thread, load average "
            f"{min(loads):.1f}-{max(loads):.1f} (at start and after each model); "
            f"{args.repeat} timed rounds; flops_per_byte={FLOPS_PER_BYTE}; "
            f"{time.perf_counter() - t0:.0f} s\n\n{table(rows)}\n"
        )
        if args.out:  # after every model, so that a run cut short keeps what it measured
            Path(args.out).write_text(text)
            settings = {
                "started_utc": f"{started:%Y-%m-%d %H:%M}",
                "torch": torch.__version__,
                "repeat": args.repeat,
                "flops_per_byte": FLOPS_PER_BYTE,
                "loads": loads,
                "seconds": round(time.perf_counter() - t0),
            }
            Path(args.out).with_suffix(".json").write_text(as_json(rows, settings) + "\n")
    print(text)


if __name__ == "__main__":
    main()
