"""The GPU check of issue 23: the CUDA tests, then transformers' GPT-2 under each strategy.

One command for a short GPU window (under 8 minutes on one H100):

    python benchmarks/gpu_check.py --out gpu_report/           # on a CUDA machine
    python benchmarks/gpu_check.py --dry-run --out /tmp/gc     # the same code on CPU, tiny sizes

It runs ``tests/cuda/test_cuda.py`` (RNG replay of dropout and SDPA kernels, offload on a side
stream, CUDA memory accounting, autocast, ``wrap`` on GPT-2, flat gradients under CUDA-graph
capture, InPlaceABN), then one training step of transformers' GPT-2 built from the small and
medium configurations (12 x 768 and 24 x 1024; vocabulary 2048, dropout 0.1) under: no
checkpointing, ``torch.utils.checkpoint`` per block, torch selective checkpointing per block
(matmuls kept), a ckpt_graph region per block, ``memory_budget`` bisected to the peaks of the
two torch configurations, per-block regions keeping matmul outputs, and the same regions
offloading them to pinned host memory (its step time against keeping them on the device is
what the copies cost beyond what backward's compute hides). For each: peak memory (``torch.cuda.max_memory_allocated`` through
``ckpt_graph.memory.measure``), median step time (CUDA events), the largest gradient difference
against no checkpointing, and how CPU-bound the forward is (host time per recorded op against
device time per op). The report is ``gpu_check.md`` in the folder given by ``--out``.
``--dry-run`` runs every step of this on CPU with tiny sizes (CI runs it, so it cannot rot).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The checkout this file lives in, before any installed copy: a GPU machine runs the tree
# it was given, installed or not.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ckpt_graph as cg  # noqa: E402
from ckpt_graph import policies  # noqa: E402
from ckpt_graph.compare.strategies import make_forward  # noqa: E402
from ckpt_graph.compare.zoo import Workload, build_workload  # noqa: E402
from ckpt_graph.memory import measure  # noqa: E402
from ckpt_graph.policies import MemoryBudget, memory_budget  # noqa: E402

aten = torch.ops.aten
SIZES = {  # GPT-2 small and medium (layers, width); batch and sequence sized for one H100
    "small": dict(layers=12, width=768, batch=8, seq_len=1024),
    "medium": dict(layers=24, width=1024, batch=4, seq_len=1024),
}
DRY_SIZES = {  # the same two models, tiny
    "small": dict(layers=2, width=64, batch=2, seq_len=32),
    "medium": dict(layers=3, width=64, batch=2, seq_len=32),
}
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


class Clock:
    """Elapsed device time of a region of code: CUDA events on a GPU, wall time on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def time(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn`` took on the device (CUDA: between events around it)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def host_and_device(self, fn: Callable[[], object]) -> tuple[float, float]:
        """Seconds the host spent issuing ``fn`` and seconds the device ran it. A host time
        above the device time means the device waited for the host (CPU-bound)."""
        if not self.cuda:
            s = self.time(fn)
            return s, s
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return host, start.elapsed_time(end) / 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class Row:
    model: str
    strategy: str
    peak: int
    step_s: float
    grad_diff: float
    ops: int = 0
    host_us_per_op: float = 0.0
    device_us_per_op: float = 0.0
    note: str = ""


def _zero(w: Workload) -> None:
    for p in w.model.parameters():
        p.grad = None


def _step(w: Workload, forward: Callable[[], object]) -> None:
    _zero(w)
    torch.manual_seed(7)
    w.loss(forward()).backward()


def _grads(w: Workload) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in w.model.parameters()]


def _diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def _peak(w: Workload, forward: Callable[[], object], device: str) -> int:
    gc.collect()
    return int(measure(functools.partial(_step, w, forward), device=device).peak_bytes)


