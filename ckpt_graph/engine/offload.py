"""Values kept in host memory (``*_CPU_OFFLOAD`` decisions): copies off and back.

# Note [Offload on CUDA]
# A value a policy offloads is copied to host memory when the region keeps it, and back to
# its device when backward reads it. On CUDA an offload is worth its name only if the copies
# leave the compute stream alone and land in memory the copy engine can use:
#   1. The host buffer is pinned (page-locked): only then is a copy asynchronous. It comes
#      from torch's caching host allocator (``empty_like(..., pin_memory=True)``), which
#      reuses pinned blocks and does not hand one out again while a copy still uses it.
#   2. Copies run on a side stream, one per device and region, that first waits for the
#      compute stream (the value must have been computed). The forward tensor is marked as
#      used by the side stream (``record_stream``), so the caching allocator does not give
#      its memory to a later op of the compute stream before the copy has read it: the
#      forward frees it as usual and the compute stream never waits for the copy.
#   3. Copying back also runs on the side stream, into a device tensor allocated there; an
#      event recorded after the copy is what the compute stream waits for before the value
#      is used (``wait_event``, no host synchronisation), and the tensor is marked as used
#      by the compute stream, which frees it.
#   4. Prefetch: when backward reads an offloaded value, the copy back of the offloaded value
#      kept just before it in the forward starts at once, since backward runs the forward in
#      reverse. Backward's compute overlaps that copy; at most one value is prefetched ahead
#      (device memory of one value). A prefetched value whose handle is freed before it is
#      read is freed too.
#   5. The value read last stays on the device until another offloaded value is read: a
#      value read twice in a row (by the recompute of a value derived from it, then by the
#      saved tensor itself, as GELU's input is in a Linear-GELU-Linear block) is copied back
#      once. That holds one more value on the device, at most, until the region frees its values.
#   6. A CPU tensor is "offloaded" by being kept as it is (it is in host memory already);
#      other devices copy synchronously with ``Tensor.to``.
# Known limitations: one value of lookahead, chosen by forward order, not by the backward's
# actual order (a backward that reads values in another order waits for each copy); a value
# read twice with another offloaded value read in between is copied back twice; a value
# offloaded and written in place afterwards is copied as it was when kept (the version check
# then raises, as for any kept value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle

__all__ = ["CudaCopies", "Offloader", "SyncCopies"]


class SyncCopies:
    """Copies for a device without streams here: ``Tensor.to``, nothing to wait for (rule 6)."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t``."""
        return t.to("cpu")

    def copy_back(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` to ``device``: the device tensor and what to wait for."""
        return host.to(device), None

    def wait(self, value: torch.Tensor, event: Any, device: torch.device) -> None:
        """Make the compute stream wait for ``event`` before it uses ``value``."""


class CudaCopies(SyncCopies):
    """Copies on a side stream into pinned host memory, with events (rules 1-3).

    One per region and device: the side stream is the region's own.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # its memory is not reused before the copy read it
        return host

    def copy_back(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            value = torch.empty_like(host, device=device)
            value.copy_(host, non_blocking=True)
            event = self.stream.record_event()
        return value, event

    def wait(self, value: torch.Tensor, event: Any, device: torch.device) -> None:
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        value.record_stream(current)  # allocated on the side stream, freed by this one


def _copies_for(device: torch.device) -> SyncCopies:
    if device.type == "cuda":
        return CudaCopies(device)
    return SyncCopies()


class Offloader:
    """The copies of one region's offloaded values. See Note [Offload on CUDA].

    Args:
        copies_for: makes the copier of a device (once per device); the default gives
            :class:`CudaCopies` on CUDA and :class:`SyncCopies` elsewhere.

    Attributes:
        order: offloaded handles in the order the forward kept them (prefetch order).
        pending: the prefetched copy not read yet: id(handle) -> (handle, tensor, event).
        copies: copies started (to host and back); read by tests and benchmarks.
        copiers: the copier of each device used so far.
    """

    def __init__(self, copies_for: Callable[[torch.device], SyncCopies] = _copies_for) -> None:
        self.order: list[Handle] = []
        self._position: dict[int, int] = {}  # id(handle) -> index in ``order``
        self.pending: dict[int, tuple[Handle, torch.Tensor, Any]] = {}
        self.copiers: dict[torch.device, SyncCopies] = {}
        self._copies_for = copies_for
        self._last: tuple[Handle, torch.Tensor] | None = None  # the value read last
        self.copies = 0

    def _copier(self, device: torch.device) -> SyncCopies:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        copier = self.copiers.get(device)
        if copier is None:
            copier = self.copiers[device] = self._copies_for(device)
        return copier

    def to_host(self, h: Handle, t: torch.Tensor) -> torch.Tensor:
        """The host copy of ``t`` kept for ``h`` (rules 1, 2 and 6)."""
        if t.device.type == "cpu":
            return t
        self._position[id(h)] = len(self.order)
        self.order.append(h)
        self.copies += 1
        return self._copier(t.device).to_host(t)

    def to_device(self, h: Handle, host: torch.Tensor) -> torch.Tensor:
        """The device value of the offloaded ``h`` for backward to use (rules 3 to 5)."""
        device = h.offload_device
        assert device is not None
        last = self._last
        if last is not None and last[0] is h:
            return last[1]  # rule 5: read again at once, copied once
        copier = self._copier(device)
        entry = self.pending.pop(id(h), None)
        if entry is None:
            self.copies += 1
            value, event = copier.copy_back(host, device)
        else:
            _, value, event = entry
        copier.wait(value, event, device)
        self._last = (h, value)
        self._prefetch_before(h)
        return value

    def _prefetch_before(self, h: Handle) -> None:
        """Start copying back the offloaded value kept just before ``h`` (rule 4)."""
        for key in [k for k, (p, _, _) in self.pending.items() if p.value is None]:
            del self.pending[key]  # freed before it was read
        if self.pending:
            return  # one value of lookahead
        at = self._position.get(id(h), 0) - 1
        while at >= 0:
            prev = self.order[at]
            host = prev.value
            device = prev.offload_device
            if host is not None and device is not None:
                self.copies += 1
                value, event = self._copier(device).copy_back(host, device)
                self.pending[id(prev)] = (prev, value, event)
                return
            at -= 1

    def clear(self) -> None:
        """Free every value copied back (the region freed its values)."""
        self.pending.clear()
        self._last = None
