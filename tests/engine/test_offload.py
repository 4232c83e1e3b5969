"""The offload bookkeeping of Note [Offload on CUDA], on CPU: which copy starts when, what
backward waits for, one value of prefetch, prefetched values released before being read.

The CUDA copier itself (pinned buffers, side stream, events) runs in tests/cuda/test_cuda.py;
here a copier that logs its calls stands in for it, so the logic above it runs in CI.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_graph.engine.graph import Handle
from ckpt_graph.engine.offload import Offloader, SyncCopies

DEVICE = torch.device("meta")  # a device that is not the host: values "live" there


class _LoggedCopies(SyncCopies):
    def __init__(self) -> None:
        self.log: list[tuple[str, float]] = []

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the test makes host copies itself")

    def copy_back(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        self.log.append(("copy", float(host[0])))
        return host.clone(), ("event", float(host[0]))

    def wait(self, value: torch.Tensor, event: Any, device: torch.device) -> None:
        assert event == ("event", float(value[0]))  # the event of this value's copy
        self.log.append(("wait", float(value[0])))


def _offloaded(off: Offloader, n: int) -> list[Handle]:
    """``n`` handles kept in host memory in forward order; handle i holds the value i."""
    handles = []
    for i in range(n):
        h = Handle(torch.zeros(2), i, 0)
        h.offload_device = DEVICE
        off._position[id(h)] = len(off.order)
        off.order.append(h)
        h.value = torch.full((2,), float(i))
        handles.append(h)
    return handles


def _read(off: Offloader, h: Handle) -> float:
    assert h.value is not None
    return float(off.to_device(h, h.value)[0])


def test_backward_order_reads_prefetched_values_without_a_new_copy() -> None:
    log = _LoggedCopies()
    off = Offloader(lambda device: log)
    a, b, c = _offloaded(off, 3)
    assert _read(off, c) == 2.0
    # c copied and waited for; b (kept just before c in the forward) prefetched at once
    assert log.log == [("copy", 2.0), ("wait", 2.0), ("copy", 1.0)]
    assert list(off.pending) == [id(b)]
    assert _read(off, b) == 1.0
    assert log.log[3:] == [("wait", 1.0), ("copy", 0.0)]  # no second copy of b
    assert _read(off, a) == 0.0
    assert log.log[5:] == [("wait", 0.0)]  # nothing before a: no prefetch
    assert not off.pending
    assert off.copies == 3
    assert list(off.copiers) == [DEVICE]


def test_one_value_of_lookahead_and_released_values_are_dropped() -> None:
    log = _LoggedCopies()
    off = Offloader(lambda device: log)
    _, b, c, d = _offloaded(off, 4)
    _read(off, d)  # prefetches c
    _read(off, b)  # out of order: b copied now; c still pending, so nothing more starts
    assert log.log == [("copy", 3.0), ("wait", 3.0), ("copy", 2.0), ("copy", 1.0), ("wait", 1.0)]
    assert list(off.pending) == [id(c)]
    c.value = None  # released (autograd freed every saved tensor that needed it)
    _read(off, d)  # a second read (retain_graph): the released prefetch is dropped first
    assert list(off.pending) == [id(b)]  # the value before d that is still held
    off.clear()
    assert not off.pending


def test_host_tensors_are_kept_as_they_are() -> None:
    off = Offloader()
    t = torch.ones(3)
    h = Handle(t, 0, 0)
    assert off.to_host(h, t) is t  # already in host memory: no copy, nothing to prefetch
    assert off.copies == 0 and not off.order


class _MetaCopies(SyncCopies):
    """Host copies on the meta device (nothing to copy), numbered in the order kept; the
    region holds an alias of each, so they are told apart by their (distinct) shapes."""

    def __init__(self) -> None:
        self.kept: dict[tuple[int, ...], int] = {}  # shape -> position in the forward
        self.hosts: list[torch.Tensor] = []
        self.back: list[int] = []

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = t.clone()
        self.kept[tuple(host.shape)] = len(self.hosts)
        self.hosts.append(host)
        return host

    def copy_back(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        self.back.append(self.kept[tuple(host.shape)])
        return host.clone(), None


def test_a_region_copies_each_offloaded_value_back_once_in_backward_order() -> None:
    """The whole path through a region (hold, unpack, realize, release) on a device that is
    not the host, with no values: the meta device."""
    import ckpt_graph as cg
    from ckpt_graph import policies

    aten = torch.ops.aten
    layers: list[torch.nn.Module] = []
    for i in range(3):  # every matmul output of its own shape
        layers += [torch.nn.Linear(8 + i, 16 + i), torch.nn.GELU(), torch.nn.Linear(16 + i, 9 + i)]
    model = torch.nn.Sequential(*layers).to("meta")
    copies = _MetaCopies()
    with cg.save_recompute_policy("recompute_all") as region:
        region.offloader().copiers[DEVICE] = copies
        matmuls = policies.offload(lambda ctx, out, op, *a, **k: op is aten.addmm.default)
        with cg.save_recompute_policy(matmuls):
            loss = model(torch.randn(4, 8, device="meta")).pow(2).mean()
    kept = [h for n in region.nodes if n.op is aten.addmm.default for h in n.outputs]
    assert len(kept) == len(copies.hosts) == 6
    assert all(h is not None and h.offload_device == DEVICE for h in kept)
    loss.backward()
    # each value once (GELU's input is read twice in a row: copied once), last kept first
    assert copies.back == [5, 4, 3, 2, 1, 0]
    off = region.offloader()
    assert off.copies == 12 and not off.pending
    assert all(p.grad is not None for p in model.parameters())
