"""Recording overhead: µs per op on a long chain of tiny ops, forward and forward + backward.

The chain is ``x = x * 1.0001 + sin(x)`` (3 aten ops per step) on a small tensor, so the time is
all per-op overhead: Python, dispatch, autograd, and whatever each checkpointing method adds.
Methods run interleaved (one repeat of every method, then the next repeat) so that ratios are
measured side by side; the figure is the median process CPU time over repeats (wall time in
parentheses), divided by the number of aten ops of the forward. Prints a markdown section on
stdout, progress on stderr.

Usage:
    python benchmarks/bench_overhead.py [--ops 2000] [--repeat 11] [--size 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import ckpt_graph as cg

X = "\u00d7"  # multiplication sign


class _EmptyMode(TorchDispatchMode):
    """Runs every op unchanged: the bare cost of a Python dispatch mode."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _chain(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = x * 1.0001 + torch.sin(x)
    return x


def _recompute_everything(ctx: object, op: object, *args: object, **kwargs: object) -> Any:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _methods(steps: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    chain = functools.partial(_chain, steps=steps)

    def empty_mode(x: torch.Tensor) -> torch.Tensor:
        with _EmptyMode():
            return chain(x)

    def torch_ckpt(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(chain, x, use_reentrant=False)  # type: ignore[no-any-return]

    sac_ctx = functools.partial(create_selective_checkpoint_contexts, _recompute_everything)

    def torch_sac(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(chain, x, use_reentrant=False, context_fn=sac_ctx)  # type: ignore[no-any-return]

    def ckpt_graph(x: torch.Tensor) -> torch.Tensor:
        with cg.save_recompute_policy(policy="recompute_all"):
            return chain(x)

    def ckpt_graph_fn(x: torch.Tensor) -> torch.Tensor:
        # A Python policy function, asked for every op, as torch SAC's policy is.
        with cg.save_recompute_policy(policy=_recompute_everything_cg):
            return chain(x)

    return {
        "plain autograd": chain,
        "empty TorchDispatchMode": empty_mode,
        "torch.utils.checkpoint": torch_ckpt,
        "torch selective checkpointing (PREFER_RECOMPUTE)": torch_sac,
        "ckpt_graph (recompute_all)": ckpt_graph,
        "ckpt_graph (policy function)": ckpt_graph_fn,
    }


def _recompute_everything_cg(
    ctx: object, out: object, op: object, *args: object, **kwargs: object
) -> Any:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _time(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, backward: bool
) -> tuple[float, float]:
    """Wall time and process CPU time of one call (CPU time is steadier on a loaded machine)."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    y = fn(x)
    if backward:
        y.sum().backward()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    del y
    x.grad = None
    return elapsed, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="aten ops in the forward chain")
    parser.add_argument("--repeat", type=int, default=11, help="repeats (median)")
    parser.add_argument("--size", type=int, default=16, help="elements of the tensor")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = max(1, args.ops // 3)
    x = torch.randn(args.size, dtype=torch.float32, requires_grad=True)
    counter = _Count()
    with counter:
        _chain(x, steps)
    n_ops = counter.n
    methods = _methods(steps)
    ref = _chain(x, steps)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    for name, fn in methods.items():  # warm-up, and every method must give the same gradient
        y = fn(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(g, ref_grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    wall: dict[tuple[str, bool], list[float]] = {}
    cpu: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.repeat):
        print(f"repeat {r + 1}/{args.repeat}", file=sys.stderr)
        for name, fn in methods.items():
            for backward in (False, True):
                t, c = _time(fn, x, backward)
                wall.setdefault((name, backward), []).append(t)
                cpu.setdefault((name, backward), []).append(c)
    us = {k: statistics.median(v) / n_ops * 1e6 for k, v in cpu.items()}
    us_wall = {k: statistics.median(v) / n_ops * 1e6 for k, v in wall.items()}
    plain_f, plain_b = us["plain autograd", False], us["plain autograd", True]
    print("## Recording overhead (bench_overhead.py)\n")
    print(
        f"Chain of {n_ops} tiny aten ops (`x = x * 1.0001 + sin(x)`, {args.size} float32 "
        f"elements, {args.threads} thread(s)); median of {args.repeat} interleaved repeats; "
        "µs of process CPU time per forward op (forward+backward time is also divided by the "
        "forward's op count); wall-clock µs/op in parentheses.\n"
    )
    print(f"| method | forward µs/op | {X} plain | fwd+bwd µs/op | {X} plain |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in methods:
        f, b = us[name, False], us[name, True]
        fw, bw = us_wall[name, False], us_wall[name, True]
        print(
            f"| {name} | {f:.2f} ({fw:.2f}) | {f / plain_f:.2f} | {b:.2f} ({bw:.2f}) "
            f"| {b / plain_b:.2f} |"
        )
    sac = "torch selective checkpointing (PREFER_RECOMPUTE)"
    mine = "ckpt_graph (recompute_all)"
    fn = "ckpt_graph (policy function)"
    print(
        f"\nckpt_graph / torch selective checkpointing (CPU time): forward "
        f"{us[mine, False] / us[sac, False]:.2f}{X}, forward+backward "
        f"{us[mine, True] / us[sac, True]:.2f}{X} (performance bar: forward ≤ 1.00{X}); "
        f"with a policy function like SAC's: forward {us[fn, False] / us[sac, False]:.2f}{X}, "
        f"forward+backward {us[fn, True] / us[sac, True]:.2f}{X}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
