"""Worker of the distributed tests: one process of a 2-process gloo group on localhost.

Each rank checks its own result against a single-process run without checkpointing of the
same model on both ranks' batches (gradient = mean of the two per-batch gradients), and
reports ``None`` or the error text through the queue.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

WIDTH, DEPTH, BATCH = 16, 3, 32


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def make_batch(rank: int) -> torch.Tensor:
    return torch.randn(
        BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
    )


def reference_grads(world: int) -> dict[str, torch.Tensor]:
    model = make_model()
    total: dict[str, torch.Tensor] = {}
    for r in range(world):
        model.zero_grad(set_to_none=True)
        model(make_batch(r)).sum().backward()
        for n, p in model.named_parameters():
            assert p.grad is not None
            total[n] = total[n] + p.grad if n in total else p.grad.clone()
    return {n: g / world for n, g in total.items()}


class CountRegions:
    """Recompute everything; count the regions entered.

    It answers ``False`` (recompute): a policy that keeps ``t(weight)`` currently hits core bug 11
    (false version error once parameters were updated in place, as DDP's broadcast does).
    """

    def __init__(self) -> None:
        self.entered = 0

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        return False

    def on_region_enter(self, region: Any) -> None:
        self.entered += 1


def _check_regions(policy: CountRegions, steps: int) -> None:
    if policy.entered != steps * DEPTH:
        raise AssertionError(f"{policy.entered} regions for {steps} steps of {DEPTH} blocks")


def _ddp(rank: int, world: int, order: str) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    from ckpt_graph.integrations.wrap import wrap

    policy = CountRegions()
    model = wrap(make_model(), policy=policy)
    ddp = DistributedDataParallel(model)
    for _ in range(2):  # a second step: buckets rebuilt, regions reused per step
        model.zero_grad(set_to_none=True)
        ddp(make_batch(rank)).sum().backward()
    _check_regions(policy, 2)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _fsdp(rank: int, world: int, order: str) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    from ckpt_graph.integrations.wrap import is_wrapped, wrap

    model = make_model()
    policy = CountRegions()
    if order == "wrap_first":
        wrap(model, policy=policy)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    if order == "shard_first":
        wrap(model, policy=policy)
    if not all(is_wrapped(b) for b in model.blocks):
        raise AssertionError("blocks are not wrapped")
    if not type(model.blocks[0]).__name__.startswith("FSDP"):
        raise AssertionError(f"fully_shard did not swap the class: {type(model.blocks[0])}")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(make_batch(rank)).sum().backward()
    _check_regions(policy, 2)
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}  # type: ignore[attr-defined]


def run(rank: int, world: int, port: int, kind: str, queue: Any) -> None:
    """Process entry point: run ``kind`` ("ddp" or "fsdp") and put the outcome in ``queue``.

    "fsdp" runs twice: ``wrap`` applied before ``fully_shard``, then after.
    """
    try:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            expected = reference_grads(world)
            for order in ("wrap_first", "shard_first") if kind == "fsdp" else ("",):
                got = (_ddp if kind == "ddp" else _fsdp)(rank, world, order)
                if got.keys() != expected.keys():
                    raise AssertionError(f"parameters differ: {sorted(got)} vs {sorted(expected)}")
                for name, g in expected.items():
                    torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=f"{order} {name}")
        finally:
            dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
