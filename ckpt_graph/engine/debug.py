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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph._errors import CkptGraphError

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode

__all__ = ["check_replay", "checksums"]

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
    if not isinstance(t, torch.Tensor) or t.is_complex() or t.device.type == "meta":
        return None
    with torch.no_grad():
        v = t.detach().to(torch.float64)
        return float(v.sum()), float((v * v).sum()), float(t.numel())


def checksums(outs: Sequence[Any]) -> tuple[tuple[float, float, float] | None, ...]:
    """Checksums of an op's outputs (``None`` for non-tensors)."""
    return tuple(_checksum(o) for o in outs)


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
