"""``ckpt_graph.grads.linear``: a linear layer whose parameter gradients go into flat buffers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ckpt_graph.grads import FlatGrads

__all__ = ["linear"]


class _FlatLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        flat: FlatGrads | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # The parameters themselves, not the saved values: under a checkpoint region the saved
        # weight comes back as another tensor object, and FlatGrads finds slices by identity.
        ctx.params = (weight, bias)
        ctx.flat = flat
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight_value = ctx.saved_tensors
        weight, bias = ctx.params
        flat: FlatGrads | None = ctx.flat
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = grad_out.matmul(weight_value) if ctx.needs_input_grad[0] else None
        gw = gb = None
        if ctx.needs_input_grad[1]:
            dst = flat.grad_destination(weight) if flat is not None else None
            gw = torch.mm(g2.t(), x2, out=dst) if dst is not None else torch.mm(g2.t(), x2)
        if bias is not None and ctx.needs_input_grad[2]:
            dst = flat.grad_destination(bias) if flat is not None else None
            gb = torch.sum(g2, 0, out=dst) if dst is not None else g2.sum(0)
        return gx, gw, gb, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    flat: FlatGrads | None = None,
) -> torch.Tensor:
    """``F.linear`` whose weight and bias gradients are written straight into ``flat``.

    With ``flat=None`` it computes the same values out of place (same kernels, bitwise equal).

    Example:
        >>> y = linear(x, layer.weight, layer.bias, flat=flat)  # doctest: +SKIP
    """
    return _FlatLinear.apply(x, weight, bias, flat)  # type: ignore[no-any-return]
