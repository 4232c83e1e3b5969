"""What the measured budget check does and costs, on zoo models.

**Promise** (``--promise``): ``memory_budget(B)`` with ``B`` each torch configuration's
measured step peak (per block, groups of round(sqrt(N)) blocks, SAC saving matmuls), one
region over the model, ``check=False`` (the default before) against the default
(``check="auto"``): three steps (the heuristic's, the first plan's, measured, and the
re-plan's if it missed), then a step measured with ``ckpt_graph.memory.measure``. Printed:
that step's peak against torch's, the warnings, the correction and the plan's recompute.

**Cost** (the default):

``memory_budget(bytes)`` measures its first planned step (and one more after a re-plan) by
default (Note [Measured budget check]); on CPU that step runs under torch's profiler with
memory events. For each model of the zoo named, one region with ``memory_budget`` at
torch per block's measured peak (``flops_per_byte`` pinned, ``check=False`` so that nothing
is measured behind the benchmark's back) is planned on two steps, then the planned step is
timed ``--repeat`` times alternately with and without a :class:`ckpt_graph.memory.StepProbe`
running over it (started before the forward, stopped after the backward, as the policy
does). Printed: median process CPU time of each (one thread: steadier than wall time on a
shared machine) and their ratio, measured side by side.

Run: ``python benchmarks/bench_budget_check.py [--models hf-gpt2 ...] [--repeat 5]
[--promise]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import ckpt_graph as cg
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import Workload, build_workload
from ckpt_graph.memory import StepProbe, measure
from ckpt_graph.policies import memory_budget

FLOPS_PER_BYTE = 2.0
MIB = 2**20


def _step(w: Workload, forward: Callable[[], Any]) -> None:
    for p in w.model.parameters():
        p.grad = None
    w.loss(forward()).backward()


def one_model(name: str, repeat: int) -> tuple[float, float]:
    """Median CPU seconds of the planned step without and with a probe over it."""
    torch.manual_seed(0)
    w = build_workload(name)
    budget = measure(_step, w, make_forward("torch-ckpt", w)).peak_bytes
    policy = memory_budget(budget, flops_per_byte=FLOPS_PER_BYTE, check=False)

    def forward() -> Any:
        with cg.save_recompute_policy(policy):
            return w.model(*w.inputs)

    for _ in range(2):  # the heuristic's step, then the plan's
        _step(w, forward)
    plain: list[float] = []
    probed: list[float] = []
    for _ in range(repeat):  # alternately: side by side
        t0 = time.process_time()
        _step(w, forward)
        plain.append(time.process_time() - t0)
        probe = StepProbe("cpu")
        t0 = time.process_time()
        if not probe.start():
            raise RuntimeError(f"the probe did not start: {probe.why}")
        _step(w, forward)
        probe.stop()
        probed.append(time.process_time() - t0)
    return statistics.median(plain), statistics.median(probed)


def promise(name: str) -> list[str]:
    """Table rows of the promise check of one model (module docstring)."""
    torch.manual_seed(0)
    w = build_workload(name)
    rows = []
    for t in ("torch-ckpt", "torch-sqrt", "torch-sac"):
        budget = measure(_step, w, make_forward(t, w)).peak_bytes
        cells = [name, t, f"{budget / MIB:.1f}"]
        for check in (False, "auto"):
            policy = memory_budget(budget, flops_per_byte=FLOPS_PER_BYTE, check=check)

            def forward(policy: object = policy) -> Any:
                with cg.save_recompute_policy(policy):  # type: ignore[arg-type]
                    return w.model(*w.inputs)

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):
                    _step(w, forward)
                report = policy.report()
                peak = measure(_step, w, forward).peak_bytes
            assert report is not None
            said = "; ".join(str(c.message)[:90] for c in caught) or "none"
            cells += [
                f"{peak / budget:.2f}x",
                f"{report.correction_bytes / MIB:.2f}",  # type: ignore[attr-defined]
                f"{report.predicted_recompute_flops / 1e9:.3f}",
                said,
            ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["hf-gpt2", "hf-convnext", "torch-loop"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--promise", action="store_true", help="the promise table instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.promise:
        head = ["peak / torch", "correction MiB", "plan's recompute GFLOP", "warnings"]
        print(
            "| model | at | torch MiB | "
            + " | ".join(f"check=False: {h}" for h in head)
            + " | "
            + " | ".join(f"default: {h}" for h in head)
            + " |"
        )
        print("|---" * 11 + "|")
        for name in args.models:
            print("\n".join(promise(name)), flush=True)
        return
    print("| model | step ms | step ms under the probe | ratio |")
    print("|---|---:|---:|---:|")
    for name in args.models:
        a, b = one_model(name, args.repeat)
        print(f"| {name} | {a * 1e3:.0f} | {b * 1e3:.0f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
