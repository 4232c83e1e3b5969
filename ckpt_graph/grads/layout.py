"""Layout of flat gradient buffers: one slot per parameter (see ``ckpt_graph.grads``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ckpt_graph._errors import CkptGraphTypeError, CkptGraphValueError

__all__ = ["ALIGN_BYTES", "Slot", "SlotState", "collect_params", "slot_stride"]


class SlotState(enum.Enum):
    """What a parameter's slice of the buffer holds during a backward pass."""

    EMPTY = 0  # slice zeroed by zero_(); no gradient arrived since
    FULL = 1  # slice holds a gradient that later ones accumulate into
    HANDED = 2  # slice handed out by grad_destination in the current pass


@dataclasses.dataclass(eq=False, slots=True)
class Slot:
    """Where one parameter's gradient lives in its buffer."""

    param: torch.Tensor
    name: str
    key: tuple[torch.device, torch.dtype]
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    ptr: int = 0  # address of the slice's first element
    state: SlotState = SlotState.EMPTY
    shared: bool = False  # seen twice in one backward pass: never handed out again
    acc_node: Any = None  # p's AccumulateGrad node
    hook: Any = None

    @property
    def layout(self) -> tuple[torch.device, torch.dtype, tuple[int, ...], tuple[int, ...]]:
        return (self.key[0], self.key[1], self.shape, self.stride)


# Each slot starts at a multiple of this many bytes in its buffer.
ALIGN_BYTES = 64


def _is_dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for sz, st in sorted(zip(size, stride, strict=True), key=lambda d: d[1]):
        if sz == 1:
            continue
        if st != expected:
            return False
        expected *= sz
    return True


def slot_stride(p: torch.Tensor) -> tuple[int, ...]:
    """Strides that obey the layout contract for ``p`` (see Note [Gradient adoption])."""
    size, stride = tuple(p.shape), tuple(p.stride())
    if not _is_dense(size, stride):
        stride = tuple(torch.empty(size, device="meta").stride())
    return tuple(1 if sz == 1 and st == 0 else st for sz, st in zip(size, stride, strict=True))


def collect_params(
    params_or_module: nn.Module | Iterable[torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """The distinct leaf parameters that require grad, with the names errors use.

    Raises:
        CkptGraphTypeError: a single tensor, or an element that is not a tensor.
        CkptGraphValueError: a parameter that is not a leaf.
    """
    if isinstance(params_or_module, nn.Module):
        named: list[tuple[str, torch.Tensor]] = list(params_or_module.named_parameters())
    elif isinstance(params_or_module, torch.Tensor):
        raise CkptGraphTypeError(
            "ckpt_graph: FlatGrads expects a module or an iterable of parameters, got a single tensor; "
            "wrap it in a list"
        )
    else:
        named = [(f"parameter {i}", p) for i, p in enumerate(params_or_module)]
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise CkptGraphTypeError(
                f"ckpt_graph: FlatGrads: {name} is a {type(p).__name__}, not a tensor"
            )
        if not p.is_leaf:
            raise CkptGraphValueError(
                f"ckpt_graph: FlatGrads: {name} is not a leaf tensor; only leaves get a .grad from backward"
            )
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out
