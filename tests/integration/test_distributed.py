"""DDP and FSDP2 (``fully_shard``) on 2 gloo processes with wrapped blocks: exact gradients."""

from __future__ import annotations

import queue as queue_mod
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _dist_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]
WORLD = 2
TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(kind: str) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_dist_worker.run, args=(r, WORLD, port, kind, results))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    errors: dict[int, str | None] = {}
    try:
        for _ in range(WORLD):
            rank, err = results.get(timeout=TIMEOUT_S)
            errors[rank] = err
    except queue_mod.Empty:
        pytest.fail(f"{kind}: no result from every rank within {TIMEOUT_S:.0f} s: {errors}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: e for r, e in errors.items() if e is not None}
    assert not failed, "\n".join(f"rank {r}:\n{e}" for r, e in failed.items())


def test_ddp_gradients_equal_single_process() -> None:
    _launch("ddp")


def test_fsdp2_gradients_equal_single_process() -> None:
    """``wrap`` before and after ``fully_shard`` (which swaps each block's class)."""
    _launch("fsdp")
