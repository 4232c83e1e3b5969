"""Whether two tensors on one storage may share an element (Note [Mutation and views], rule 4).

Before an in-place op writes a storage, ``mutation.before_write`` copies only the kept values of
that storage the write may touch: the gates of nn.LSTM are chunks of one tensor written one
after another, and each write leaves the others alone.
"""

from __future__ import annotations

import torch

__all__ = ["overlap"]


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one storage may share an element; exact for strided views
    such as slices and chunks of one tensor, conservative (``True``) otherwise.

    See Note [Mutation and views], rule 4.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.dtype != b.dtype:
        return _span_overlap(a, b)
    # Element sets {offset + sum(i_d * stride_d)}. Dims of size 1 or stride 0 add nothing.
    sa = {st: n for n, st in zip(a.shape, a.stride(), strict=True) if n > 1 and st > 0}
    sb = {st: n for n, st in zip(b.shape, b.stride(), strict=True) if n > 1 and st > 0}
    if len(sa) != sum(1 for n, st in zip(a.shape, a.stride(), strict=True) if n > 1 and st > 0):
        return True  # two dims with one stride: the tensor overlaps itself
    if len(sb) != sum(1 for n, st in zip(b.shape, b.stride(), strict=True) if n > 1 and st > 0):
        return True
    strides = sorted(sa.keys() | sb.keys(), reverse=True)
    delta = int(b.storage_offset()) - int(a.storage_offset())
    # Write b's offset in a's coordinates: b's element j sits at coordinate q + j.
    q: list[int] = []
    rest = abs(delta)
    for st in strides:
        q.append(rest // st)
        rest -= q[-1] * st
    if rest:
        return _span_overlap(a, b)
    sign = 1 if delta >= 0 else -1
    lo: list[int] = []
    hi: list[int] = []
    disjoint = False
    for st, qd in zip(strides, q, strict=True):
        na, nb, qd = sa.get(st, 1), sb.get(st, 1), sign * qd
        lo.append(min(0, qd))
        hi.append(max(na, qd + nb))
        if qd >= na or qd + nb <= 0:
            disjoint = True  # the two boxes do not meet along this dim
    if not disjoint:
        return True
    # Coordinates are unique in the union box when each stride exceeds the span of the
    # smaller ones; then disjoint boxes are disjoint element sets.
    inner = 0
    for st, low, high in zip(reversed(strides), reversed(lo), reversed(hi), strict=True):
        if st <= inner:
            return _span_overlap(a, b)
        inner += st * (high - low - 1)
    return False


def _span_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges between the first and last elements of two tensors meet."""
    sa, sb = _span(a), _span(b)
    return sa[0] < sb[1] and sb[0] < sa[1]


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = int(t.storage_offset())
    end = start + 1
    for n, stride in zip(t.shape, t.stride(), strict=True):
        end += (int(n) - 1) * int(stride)
    size = t.element_size()
    return start * size, end * size