def _offload_policy(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Matmul outputs to host memory, everything else recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in MATMULS:
        return CheckpointPolicy.PREFER_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


def _budget_forward(w: Workload, fraction: float) -> tuple[Callable[[], object], MemoryBudget]:
    policy = memory_budget(fraction)
    forward = _one_region(w, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(w, forward)  # records; the next step follows the plan
    return forward, policy


def _one_region(w: Workload, policy: MemoryBudget) -> Callable[[], object]:
    def forward() -> object:
        with cg.save_recompute_policy(policy):
            return w.model(*w.inputs)

    return forward


def _bisect(
    w: Workload, target: int, device: str, steps: int
) -> tuple[float, Callable[[], object]]:
    """The largest budget fraction whose measured step peak is at most ``target``."""
    lo, hi = 0.0, 1.0
    best: tuple[float, Callable[[], object]] | None = None
    forward: Callable[[], object] | None = None
    for _ in range(steps):
        mid = (lo + hi) / 2
        forward, _ = _budget_forward(w, mid)
        if _peak(w, forward, device) <= target:
            lo, best = mid, (mid, forward)
        else:
            hi = mid
    if best is None:
        assert forward is not None
        return hi, forward
    return best


def _recording_split(
    w: Workload, forward: Callable[[], object], clock: Clock, region_ops: int
) -> tuple[float, float]:
    """Host and device microseconds per op of one forward (no backward)."""
    _zero(w)
    clock.sync()
    host_s, device_s = clock.host_and_device(lambda: w.loss(forward()))
    ops = max(region_ops, 1)
    return host_s / ops * 1e6, device_s / ops * 1e6


def _count_ops(w: Workload) -> int:
    """Op nodes one region over the whole forward records (the op count of the forward)."""
    with cg.save_recompute_policy("recompute_all") as region:
        w.loss(w.model(*w.inputs))
    return len(region.nodes)


def bench_model(
    name: str, sizes: dict[str, int], device: str, steps: int, bisect_steps: int
) -> list[Row]:
    w = build_workload("hf-gpt2", device=device, dropout=0.1, **sizes)  # type: ignore[arg-type]
    clock = Clock(device)
    ops = _count_ops(w)
    forwards: dict[str, Callable[[], object]] = {
        s: make_forward(s, w) for s in ("none", "torch-ckpt", "torch-sac", "cg-block")
    }
    notes: dict[str, str] = {}
    _step(w, forwards["none"])
    reference = _grads(w)
    peaks = {s: _peak(w, f, device) for s, f in forwards.items()}
    for target in ("torch-ckpt", "torch-sac"):
        fraction, f = _bisect(w, peaks[target], device, bisect_steps)
        key = f"memory_budget @ {target}"
        forwards[key] = f
        notes[key] = f"budget {fraction:.3f}"
        peaks[key] = _peak(w, f, device)
    rows: list[Row] = []
    for strategy, forward in forwards.items():
        rows.append(_measure_row(name, strategy, w, forward, clock, steps, reference, ops))
        rows[-1].peak, rows[-1].note = peaks[strategy], notes.get(strategy, "")
    # Per-block regions keeping matmul outputs on the device, then offloading them: the
    # difference in step time is what the copies cost beyond what compute hides.
    for strategy, policy in (
        ("cg per block, matmuls kept", policies.save_matmuls()),
        ("offload (per block)", _offload_policy),
    ):
        cg.wrap(w.model, policy=policy)
        try:
            plain = forwards["none"]
            row = _measure_row(name, strategy, w, plain, clock, steps, reference, ops)
            row.peak = _peak(w, plain, device)
            rows.append(row)
        finally:
            cg.unwrap(w.model)
    kept, off = rows[-2], rows[-1]
    off.note = f"step {off.step_s / kept.step_s:.2f}x matmuls kept on the device"
    del w
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _measure_row(
    model: str,
    strategy: str,
    w: Workload,
    forward: Callable[[], object],
    clock: Clock,
    steps: int,
    reference: list[torch.Tensor | None],
    ops: int,
) -> Row:
    _step(w, forward)  # warm: caches, kernels, a plan followed
    diff = _diff(_grads(w), reference)
    times = [clock.time(functools.partial(_step, w, forward)) for _ in range(steps)]
    host, dev = _recording_split(w, forward, clock, ops)
    return Row(model, strategy, 0, statistics.median(times), diff, ops, host, dev)


def run_tests(dry_run: bool) -> tuple[str, int]:
    """Runs the CUDA tests; returns pytest's summary (and failures) and its exit status."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-rfEs",  # failures, errors and skips, each with its reason
        "tests/cuda/test_cuda.py",
        "tests/policies/test_policies.py::test_offload_on_cuda_keeps_values_in_host_memory",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    counts = [ln for ln in lines if re.search(r"\d+ (passed|failed|skipped|errors?)\b", ln)]
    listed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    summary = counts[-1] if counts else (lines[-1] if lines else "(no output)")
    return "\n".join([summary, *listed]), proc.returncode


def report(rows: list[Row], tests: str, device_name: str, seconds: float, dry: bool) -> str:
    mib = 2**20
    head = (
        f"# gpu_check{' (dry run, CPU)' if dry else ''}\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device_name}, "
        f"torch {torch.__version__}, {platform.machine()}; {seconds:.0f} s in all.\n\n"
        f"## tests/cuda/test_cuda.py\n\n```\n{tests}\n```\n\n## transformers GPT-2\n\n"
        "Peak: max_memory_allocated over one step (CPU: the allocator's events). Step: median "
        "of the timed steps (CUDA events). Grad diff: largest |difference| from no "
        "checkpointing (same seed, dropout 0.1). Host/device us per op: one forward's wall "
        "time and device time over the ops a region records; host above device means the "
        "forward is CPU-bound.\n\n"
        "| model | strategy | peak MiB | vs none | step ms | vs none | grad diff "
        "| ops | host us/op | device us/op | note |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    base = {r.model: r for r in rows if r.strategy == "none"}
    for r in rows:
        b = base[r.model]
        lines.append(
            f"| {r.model} | {r.strategy} | {r.peak / mib:.1f} | {r.peak / b.peak:.2f} | "
            f"{r.step_s * 1e3:.1f} | {r.step_s / b.step_s:.2f} | {r.grad_diff:.2e} | {r.ops} | "
            f"{r.host_us_per_op:.1f} | {r.device_us_per_op:.1f} | {r.note} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (CI)")
    parser.add_argument("--models", nargs="*", default=None, help="small, medium")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per strategy")
    parser.add_argument("--bisect-steps", type=int, default=None)
    parser.add_argument("--no-tests", action="store_true", help="skip tests/cuda")
    args = parser.parse_args(argv)
    dry = bool(args.dry_run)
    if not dry and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    device = "cpu" if dry else "cuda"
    if dry:
        torch.set_num_threads(1)  # tiny ops: threads only contend
    sizes = DRY_SIZES if dry else SIZES
    models = args.models or (["small"] if dry else list(sizes))
    steps = args.steps or (1 if dry else 5)
    bisect_steps = args.bisect_steps or (2 if dry else 4)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    tests, status = ("(skipped: --no-tests)", 0) if args.no_tests else run_tests(dry)
    print(tests, flush=True)
    rows: list[Row] = []
    # bisection probes below what any plan reaches say so once per policy; the row says it
    warnings.filterwarnings("ignore", message=r"ckpt_graph: memory_budget\(.*no plan found")
    for m in models:
        rows += bench_model(m, sizes.get(m, DRY_SIZES["small"]), device, steps, bisect_steps)
        print(f"{m} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    name = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    text = report(rows, tests, name, time.perf_counter() - t0, dry)
    path = os.path.join(args.out, "gpu_check.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(f"written: {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
