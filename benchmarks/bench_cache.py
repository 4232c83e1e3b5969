"""The README's first example, measured: one ``recompute_all`` region over a whole model.

For each embedded model (``ckpt_graph.compare.zoo``, default sizes: 8 blocks) one training
step runs under: no checkpointing; ``torch.utils.checkpoint`` per block (non-reentrant: the
``compare`` strategy torch-ckpt); one ckpt_graph ``recompute_all`` region over the whole
model with the bounded recompute cache (automatic ``cache_limit``,
see Note [Bounded recompute cache]); and the same region with ``cache_limit="unbounded"``
(every recomputed value cached until its last use, the behaviour before the bound). Peaks
are measured with ``ckpt_graph.memory.measure`` after a warm-up step (gradients allocated in
the step count). The recompute ratio is the number of op runs in backward divided by the
number of aten ops of the forward, both counted by the region (``PassState.recomputed_ops``,
``len(region.nodes)``); torch per block runs each block's forward once more, about 1 by
construction. Prints a markdown table on stdout; about 15 s of CPU time on one thread.

Usage:
    python benchmarks/bench_cache.py [--models gpt mlp] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import ckpt_graph as cg
from ckpt_graph.compare.strategies import Forward, make_forward
from ckpt_graph.compare.zoo import Workload, build_workload
from ckpt_graph.memory import measure

MIB = 2**20


def _step(w: Workload, forward: Forward) -> Callable[[], None]:
    def step() -> None:
        w.model.zero_grad(set_to_none=True)
        w.loss(forward()).backward()

    return step


def _one_region(w: Workload, stats: dict[str, int], **options: Any) -> Callable[[], None]:
    def step() -> None:
        w.model.zero_grad(set_to_none=True)
        with cg.save_recompute_policy("recompute_all", **options) as region:
            loss = w.loss(w.model(*w.inputs))
        loss.backward()
        stats["ops"] = len(region.nodes)
        stats["recomputed"] = region.pass_state.recomputed_ops

    return step


def _peak(step: Callable[[], None]) -> int:
    step()
    return measure(step).peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "mlp"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| model | none (MiB) | torch per block (MiB) | cg one region, bounded (MiB) "
        "| cg one region, unbounded (MiB) | cg recompute ratio (bounded) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        w = build_workload(name)
        none = _peak(_step(w, make_forward("none", w)))
        per_block = _peak(_step(w, make_forward("torch-ckpt", w)))
        bounded_stats: dict[str, int] = {}
        bounded = _peak(_one_region(w, bounded_stats))
        unbounded = _peak(_one_region(w, {}, cache_limit="unbounded"))
        ratio = bounded_stats["recomputed"] / bounded_stats["ops"]
        print(
            f"| {name} | {none / MIB:.1f} | {per_block / MIB:.1f} | {bounded / MIB:.1f} "
            f"| {unbounded / MIB:.1f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
