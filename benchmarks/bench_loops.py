"""Loops of in-place writes: time and peak memory grow linearly with the number of steps.

Two loops that RNN and decoding code is written as (issue 14, items 12 and 13):

- ``fill``: an output buffer filled one step at a time,
  ``out = zeros(B, T, H); for t: h = tanh(x[:, t] @ W + h); out[:, t] = h``;
- ``view``: ``n`` in-place updates through one view of a tensor, ``v = y[1]; v.mul_(c)``.

Each loop runs at a size and at ``--scale`` times that size, eagerly and inside
``save_recompute_policy("recompute_all")``; the table gives the median forward+backward time
(process CPU time) over ``--repeat`` runs, the ratio large/small (``--scale`` means linear), and
the peak memory of one run measured with ``ckpt_graph.memory.measure``. Prints markdown.

Usage:
    python benchmarks/bench_loops.py [--steps 100] [--scale 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ckpt_graph as cg
from ckpt_graph.memory import measure


def fill(steps: int, policy: str | None) -> Callable[[], None]:
    """The buffer-filling loop of an RNN, ``steps`` steps, batch 8, hidden size 32."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, steps, 32, generator=gen, requires_grad=True)
    w = torch.randn(32, 32, generator=gen).div_(8).requires_grad_()

    def run() -> None:
        scope: Any = cg.save_recompute_policy(policy) if policy else contextlib.nullcontext()
        with scope:
            h = torch.zeros(8, 32)
            out = torch.zeros(8, steps, 32)
            for t in range(steps):
                h = torch.tanh(x[:, t] @ w + h)
                out[:, t] = h
        (out * out).sum().backward()

    return run


def view(steps: int, policy: str | None) -> Callable[[], None]:
    """``steps`` in-place updates through one view."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def run() -> None:
        scope: Any = cg.save_recompute_policy(policy) if policy else contextlib.nullcontext()
        with scope:
            y = x * 1
            v = y[1]
            for _ in range(steps):
                v.mul_(1.0001)
        (y * y).sum().backward()

    return run


def _time(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of the small loop")
    parser.add_argument("--scale", type=int, default=4, help="large loop / small loop")
    parser.add_argument("--repeat", type=int, default=3, help="repeats (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    small, large = args.steps, args.steps * args.scale
    print("## In-place loops (bench_loops.py)\n")
    print(
        f"Steps {small} and {large}; median process CPU time of forward+backward over "
        f"{args.repeat} runs; peak measured with `ckpt_graph.memory.measure`.\n"
    )
    print(
        "| loop | method | time small (ms) | time large (ms) | large / small | peak small (KiB) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, make in (("fill", fill), ("view", view)):
        for label, policy in (("eager", None), ("ckpt_graph recompute_all", "recompute_all")):
            make(small, policy)()  # warm-up
            t_small = _time(make(small, policy), args.repeat)
            t_large = _time(make(large, policy), args.repeat)
            peak = measure(make(small, policy)).peak_bytes
            print(
                f"| {name} | {label} | {t_small * 1e3:.1f} | {t_large * 1e3:.1f} | "
                f"{t_large / t_small:.2f} | {peak / 1024:.0f} |"
            )
    print(f"\nLinear growth is a ratio of about {args.scale}.")


if __name__ == "__main__":
    main()
