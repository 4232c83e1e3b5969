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
#      (device memory of one value). A prefetched value whose handle is released before it is
#      read is dropped.
#   5. A CPU tensor is "offloaded" by being kept as it is (it is in host memory already);
#      other devices copy synchronously with ``Tensor.to``.
# Known limitations: one value of lookahead, chosen by forward order, not by the backward's
# actual order (a backward that reads values in another order waits for each copy); a value
# offloaded and written in place afterwards is copied as it was when kept (the version check
# then raises, as for any kept value).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle

__all__ = ["Offloader"]


class Offloader:
    """The copies of one region's offloaded values. See Note [Offload on CUDA].

    Attributes:
        order: offloaded handles in the order the forward kept them (prefetch order).
        pending: prefetched device copies not yet read: handle -> (tensor, event).
        copies: copies started (to host and back); read by tests and benchmarks.
    """

    def __init__(self) -> None:
        self.order: list[Handle] = []
        self._position: dict[int, int] = {}  # id(handle) -> index in ``order``
        self.pending: dict[int, tuple[Handle, torch.Tensor, Any]] = {}
        self._streams: dict[int, Any] = {}
        self.copies = 0

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def to_host(self, h: Handle, t: torch.Tensor) -> torch.Tensor:
        """The host copy of ``t`` kept for ``h`` (rules 1, 2 and 5)."""
        if t.device.type == "cpu":
            return t
        self._position[id(h)] = len(self.order)
        self.order.append(h)
        self.copies += 1
        if t.device.type != "cuda":
            return t.to("cpu")
        side = self._stream(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
        t.record_stream(side)
        return host

    def to_device(self, h: Handle, host: torch.Tensor) -> torch.Tensor:
        """The device value of the offloaded ``h`` for backward to use (rules 3 and 4)."""
        device = h.offload_device
        assert device is not None
        if device.type != "cuda":
            self.copies += 1
            return host.to(device)
        entry = self.pending.pop(id(h), None)
        if entry is None:
            value, event = self._copy_back(h, host, device)
        else:
            _, value, event = entry
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        value.record_stream(current)
        self._prefetch_before(h)
        return value

    def _copy_back(
        self, h: Handle, host: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, Any]:
        side = self._stream(device)
        with torch.cuda.stream(side):
            value = torch.empty_like(host, device=device)
            value.copy_(host, non_blocking=True)
            event = side.record_event()
        self.copies += 1
        return value, event

    def _prefetch_before(self, h: Handle) -> None:
        """Start copying back the offloaded value kept just before ``h`` (rule 4)."""
        for key in [k for k, (p, _, _) in self.pending.items() if p.value is None]:
            del self.pending[key]  # released before it was read
        if self.pending:
            return  # one value of lookahead
        at = self._position.get(id(h), 0) - 1
        while at >= 0:
            prev = self.order[at]
            host = prev.value
            if host is not None and prev.offload_device is not None:
                value, event = self._copy_back(prev, host, prev.offload_device)
                self.pending[id(prev)] = (prev, value, event)
                return
            at -= 1

    def clear(self) -> None:
        """Drop every prefetched value (the region released its values)."""
        self.pending.clear()
