"""DistributedDataParallel with ckpt_graph regions inside the model (2 CPU processes, gloo).

``ckpt_graph.wrap`` runs each block's forward in its own region; DDP is applied on top as
usual (``fully_shard`` from ``torch.distributed.fsdp`` composes the same way, before or after
``wrap``). Each process trains on its own batches; at the end rank 0 checks that both ranks hold
the same parameters and prints the peak memory of one step with and without checkpointing.

Run (no torchrun needed; everything stays on 127.0.0.1):
    python examples/ddp.py --steps 20
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckpt_graph.integrations.wrap import unwrap, wrap
from ckpt_graph.memory import measure


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, d: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def worker(rank: int, world: int, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
    model = wrap(Net())  # each block's forward in its own region
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    target = nn.Linear(64, 1)
    torch.nn.init.constant_(target.weight, 0.1)

    def step(x: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = (ddp(x) - target(x).detach()).pow(2).mean()
        loss.backward()  # gradients are all-reduced between the ranks
        opt.step()
        return float(loss.detach())

    for i in range(steps):
        loss = step(torch.randn(256, 64, generator=gen))
        if rank == 0 and (i % 5 == 4 or i == steps - 1):
            print(f"step {i + 1:3d}  loss (rank 0 batch) {loss:.4f}", flush=True)

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    x = torch.randn(256, 64, generator=gen)
    peak = measure(step, x).peak_bytes
    unwrap(model)
    plain = measure(step, x).peak_bytes
    if rank == 0:
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        print(f"parameters identical on all ranks: {same}")
        print(
            f"peak memory of one step: {peak / 2**20:.2f} MiB with regions per block, "
            f"{plain / 2**20:.2f} MiB without ({peak / plain:.0%})"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args.steps), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
