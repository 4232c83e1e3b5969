"""Predicted (liveness simulator) vs measured backward peak, on the project's models and the zoo.

For each case one region covers the model's forward; the step is measured as the liveness
tests measure it (``run_region`` of ``tests/planner/test_liveness.py``, imported so that the
benchmark and the tests share one definition of "measured": kept bytes at backward start
plus the highest rise of allocated bytes in backward, the second of two steps; the policies
are that module's ``named_policy``, as in the drift tests), and the simulator predicts
``peak_total_bytes`` for the region's kept values. The project's models (gpt with dropout,
mlp, cnn) run at three policies and two cache limits; the third-party zoo
(``compare.third_party``, plus transformers' GPT-2 and Llama) at the zoo tests' tiny sizes
(``compare.zoo.TINY_SIZES``), under ``recompute_all`` and a budget plan, with the automatic
cache bound. Zoo models whose library is missing are skipped.

With ``--zoo-sizes`` the text models and ViT run instead at the default sizes of
``bench_zoo.py`` (``compare.zoo.DEFAULTS`` and ``third_party.SPECS``), where ops are not tiny.

Usage:
    python benchmarks/bench_sim_error.py               # markdown table on stdout
    python benchmarks/bench_sim_error.py --zoo-sizes   # text models and ViT at bench_zoo sizes
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "planner"))
sys.path.insert(0, str(ROOT / "tests"))

from ckpt_graph.compare.third_party import SPECS  # noqa: E402
from ckpt_graph.compare.zoo import TINY_SIZES, build_workload  # noqa: E402

TINY = TINY_SIZES


def _library(name: str) -> str:
    return "transformers" if name in ("hf-gpt2", "hf-llama") else SPECS[name].library


ZOO_SIZED = ["hf-gpt2", "hf-llama", "hf-bert", "hf-t5", "hf-mixtral", "hf-vit"]


def _cases(zoo_sizes: bool) -> list[tuple[str, dict[str, Any], str, Any]]:
    cases: list[tuple[str, dict[str, Any], str, Any]] = []
    if zoo_sizes:  # build_workload's defaults are bench_zoo's sizes
        for model in ZOO_SIZED:
            if importlib.util.find_spec(_library(model)) is not None:
                for policy in ["recompute_all", "budget"]:
                    cases.append((model, {}, policy, None))
        return cases
    for model in ["gpt", "mlp", "cnn"]:
        sizes: dict[str, Any] = dict(layers=3, width=32, batch=2, seq_len=16)
        if model == "gpt":
            sizes["dropout"] = 0.1
        for policy in ["recompute_all", "save_matmuls", "budget"]:
            for limit in [None, "unbounded"]:
                cases.append((model, sizes, policy, limit))
    for model, sizes in TINY.items():
        if importlib.util.find_spec(_library(model)) is None:
            continue
        for policy in ["recompute_all", "budget"]:
            cases.append((model, sizes, policy, None))
    return cases


def main() -> None:
    from test_liveness import named_policy, predicted_peak, run_region

    torch.set_num_threads(1)
    zoo_sizes = "--zoo-sizes" in sys.argv[1:]
    cases = _cases(zoo_sizes)
    title = " at bench_zoo sizes" if zoo_sizes else ""
    print(f"### Predicted vs measured backward peak{title} (`benchmarks/bench_sim_error.py`)\n")
    print("| model | policy | cache_limit | predicted B | measured B | error |")
    print("|---|---|---|---:|---:|---:|")
    own: list[float] = []
    zoo: list[float] = []
    for model, sizes, policy, limit in cases:
        w = build_workload(model, **sizes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = run_region(w.model, w.inputs, named_policy(policy), w.loss, cache_limit=limit)
        predicted = predicted_peak(run)
        error = (predicted - run.measured) / run.measured
        (zoo if model in TINY else own).append(abs(error))
        print(
            f"| {model} | {policy} | {limit} | {predicted:,} | {run.measured:,} | "
            f"{100 * error:+.2f}% |",
            flush=True,
        )
    print()
    for label, errors in (("project models", own), ("zoo", zoo)):
        if errors:
            print(
                f"- {label}: {len(errors)} cases, |error| max {100 * max(errors):.2f}%, "
                f"mean {100 * sum(errors) / len(errors):.2f}%"
            )


if __name__ == "__main__":
    main()
