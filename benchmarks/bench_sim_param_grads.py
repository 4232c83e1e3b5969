"""Predicted vs measured backward peak with parameters' gradients preallocated and ``None``.

The cases and the measurement of ``bench_sim_error.py`` (``run_region`` of
``tests/planner/test_liveness.py``: kept bytes at backward start plus the highest rise of
allocated bytes in backward, the second of two steps), run twice: with every ``.grad``
preallocated (summed into in place: outside the step, as ``bench_sim_error.py`` measures)
and with every ``.grad`` set to ``None`` before each step, as the zoo's and most training
loops' steps do (Note [Parameters' gradients in backward]). "grads" is the measured peak
with ``None`` less the one preallocated.

Usage:
    python benchmarks/bench_sim_param_grads.py               # bench_sim_error's cases
    python benchmarks/bench_sim_param_grads.py --zoo-sizes   # text models and ViT, zoo sizes
    python benchmarks/bench_sim_param_grads.py --models hf-convnext hf-resnet --zoo-sizes
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "planner"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_sim_error import _cases  # noqa: E402

from ckpt_graph.compare.zoo import build_workload  # noqa: E402


def main() -> None:
    from test_liveness import named_policy, predicted_peak, run_region

    torch.set_num_threads(1)
    args = sys.argv[1:]
    zoo_sizes = "--zoo-sizes" in args
    models = args[args.index("--models") + 1 :] if "--models" in args else []
    models = [m for m in models if not m.startswith("--")]
    cases = _cases(zoo_sizes)
    if models:  # named models at the script's sizes (bench_zoo's with --zoo-sizes)
        sized = {m: s for m, s, _, _ in cases}
        cases = [
            (m, sized.get(m, {}), p, None) for m in models for p in ("recompute_all", "budget")
        ]
    print("| model | policy | cache_limit | preallocated: predicted / measured B | ", end="")
    print("None: predicted / measured B | grads B |")
    print("|---|---|---|---:|---:|---:|")
    errors: dict[str, list[float]] = {"zeros": [], "none": []}
    for model, sizes, policy, limit in cases:
        cells = []
        measured = {}
        for grads in ("zeros", "none"):
            w = build_workload(model, **sizes)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run = run_region(
                    w.model, w.inputs, named_policy(policy), w.loss, cache_limit=limit, grads=grads
                )
            predicted = predicted_peak(run)
            error = (predicted - run.measured) / run.measured
            errors[grads].append(abs(error))
            measured[grads] = run.measured
            cells.append(f"{predicted:,} / {run.measured:,} ({100 * error:+.2f}%)")
        print(
            f"| {model} | {policy} | {limit} | {cells[0]} | {cells[1]} | "
            f"{measured['none'] - measured['zeros']:,} |",
            flush=True,
        )
    print()
    for grads, label in (("zeros", "preallocated"), ("none", "None")):
        e = errors[grads]
        print(
            f"- {label}: {len(e)} cases, |error| max {100 * max(e):.2f}%, "
            f"mean {100 * sum(e) / len(e):.2f}%"
        )


if __name__ == "__main__":
    main()
