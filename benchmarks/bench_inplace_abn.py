"""Peak memory of a small CNN: BatchNorm2d + LeakyReLU vs InPlaceABN, with and without ckpt_graph.

Run from the repository root:
    python benchmarks/bench_inplace_abn.py                   # prints a markdown table
    python benchmarks/bench_inplace_abn.py --out benchmarks/results_inplace_abn.md

The network is `--blocks` x (Conv2d 3x3 -> norm + activation) followed by global pooling and a
linear layer. Memory comes from `ckpt_graph.memory.measure` (CPU allocator events: exact storage
bytes, see Note [Measuring CPU memory]). One "unit" is the size of one block's activation
(N x C x H x W floats); "kept/block" is what stays alive for backward after the forward, per block.
Times are medians of `--repeats` runs outside the profiler: process CPU time (all threads; the
cores are often shared) and wall time.

Variants of the norm + activation:
    bn+lrelu          nn.BatchNorm2d + nn.LeakyReLU(0.01)
    bn+lrelu(inplace) nn.BatchNorm2d + nn.LeakyReLU(0.01, inplace=True)
    inplace_abn       ckpt_graph.nn.InPlaceABN (made by convert_bn_act from the first variant)
Checkpointing modes:
    eager             plain autograd
    region            the whole network in one `save_recompute_policy("recompute_all")` region
    per-block         every block through `ckpt_graph.checkpoint(block, x, policy="recompute_all")`
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import ckpt_graph as cg
from ckpt_graph.memory import measure, measure_with_result
from ckpt_graph.nn import convert_bn_act

_MIB = 2**20


def make_cnn(channels: int, blocks: int, inplace: bool) -> nn.Sequential:
    """`blocks` x (conv 3x3, BatchNorm2d, LeakyReLU) + pooling + linear head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(blocks):
        layers.append(
            nn.Sequential(
                nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
                nn.LeakyReLU(0.01, inplace=inplace),
            )
        )
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def forward(net: nn.Sequential, x: torch.Tensor, mode: str) -> torch.Tensor:
    """The loss of `net` on `x`, with checkpointing `mode`."""
    if mode == "eager":
        out: torch.Tensor = net(x)
    elif mode == "region":
        with cg.save_recompute_policy(policy="recompute_all"):
            out = net(x)
    elif mode == "per-block":
        out = x
        for layer in net:
            if isinstance(layer, nn.Sequential):
                out = cg.checkpoint(layer, out, policy="recompute_all")
            else:
                out = layer(out)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return out.square().mean()


@dataclass(frozen=True)
class Row:
    variant: str
    mode: str
    kept_bytes: int
    peak_bytes: int
    forward_cpu_ms: float
    step_cpu_ms: float
    step_wall_ms: float


def run(variant: str, net: nn.Sequential, x: torch.Tensor, mode: str, repeats: int) -> Row:
    def step() -> None:
        forward(net, x, mode).backward()

    def clear() -> None:
        for p in net.parameters():
            p.grad = None

    clear()
    step()  # warm up (allocator, lazy initialisation)
    clear()
    loss, fwd = measure_with_result(forward, net, x, mode)
    del loss
    clear()
    report = measure(step)
    times_f: list[float] = []
    times_s: list[float] = []
    walls: list[float] = []
    for _ in range(repeats):
        clear()
        wall, start = time.perf_counter(), time.process_time()
        loss = forward(net, x, mode)
        mid = time.process_time()
        loss.backward()
        end = time.process_time()
        walls.append((time.perf_counter() - wall) * 1e3)
        times_f.append((mid - start) * 1e3)
        times_s.append((end - start) * 1e3)
    return Row(
        variant,
        mode,
        fwd.end_bytes,
        report.peak_bytes,
        statistics.median(times_f),
        statistics.median(times_s),
        statistics.median(walls),
    )


def table(rows: list[Row], unit: int, blocks: int) -> str:
    head = (
        "| variant | mode | kept after forward (MiB) | kept/block (units) | "
        "peak fwd+bwd (MiB) | peak (units) | forward CPU (ms) | fwd+bwd CPU (ms) | "
        "fwd+bwd wall (ms) |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.variant} | {r.mode} | {r.kept_bytes / _MIB:.1f} | "
        f"{r.kept_bytes / unit / blocks:.2f} | {r.peak_bytes / _MIB:.1f} | "
        f"{r.peak_bytes / unit:.2f} | {r.forward_cpu_ms:.0f} | {r.step_cpu_ms:.0f} | "
        f"{r.step_wall_ms:.0f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64, help="input height and width")
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    parser.add_argument("--modes", default="eager,region,per-block")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args(argv)

    x = torch.randn(args.batch, 3, args.size, args.size)
    unit = args.batch * args.channels * args.size * args.size * 4
    variants: list[tuple[str, Callable[[], nn.Sequential]]] = [
        ("bn+lrelu", lambda: make_cnn(args.channels, args.blocks, inplace=False)),
        ("bn+lrelu(inplace)", lambda: make_cnn(args.channels, args.blocks, inplace=True)),
        (
            "inplace_abn",
            lambda: convert_bn_act(make_cnn(args.channels, args.blocks, inplace=False)),
        ),
    ]
    rows = [
        run(name, make(), x, mode, args.repeats)
        for mode in args.modes.split(",")
        for name, make in variants
    ]
    report = (
        f"CNN: {args.blocks} x (Conv2d 3x3 {args.channels} ch -> norm + LeakyReLU(0.01)), "
        f"input {args.batch}x3x{args.size}x{args.size} float32, CPU, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads. 1 unit = one block activation = "
        f"{unit / _MIB:.1f} MiB.\n\n" + table(rows, unit, args.blocks)
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    main()
