"""Gradient bookkeeping per training step: set_to_none vs zero_() + accumulate vs zero-copy.

Three ways to get a step's gradients, on the same MLP (Linear layers through
``ckpt_graph.grads.linear``, so every mode runs the same matmul kernels):

- ``set_to_none``: no flat buffer; ``.grad = None`` before backward; autograd adopts each fresh
  gradient (path 1 of Note [Gradient adoption]). No extra traffic, but new allocations and new
  ``.grad`` pointers every step.
- ``zero_+accumulate``: ``FlatGrads``; ``flat.zero_()`` then ordinary backward, which adds each
  fresh gradient into its slice (path 3).
- ``zero-copy``: ``FlatGrads``; ``flat.zero_()`` then backward writing each gradient into its
  slice with ``out=`` (``FlatGrads.write_grad``), adopted by autograd (path 1).
- ``set_to_none+copy-in`` (informative): ``FlatGrads`` but ``optimizer.zero_grad()`` with its
  default ``set_to_none=True``; FlatGrads copies each gradient back into the buffer.

- ``set_to_none+zero-copy``: ``FlatGrads``, ``optimizer.zero_grad()`` (``.grad = None``: the
  slices hold nothing to keep, so nothing needs zeroing) and gradients written with ``out=``:
  no bookkeeping traffic at all, and every ``.grad`` ends at its fixed buffer address.
- ``set_to_none, F.linear`` and ``zero_+accumulate, F.linear`` (informative): the same with
  autograd's own linear, to show what the custom autograd.Function costs by itself; the
  second is what FlatGrads costs a model that does not use ``ckpt_graph.grads.linear``.

Bytes moved are counted, not estimated: a dispatch mode records every ``zero_``/``fill_``/
``add_``/``copy_`` during zero + forward + backward of one step and sums the bytes each reads
and writes (the producing matmuls and the optimizer are the same in every mode and are left
out). Times are medians of interleaved rounds (every mode runs once per round, in rotating
order), reported as ratios to ``set_to_none`` measured in the same run. Process CPU time is
the primary figure (with one torch thread it is the step's own work, and it is not inflated
when other processes share the cores); wall time is shown too. A step is zero +
forward + backward + SGD update.

Usage:
    python benchmarks/bench_grads.py                      # writes benchmarks/results_grads.md
    python benchmarks/bench_grads.py --width 512 --rounds 5 --out -   # print only
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_graph.grads import FlatGrads, linear

MODES = (
    "set_to_none",
    "zero_+accumulate",
    "zero-copy",
    "set_to_none+copy-in",
    "set_to_none+zero-copy",
    "set_to_none, F.linear",
    "zero_+accumulate, F.linear",
)


class _Traffic(TorchDispatchMode):
    """Bytes read and written by in-place zero/add/copy ops (gradient bookkeeping)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.written = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in ("zero_", "fill_", "add_", "copy_"):
            dst = args[0]
            nbytes = dst.numel() * dst.element_size()
            self.written += nbytes
            if name == "add_":
                self.read += nbytes + args[1].numel() * args[1].element_size()
            elif name == "copy_":
                self.read += args[1].numel() * args[1].element_size()
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _MLP(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.flat: FlatGrads | None = None
        self.plain = False  # autograd's own linear instead of ckpt_graph.grads.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if self.plain else linear(x, layer.weight, layer.bias, flat=self.flat)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


@dataclass
class _Runner:
    mode: str
    model: _MLP
    opt: torch.optim.Optimizer
    flat: FlatGrads | None

    def gradients(self, x: torch.Tensor) -> None:
        """Zero (or clear) the gradients, then forward and backward."""
        if self.flat is None or self.mode.startswith("set_to_none"):  # optimizer.zero_grad()
            self.opt.zero_grad(set_to_none=True)
        else:
            assert self.flat is not None
            self.flat.zero_()
        self.model(x).square().mean().backward()

    def step(self, x: torch.Tensor) -> None:
        self.gradients(x)
        self.opt.step()


def _runner(mode: str, width: int, layers: int) -> _Runner:
    torch.manual_seed(0)
    model = _MLP(width, layers)
    flat = None if mode in ("set_to_none", "set_to_none, F.linear") else FlatGrads(model)
    model.flat = flat if mode.endswith("zero-copy") else None
    model.plain = mode.endswith("F.linear")
    return _Runner(mode, model, torch.optim.SGD(model.parameters(), lr=1e-3), flat)


@dataclass(frozen=True)
class Result:
    mode: str
    bytes_read: int
    bytes_written: int
    ops: str
    cpu_ms: float  # median process CPU time per step
    cpu_min_ms: float
    cpu_ratio: float  # cpu_ms / the same for set_to_none
    wall_ms: float  # median wall time per step
    wall_ratio: float


def run(width: int, layers: int, batch: int, rounds: int, steps: int) -> list[Result]:
    runners = [_runner(m, width, layers) for m in MODES]
    x = torch.randn(batch, width)
    warnings.filterwarnings("ignore", message="ckpt_graph: FlatGrads")  # copy-in is the point
    traffic = {}
    for r in runners:
        for _ in range(3):  # warm-up: allocator, optimizer state, first-step copies
            r.step(x)
        with _Traffic() as t:
            r.gradients(x)  # the optimizer's traffic is the same in every mode
        traffic[r.mode] = t
        r.opt.step()
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    for k in range(rounds):
        order = runners[k % len(runners) :] + runners[: k % len(runners)]
        for r in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                r.step(x)
            cpu[r.mode].append((time.process_time() - start_cpu) / steps * 1e3)
            wall[r.mode].append((time.perf_counter() - start) / steps * 1e3)
    base_cpu = statistics.median(cpu["set_to_none"])
    base_wall = statistics.median(wall["set_to_none"])
    results = []
    for m in MODES:
        t = traffic[m]
        ops = ", ".join(f"{n}x{c}" for n, c in sorted(t.ops.items())) or "none"
        c, w = statistics.median(cpu[m]), statistics.median(wall[m])
        results.append(
            Result(m, t.read, t.written, ops, c, min(cpu[m]), c / base_cpu, w, w / base_wall)
        )
    # all modes with the same kernels computed the same parameters
    ref = runners[0].model
    for r in runners[1:]:
        if r.model.plain:
            continue
        for p, q in zip(r.model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    return results


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu} ({os.cpu_count()} CPUs), {torch.get_num_threads()} torch threads, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def table(results: list[Result], width: int, layers: int, batch: int) -> str:
    n = layers * (width * width + width)
    lines = [
        f"MLP {layers}xLinear({width}, {width}), batch {batch}, float32: {n:,} parameters "
        f"({n * 4 / 2**20:.1f} MiB of gradients)",
        "",
        "| mode | bytes read / step | bytes written / step | bookkeeping ops | "
        "CPU time / step: median (min) | CPU time vs set_to_none | wall time / step | "
        "wall vs set_to_none |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.bytes_read / 2**20:.1f} MiB | {r.bytes_written / 2**20:.1f} MiB | "
            f"{r.ops} | {r.cpu_ms:.2f} ms ({r.cpu_min_ms:.2f}) | {r.cpu_ratio:.3f} | "
            f"{r.wall_ms:.2f} ms | {r.wall_ratio:.3f} |"
        )
    by_mode = {r.mode: r for r in results}
    acc = by_mode["zero_+accumulate"].cpu_ms
    lines += [
        "",
        "With the flat buffer, CPU time relative to zero_+accumulate: "
        + ", ".join(f"{m} {by_mode[m].cpu_ms / acc:.3f}" for m in MODES[2:5])
        + ".",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--width", type=int, nargs="+", default=[1024])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 256])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results_grads.md")))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    sections = []
    for width in args.width:
        for batch in args.batch:
            res = run(width, args.layers, batch, args.rounds, args.steps)
            sections.append(table(res, width, args.layers, batch))
            print(sections[-1], "\n", flush=True)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/bench_grads.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = [
        "## Flat gradient buffers (ckpt_graph.grads)",
        "",
        f"Machine: {_machine()}; {load}. Date: {now}. Command: `{cmd.strip()}`.",
        f"Rounds: {args.rounds} x {args.steps} steps per mode, interleaved; ratios are from the "
        "same run. A step is zero + forward + backward + SGD update. Bytes are counted with a "
        "dispatch mode over zero + forward + backward of one step (zero_/fill_/add_/copy_ only; "
        "the matmuls producing the gradients and the optimizer are identical in every mode and "
        "not counted). CPU time is process time (with one torch thread, the step's own work; "
        "other processes sharing the cores do not inflate it, though they still compete for "
        "caches and memory bandwidth); wall time is shown as well.",
        "",
        "Expected bookkeeping traffic per element of gradient (4 bytes): set_to_none 0; "
        "zero_+accumulate 4 passes (zero: 1 write; `+=`: 2 reads, 1 write); zero-copy 1 pass "
        "(the zero_, needed only for parameters that might get no gradient); "
        "set_to_none+copy-in 2 passes (1 read, 1 write); set_to_none+zero-copy 0. "
        "See Note [Gradient adoption] in ckpt_graph/grads/flat.py.",
        "",
    ]
    text = "\n".join(header) + "\n" + "\n\n".join(sections) + "\n"
    if args.out != "-":
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
