"""The autograd Function behind :class:`ckpt_graph.nn.InPlaceABN`.

Example:
    >>> import torch
    >>> from ckpt_graph.nn._abn_function import inplace_abn
    >>> x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    >>> y = inplace_abn(x, None, None, None, None, True, 0.1, 1e-5, "leaky_relu", 0.01)
    >>> y is x
    True
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ckpt_graph._errors import CkptGraphError, CkptGraphValueError

__all__ = [
    "ACTIVATIONS",
    "BASELINE_STORAGE_REFS",
    "inplace_abn",
    "storage_refs",
    "tensor_refs",
]

ACTIVATIONS = ("leaky_relu", "elu", "identity")

# Temporaries of the chunked helpers hold about this fraction of the tensor.
_CHUNKS = 8

# Note [In-place activated BatchNorm]
# BatchNorm followed by an activation normally keeps two full-size tensors for backward: the
# BatchNorm input x (for the normalised input x_hat) and the activation input z (for the
# activation's derivative). In-place activated BatchNorm keeps one, the output y, and rebuilds
# everything else from it in backward (Rota Bulo et al., "In-Place Activated BatchNorm").
# 1. Forward, over the input buffer: x_hat = (x - mean) * invstd, z = gamma * x_hat + beta,
#    y = act(z), written as addcmul(beta - mean * gamma * invstd, x, gamma * invstd, out=x) followed
#    by the activation in place. `mark_dirty` tells autograd the input is now y. Saved: y,
#    gamma, beta and invstd (per channel). mean is not needed: x_hat comes back from y.
# 2. The activation must be invertible, with a derivative expressible in its output:
#    - leaky_relu(slope > 0): z = y if y >= 0 else y / slope (computed as leaky_relu(y, 1/slope));
#      act'(z) = 1 if y >= 0 else slope.
#    - elu(alpha > 0): z = y if y >= 0 else log1p(y / alpha); act'(z) = 1 if y >= 0 else
#      alpha * exp(z) = y + alpha. y = -alpha (exp(z) - 1 rounded to -1, z << 0) cannot be
#      inverted: backward raises CkptGraphError rather than produce inf/nan gradients.
#    - identity: z = y, act' = 1.
#    slope 0 (ReLU) loses every negative value: rejected when the module is built.
# 3. Backward, with M elements per channel and dz = dy * act'(z):
#    x_hat = (z - beta) / gamma, dbeta = sum(dz), dgamma = sum(dz * x_hat),
#    training: dx = gamma * invstd * (dz - dbeta / M - x_hat * dgamma / M),
#    eval (running stats, constants): dx = gamma * invstd * dz.
#    A channel with gamma == 0 has lost x_hat: its dx is 0 anyway (x_hat is set to 0 there),
#    but its dgamma cannot be computed, so forward raises when gamma needs a gradient.
#    Small |gamma| amplifies rounding in x_hat; in float64 the result matches BatchNorm to ~1e-12.
# 4. Buffer reuse: no full-size tensor is allocated in backward when autograd hands over the only
#    reference to the incoming gradient dy and dy has y's strides.
#    - dz is written over dy by aten's activation backward with out=dy (an elementwise kernel
#      whose output exactly aliases an input, which TensorIterator allows), then dx over dz
#      (addcmul with out=dz and per-channel factors), and dx is returned. If dy has other strides
#      (sum()'s expanded gradient) or is not ours (rule 5), dz goes to a new buffer with y's
#      strides: the "make dy contiguous first" copy, fused with the activation backward.
#    - y is inverted in place: z, then x_hat. It is our saved output, so this bumps its version:
#      a second backward through the same graph (retain_graph=True) raises CkptGraphError.
#      After backward the tensor the user got as output holds x_hat, not y: read it before.
#      Eval mode without a weight gradient needs no x_hat and leaves y intact.
#    - Per-channel sums use no full-size temporary: sum(dz * x_hat) and the ELU inverse are
#      computed in chunks along the largest non-channel dim (~1/_CHUNKS of the tensor at a time).
# 5. Never assume two buffers do not alias: dy is reused only if `_owned` proves nobody else can
#    see it: one C++ reference (no other tensor object, no autograd buffer of another node still
#    pending, as when AddBackward hands the same gradient to both branches), one tensor on its
#    storage (no view, no saved copy, not y itself) and no extra Python reference (a hook that
#    stored it), counted against the baseline of a probe Function measured at import through
#    the same call path. Otherwise dz goes to a new buffer and dy is only read.
# 6. Forward refuses inputs it must not overwrite (InPlaceABN.forward, `_check_writable`): a leaf
#    that requires grad, a tensor with internal overlap (expand), and, with grad enabled, a tensor
#    whose storage other tensors share: a SavedVariable of another op (relu's output, sin's input),
#    a detach() or a view still alive. A view of a temporary is accepted (its base is referenced
#    only by the view): autograd rebases the view's history. Under saved-tensor hooks
#    (ckpt_graph regions, torch.utils.checkpoint) the last check is skipped: the hooks own what
#    they saved (as Python objects, invisible to the counts), a region holds references to the
#    values it keeps (which the counts would take for autograd's), and the region's own version
#    check raises in backward if a value it needs was overwritten.


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _chunks(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Yield matching views of `tensors`, each at most ~1/_CHUNKS of the whole.

    The split runs along the largest non-channel dim, so per-channel sums stay exact sums of
    the pieces.
    """
    first = tensors[0]
    dim = max(_reduce_dims(first), key=lambda d: first.shape[d])
    size = first.shape[dim]
    step = max(1, -(-size // _CHUNKS))
    for start in range(0, size, step):
        yield tuple(t.narrow(dim, start, min(step, size - start)) for t in tensors)


def storage_refs(t: torch.Tensor) -> int:
    """C++ references to `t`'s storage (each TensorImpl on it counts once)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def tensor_refs(t: torch.Tensor) -> int:
    """C++ references to `t`'s TensorImpl (a Python object counts once)."""
    return int(t._use_count())  # type: ignore[attr-defined]


def _python_refs(t: torch.Tensor) -> int:
    return sys.getrefcount(t)


class _Probe(torch.autograd.Function):
    """Measures the Python references a gradient has on the path into `backward`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.refs = []
        return x.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:
        refs = _python_refs(grad_out)  # the same statement as in _InPlaceABN.backward
        ctx.refs.append(refs)
        return grad_out


def _measure_baselines() -> tuple[int, int]:
    """(Python references, storage references) of a gradient that nobody else holds."""
    # See Note [In-place activated BatchNorm], rule 5.
    if not hasattr(torch.Tensor, "_use_count") or not hasattr(torch._C, "_storage_Use_Count"):
        return -1, -1
    with torch.inference_mode(False), torch.enable_grad():
        y = _Probe.apply(torch.zeros(2, requires_grad=True))
        node = y.grad_fn
        (y * 2.0).sum().backward()  # y's gradient: a fresh tensor made by MulBackward
    return int(node.refs[0]), storage_refs(torch.empty(1))  # type: ignore[union-attr]


_BASELINE_PYTHON_REFS, BASELINE_STORAGE_REFS = _measure_baselines()
# The Python references a gradient has on its way into backward depend on global state
# (e.g. frame callbacks that torch.compile / dynamo install): when a gradient shows more
# than the import-time baseline, measure the baseline again in the current state (never
# cached: the state may change back, and a stale high baseline would be unsafe).


def _owned(grad: torch.Tensor, python_refs: int) -> bool:
    """Whether `grad` (a backward argument with `python_refs` counted there) is ours alone."""
    # See Note [In-place activated BatchNorm], rule 5.
    if _BASELINE_PYTHON_REFS < 0:
        return False
    if tensor_refs(grad) != 1 or storage_refs(grad) != BASELINE_STORAGE_REFS:
        return False
    return python_refs <= _BASELINE_PYTHON_REFS or python_refs <= _measure_baselines()[0]


def _activation_backward_(
    grad: torch.Tensor, y: torch.Tensor, out: torch.Tensor, activation: str, param: float
) -> None:
    """out = grad * act'(act^-1(y)); `out` may be `grad` itself."""
    if activation == "leaky_relu":
        torch.ops.aten.leaky_relu_backward.grad_input(grad, y, param, True, grad_input=out)
    elif activation == "elu":
        torch.ops.aten.elu_backward.grad_input(grad, param, 1.0, 1.0, True, y, grad_input=out)
    elif out is not grad:
        out.copy_(grad)


def _invert_activation_(y: torch.Tensor, activation: str, param: float) -> None:
    """Overwrite y = act(z) with z."""
    if activation == "leaky_relu":
        torch.nn.functional.leaky_relu_(y, 1.0 / param)
    elif activation == "elu":
        for (chunk,) in _chunks(y):
            neg = chunk.clamp(max=0.0).div_(param).log1p_()
            if neg.numel() and bool(neg.min() == float("-inf")):
                raise CkptGraphError(
                    "ckpt_graph: InPlaceABN(activation='elu') cannot invert an output equal to "
                    f"-alpha ({-param}): exp(z) - 1 rounded to -1 for a very negative z. Use a "
                    "wider dtype, a smaller weight, or leaky_relu."
                )
            chunk.clamp_(min=0.0).add_(neg)


def _batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance, two passes, no full-size temporary."""
    # torch.var_mean over dims (0, 2, ...) takes a slow strided path on CPU (~10x a sum).
    dims = _reduce_dims(x)
    mean = x.mean(dim=dims)
    centre = mean.view(_channel_shape(x))
    var = x.new_zeros(x.shape[1])
    for (chunk,) in _chunks(x):
        var += (chunk - centre).square_().sum(dim=dims)
    return mean, var.div_(x.numel() // x.shape[1])


def _channel_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-channel sum(a * b) without a full-size temporary."""
    dims = _reduce_dims(a)
    total = a.new_zeros(a.shape[1])
    for ca, cb in _chunks(a, b):
        total += (ca * cb).sum(dim=dims)
    return total


class _InPlaceABN(torch.autograd.Function):
    """BatchNorm + invertible activation, in place. See Note [In-place activated BatchNorm]."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        training: bool,
        momentum: float,
        eps: float,
        activation: str,
        param: float,
    ) -> torch.Tensor:
        shape = _channel_shape(x)
        if training:
            mean, var = _batch_stats(x)
            if running_mean is not None and running_var is not None:
                count = x.numel() // x.shape[1]
                running_mean.mul_(1.0 - momentum).add_(mean, alpha=momentum)
                unbiased = var * (count / max(count - 1, 1))
                running_var.mul_(1.0 - momentum).add_(unbiased, alpha=momentum)
            invstd = (var + eps).rsqrt()
        else:
            if running_mean is None or running_var is None:
                raise CkptGraphValueError("ckpt_graph: InPlaceABN in eval mode needs running stats")
            mean = running_mean
            invstd = (running_var + eps).rsqrt()
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale
        if bias is not None:
            shift = shift + bias
        torch.addcmul(shift.view(shape), x, scale.view(shape), out=x)  # one pass over x
        if activation == "leaky_relu":
            torch.nn.functional.leaky_relu_(x, param)
        elif activation == "elu":
            torch.nn.functional.elu_(x, param)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, invstd)
        ctx.training = training
        ctx.activation = activation
        ctx.param = param
        ctx.consumed = False
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        try:
            y, weight, bias, invstd = ctx.saved_tensors
        except RuntimeError as err:
            # Only the version error says that the first backward overwrote ``y``; anything
            # else (out of memory while a region recomputes it) keeps its type.
            if ctx.consumed and "modified by an inplace operation" in str(err):
                raise CkptGraphError(
                    "ckpt_graph: InPlaceABN backward ran a second time through the same graph "
                    "(retain_graph=True?), but the first backward overwrote its saved output "
                    "in place. Run a new forward for each backward, or use nn.BatchNorm with "
                    "a separate activation."
                ) from err
            raise
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        activation, param = ctx.activation, ctx.param
        shape = _channel_shape(y)
        dims = _reduce_dims(y)

        # dz = dy * act'(z), over dy when we own it. See Note [In-place activated BatchNorm].
        refs = _python_refs(grad_out)  # the same statement as in _Probe.backward
        if grad_out.stride() == y.stride() and _owned(grad_out, refs):
            dz = grad_out
        else:
            dz = torch.empty_like(y)
        _activation_backward_(grad_out, y, dz, activation, param)
        del grad_out

        need_xhat = need_w or (ctx.training and need_x)
        if need_xhat:
            ctx.consumed = True
            _invert_activation_(y, activation, param)
            if weight is not None and bias is not None:  # x_hat = (z - beta) / gamma
                inv_weight = torch.where(weight != 0, weight.reciprocal(), 0.0)
                offset = -bias * inv_weight
                torch.addcmul(offset.view(shape), y, inv_weight.view(shape), out=y)
        xhat = y
        sum_dz = dz.sum(dim=dims) if (need_b or (ctx.training and need_x)) else None
        sum_dz_xhat = _channel_dot(dz, xhat) if need_xhat else None

        grad_x = None
        if need_x:
            factor = invstd if weight is None else invstd * weight
            if ctx.training:  # dx = factor * (dz - sum_dz / M - x_hat * sum_dz_xhat / M)
                assert sum_dz is not None and sum_dz_xhat is not None
                count = y.numel() // y.shape[1]
                offset = -factor * sum_dz / count
                torch.addcmul(offset.view(shape), dz, factor.view(shape), out=dz)
                dz.addcmul_(xhat, (-factor * sum_dz_xhat / count).view(shape))
            else:
                dz.mul_(factor.view(shape))
            grad_x = dz
        grad_w = sum_dz_xhat if need_w else None
        grad_b = sum_dz if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def inplace_abn(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    activation_param: float,
) -> torch.Tensor:
    """Normalise and activate `x` in place; returns `x` (now the output).

    Args:
        x: input of shape (N, C, ...); overwritten with the output.
        weight: per-channel scale gamma, or None.
        bias: per-channel shift beta, or None.
        running_mean: updated in place when `training` (may be None).
        running_var: updated in place when `training` (may be None).
        training: use batch statistics (True) or the running ones (False).
        momentum: running-stat update factor.
        eps: added to the variance.
        activation: one of ``ACTIVATIONS``.
        activation_param: leaky_relu slope or elu alpha (> 0).

    Returns:
        `x`, holding act(batch_norm(x)).

    Example:
        >>> x = torch.randn(2, 3)
        >>> inplace_abn(x, None, None, None, None, True, 0.1, 1e-5, "identity", 0.0).shape
        torch.Size([2, 3])
    """
    out: torch.Tensor = _InPlaceABN.apply(
        x,
        weight,
        bias,
        running_mean,
        running_var,
        training,
        momentum,
        eps,
        activation,
        activation_param,
    )
    return out
