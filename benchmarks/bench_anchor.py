"""memory_budget where attention scores dominate activations, against Megatron's selective recompute.

The research anchor of the planner (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"): recomputing only the attention core (QK^T,
softmax, dropout, attention x V) and keeping the linear layers' outputs cuts activation
memory by about 70% for +2.7% FLOPs when the T x T scores dominate. The model is
transformers' GPT-2 with eager attention (``dropout(softmax(QK^T / sqrt d + mask)) @ V``,
op by op) and attention and residual dropout 0.1, batch 1 x 1024 tokens, one region over
the model (loss outside), float32 on CPU. Shapes (``SHAPES``): 4 layers of width 256 at
head size 32 and 64 (issue 22's anchor), and ``--wide``: 2 layers of width 1024, head size
64, where the attention core is a smaller share of the FLOPs, as in Megatron's setting.
One training step under each configuration:

- ``none``: no checkpointing;
- ``torch-sac``: torch selective checkpointing per block, saving matmul outputs;
- ``megatron (keep addmm/mm)``: one region keeping the outputs of ``addmm`` / ``mm`` (the
  linear layers) and recomputing everything else, the attention core included
  (``policies.save_ops``);
- ``memory_budget(f)``: one region, planned at the first step, measured at the next;
- ``memory_budget(f), check=True`` (``--check-fractions``): the same measured by the
  policy too: the first planned step corrects the fraction's reference (no checkpointing's
  step peak) with the loss's backward outside the region, and the step is planned again
  once if it missed that budget (Note [Measured budget check] rule 4);
- ``memory_budget @ megatron``: the same with megatron's measured step peak in bytes (the
  budget bounds the region's simulated peak: memory outside the region comes on top), and
  with ``check=True`` (the first planned step measured, planned again once with the
  difference; Note [Measured budget check]).

``flops_per_byte`` is pinned to 2.0 so the plans do not depend on the machine. Per row:
peak (``ckpt_graph.memory.measure`` of forward + backward) over the peak without
checkpointing, and recompute FLOPs (``torch.utils.flop_counter.FlopCounterMode``, forward
+ backward, minus the step without checkpointing: matmul-class FLOPs only, pointwise ops
count 0) as a percentage of that step's FLOPs. The goal: at or below 0.30x of the peak for
at most +2.7% FLOPs, and at megatron's peak no more recompute than it.

Run: ``python -m benchmarks.bench_anchor [--budgets 0.2 0.25 0.3] [--wide] [--no-sac]
[--check-fractions] [--out results.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import ckpt_graph as cg
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import Workload, build_workload
from ckpt_graph.policies import memory_budget, save_ops

if __package__ in (None, ""):  # run as a file (run_all.py): make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_pareto import flops_of, peak_of, step

aten = torch.ops.aten

SHAPES: dict[str, dict[str, int]] = {
    "head size 32": dict(layers=4, width=256, heads=8, batch=1, seq_len=1024),
    "head size 64": dict(layers=4, width=256, heads=4, batch=1, seq_len=1024),
}
WIDE: dict[str, dict[str, int]] = {
    "wide, head size 64": dict(layers=2, width=1024, heads=16, batch=1, seq_len=1024),
}
DROPOUT = 0.1
BUDGETS = (0.2, 0.25, 0.3)
FLOPS_PER_BYTE = 2.0


def anchor_workload(**sizes: int) -> Workload:
    """The eager-attention GPT-2 of this benchmark at ``sizes`` (see ``SHAPES``)."""
    torch.manual_seed(0)
    return build_workload(
        "hf-gpt2",
        **sizes,  # type: ignore[arg-type]
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


def _planned(
    w: Workload, budget: float | int, base_peak: int, check: bool = False
) -> tuple[Callable[[], object], str]:
    """A one-region memory_budget forward that planned on one step (``check``: three, the
    second measured and planned again), and a note with the simulated peak of the region's
    backward over ``base_peak`` (no checkpointing's measured step peak): the loss outside
    the region comes on top of it in the measured step (Note [Backward liveness model],
    known limitations)."""
    policy = memory_budget(budget, flops_per_byte=FLOPS_PER_BYTE, check=check)
    forward = _region(w, policy)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3 if check else 1):
            step(w, forward)
        report = policy.report()
    method = report.method if report is not None else "?"
    note = f"plan from {method}, first step and plan {time.perf_counter() - t0:.0f} s"
    if report is not None:
        note += f", simulated {report.predicted_total_peak_bytes / base_peak:.3f}"
        reference = getattr(report, "reference_bytes", 0)
        if reference:  # a fraction measured: See Note [Measured budget check] rule 4.
            note += (
                f", reference corrected to {reference / base_peak:.3f} of none's measured "
                f"peak (simulated {report.plain_peak_bytes / base_peak:.3f})"  # type: ignore[attr-defined]
                + f", {report.checked}"  # type: ignore[attr-defined]
            )
    if caught:
        note += "; warned: " + str(caught[0].message)[:120]
    return forward, note


def run(
    sizes: dict[str, int],
    budgets: tuple[float, ...],
    sac: bool = True,
    check_fractions: bool = False,
) -> list[tuple[str, float, float, str]]:
    """Rows ``(configuration, peak / none, recompute % of the step, note)`` at ``sizes``."""
    w = anchor_workload(**sizes)
    forwards: dict[str, Callable[[], object]] = {"none": make_forward("none", w)}
    if sac:
        forwards["torch-sac"] = make_forward("torch-sac", w)
    forwards["megatron (keep addmm/mm)"] = _region(w, megatron_policy())
    notes = dict.fromkeys(forwards, "")
    for f in forwards.values():
        step(w, f)  # warm-up
    peaks = {k: peak_of(w, f) for k, f in forwards.items()}
    base = peaks["none"]
    for b in budgets:
        forwards[f"memory_budget({b})"], notes[f"memory_budget({b})"] = _planned(w, b, base)
        if check_fractions:
            key = f"memory_budget({b}), check=True"
            forwards[key], notes[key] = _planned(w, b, base, check=True)
    mega = peaks["megatron (keep addmm/mm)"]
    key = "memory_budget @ megatron"
    forwards[key], notes[key] = _planned(w, mega, base)
    key = "memory_budget @ megatron, check=True"
    forwards[key], notes[key] = _planned(w, mega, base, check=True)
    base_flops = flops_of(w, forwards["none"])
    base_peak = peaks["none"]
    rows = [("(none: absolute)", base_peak / 2**20, base_flops / 1e9, "MiB, GFLOP")]
    for key, f in forwards.items():
        peak = peaks[key] if key in peaks else peak_of(w, f)
        extra = flops_of(w, f) - base_flops
        rows.append((key, peak / base_peak, 100 * extra / base_flops, notes[key]))
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
    parser.add_argument("--wide", action="store_true", help="add the wide shape")
    parser.add_argument("--no-anchor", action="store_true", help="only the wide shape")
    parser.add_argument("--no-sac", action="store_true", help="leave out torch-sac")
    parser.add_argument(
        "--check-fractions",
        action="store_true",
        help="add memory_budget(f, check=True) beside each fraction",
    )
    parser.add_argument("--out", help="write the markdown tables here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*should be kept in float32.*")
    t0 = time.perf_counter()
    shapes = {} if args.no_anchor else dict(SHAPES)
    if args.wide:
        shapes.update(WIDE)
    sections = []
    for name, sizes in shapes.items():
        sections.append(
            f"#### {name}: {sizes}\n\n"
            + table(run(sizes, tuple(args.budgets), not args.no_sac, args.check_fractions))
        )
        print(sections[-1] + "\n", flush=True)
    head = (
        f"bench_anchor: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, 1 thread; "
        f"transformers GPT-2, eager attention, dropout {DROPOUT}, flops_per_byte="
        f"{FLOPS_PER_BYTE}; {time.perf_counter() - t0:.0f} s in all\n\n"
    )
    text = head + "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
