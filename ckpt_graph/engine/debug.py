"""``debug=True``: check that recomputed values equal the forward's.

# Note [Replay checks]
# With ``save_recompute_policy(..., debug=True)`` the recorder stores, per op output, a
# checksum of the forward value (a float64 sum of the values and of their squares, with
# the value count; no tensor is kept) and the Python stack of the forward call. Every op
# recomputed in backward compares its outputs' checksums with the forward's, and the
# first mismatch raises an error that names the op, its forward position and where the
# forward called it. Outputs of ops that leave memory uninitialised (``empty*``) are not
# checked. This catches recomputation that diverged from the forward: a kept input changed
# behind the engine's back, nondeterministic kernels, data-dependent branches in custom ops.
#
# Note [Kept value checks]
# A write through ``.data`` (``w.data.mul_(2)`` between forward and backward) changes a
# kept value's storage without bumping the version counter the engine compares (see
# ``realize._check_version``), so recomputation silently uses the new values where eager
# would have used the forward's (torch.utils.checkpoint has the same blind spot). With
# ``debug=True`` the region takes the checksum of every value it still keeps (region
# inputs such as parameters, values kept by policy or tag) when it exits, and compares it
# each time backward reads that kept value, before any op uses it. A difference while the
# version is unchanged can only come from an alias with a version counter of its own, so
# the error names ``.data``, the value and the fix. Values kept in host memory (offload)
# are copies, untouched by such writes, and are not checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph._errors import CkptGraphError

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["check_kept", "check_replay", "checksums", "kept_checksums"]

_UNINITIALISED = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)


def _checksum(t: Any) -> tuple[float, float, float] | None:
    """Sum, sum of squares and a sum weighted by position: a write through ``.data`` that
    only moves values (``w.data.copy_(w.data.flip(0))``) changes the last one."""
    if not isinstance(t, torch.Tensor) or t.is_complex() or t.device.type == "meta":
        return None
    with torch.no_grad():
        v = t.detach().to(torch.float64).reshape(-1)
        place = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device)
        return float(v.sum()), float((v * v).sum()), float((v * place).sum())


def checksums(outs: Sequence[Any]) -> tuple[tuple[float, float, float] | None, ...]:
    """Checksums of an op's outputs (``None`` for non-tensors)."""
    return tuple(_checksum(o) for o in outs)


def kept_checksums(region: Region) -> dict[Handle, tuple[float, float, float]]:
    """Checksums of the values ``region`` keeps, at its exit. See Note [Kept value checks]."""
    sums: dict[Handle, tuple[float, float, float]] = {}
    handles = list(region.inputs)
    handles += [o for node in region.nodes for o in node.outputs if o is not None]
    for h in handles:
        if h.value is not None and h.offload_device is None:
            c = _checksum(h.value)
            if c is not None:
                sums[h] = c
    return sums


def check_kept(region: Region, h: Handle, value: torch.Tensor) -> None:
    """Raise if a kept value changed since the region exited. See Note [Kept value checks]."""
    expected = region.kept_sums.get(h)
    if expected is None:
        return
    got = _checksum(value)
    if got is None or got == expected:
        return
    if h.node_index < 0:
        t = h.ref() if h.ref is not None else None
        kind = "a parameter" if isinstance(t, torch.nn.Parameter) else "a tensor"
        what = f"{kind} used by the region (region input #{h.input_index})"
    else:
        what = (
            f"output {h.output_index} of op #{h.node_index} {region.nodes[h.node_index].info.name}"
        )
    raise CkptGraphError(
        f"ckpt_graph: debug check failed: {what} [{h.dtype} {list(h.shape)}] was modified "
        "after the region's forward without a version change (checksum "
        f"{got} vs {expected}), which only a write through `.data` (or another alias with a "
        "version counter of its own) does. Backward would recompute with the new values and "
        "give gradients different from eager. Modify it after backward (as optimizers do), "
        "or write to the tensor itself under torch.no_grad(), which the version check reports."
    )


def check_replay(node: OpNode, outs: Sequence[Any]) -> None:
    """Raise if a recomputed output differs from the forward's. See Note [Replay checks]."""
    if node.checksums is None or node.op.name() in _UNINITIALISED:
        return
    for j, (expected, o) in enumerate(zip(node.checksums, outs, strict=True)):
        got = _checksum(o)
        if expected is None or got is None or got == expected:
            continue
        if all(_close(a, b) for a, b in zip(got, expected, strict=True)):
            continue
        where = f"\nForward call:\n{node.stack}" if node.stack else ""
        raise CkptGraphError(
            f"ckpt_graph: debug check failed: recomputing op #{node.index} {node.info.name} "
            f"(output {j}) gave a different value than in the forward (checksum {got} vs "
            f"{expected}). This is the first op whose recomputation diverged. Keep its inputs "
            "(tag_with_policy(t, True)) or make the op deterministic." + where
        )


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)
