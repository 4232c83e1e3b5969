"""In-place activated BatchNorm: BatchNorm + invertible activation storing one tensor.

Example:
    >>> import torch
    >>> from ckpt_graph.nn import InPlaceABN
    >>> abn = InPlaceABN(3)
    >>> x = torch.randn(4, 3, 8, 8).mul(2)   # a non-leaf: it is overwritten
    >>> abn(x).shape
    torch.Size([4, 3, 8, 8])
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ckpt_graph._errors import CkptGraphError, CkptGraphValueError
from ckpt_graph.nn._abn_function import (
    ACTIVATIONS,
    BASELINE_STORAGE_REFS,
    inplace_abn,
    storage_refs,
    tensor_refs,
)

__all__ = ["InPlaceABN", "convert_bn_act"]

M = TypeVar("M", bound=nn.Module)


def _check_activation(activation: str, activation_param: float) -> None:
    if activation not in ACTIVATIONS:
        raise CkptGraphValueError(
            f"ckpt_graph: InPlaceABN activation must be one of {ACTIVATIONS}, got {activation!r}"
        )
    if activation == "leaky_relu" and not activation_param > 0:
        raise CkptGraphValueError(
            "ckpt_graph: InPlaceABN(activation='leaky_relu') needs a slope activation_param > 0 "
            f"to invert the activation in backward, got {activation_param}. Use a small positive "
            "slope such as 0.01, or keep nn.BatchNorm2d + nn.ReLU for a slope of 0."
        )
    if activation == "elu" and not activation_param > 0:
        raise CkptGraphValueError(
            "ckpt_graph: InPlaceABN(activation='elu') needs alpha = activation_param > 0 to "
            f"invert the activation in backward, got {activation_param}."
        )


def _check_writable(x: torch.Tensor) -> None:
    """Raise if writing `x` in place would break autograd or another tensor sharing it."""
    # See Note [In-place activated BatchNorm], rule 6.
    if torch._debug_has_internal_overlap(x) == 1:
        raise CkptGraphError(
            f"ckpt_graph: InPlaceABN cannot write its input of shape {tuple(x.shape)} and strides "
            f"{x.stride()} in place: several elements share memory (an expand()ed tensor?). "
            "Pass x.contiguous()."
        )
    if not torch.is_grad_enabled():
        return
    if x.requires_grad and x.is_leaf:
        raise CkptGraphError(
            "ckpt_graph: InPlaceABN writes its input in place, but the input is a leaf tensor "
            "that requires grad (autograd needs its value). Pass x.clone(), or normalise the "
            "output of a layer (conv, linear) instead."
        )
    if BASELINE_STORAGE_REFS < 0:  # this torch cannot count references
        return
    # A lone tensor has one TensorImpl on its storage; a view adds its base, which only the
    # view's autograd metadata and the Python object `x._base` creates may hold.
    base = x._base
    allowed = BASELINE_STORAGE_REFS + (base is not None)
    shared = tensor_refs(x) > 1 or storage_refs(x) > allowed
    if base is not None:
        shared = shared or tensor_refs(base) > 2
    if shared and not _saved_tensor_hooks_active():
        raise CkptGraphError(
            f"ckpt_graph: InPlaceABN cannot write its input of shape {tuple(x.shape)} in place: "
            "another tensor shares its memory (autograd saved it for another op's backward, "
            "e.g. the output of relu or the input of sin/mul, or a view/detach() of it is "
            "alive), and overwriting it would corrupt that op's gradient. Pass x.clone(), or "
            "use nn.BatchNorm with a separate activation here."
        )


def _saved_tensor_hooks_active() -> bool:
    # Under saved-tensor hooks (ckpt_graph regions, torch.utils.checkpoint) the hooks own what
    # they saved and check its version themselves; a region also holds references to values it
    # keeps, which the counts above would take for autograd's.
    # See Note [In-place activated BatchNorm], rule 6.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(True) is not None


class InPlaceABN(_NormBase):
    """BatchNorm followed by an invertible activation, computed in place over its input.

    A drop-in replacement for ``nn.BatchNormNd`` + ``nn.LeakyReLU``/``nn.ELU``/``nn.Identity``
    that keeps one full-size tensor for backward instead of two. Parameters, buffers,
    ``state_dict`` keys and running-stat updates are those of ``nn.BatchNorm2d`` (a BatchNorm
    state dict loads as is). Accepts (N, C), (N, C, L), (N, C, H, W) and higher ranks.
    See Note [In-place activated BatchNorm].

    Args:
        num_features: number of channels C.
        eps: added to the variance.
        momentum: running-stat update factor; None for a cumulative average.
        affine: learn a per-channel weight and bias.
        activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"``.
        activation_param: negative slope for leaky_relu (> 0), alpha for elu (> 0).
        track_running_stats: as in ``nn.BatchNorm2d``.

    Attributes:
        activation: the activation's name.
        activation_param: its parameter.

    Example:
        >>> abn = InPlaceABN(4, activation="elu", activation_param=1.0)
        >>> conv = torch.nn.Conv2d(3, 4, 3)
        >>> out = abn(conv(torch.randn(2, 3, 8, 8)))
        >>> out.sum().backward()

    Known limitations:
        - The input is overwritten with the output, and backward overwrites the output with the
          normalised input: read the output before backward. A second backward through the
          same graph (retain_graph=True) raises CkptGraphError.
        - Leaf tensors that require grad, expand()ed tensors and tensors that other ops saved
          for backward (or that a view shares) are rejected with CkptGraphError. Under
          saved-tensor hooks (ckpt_graph regions, torch.utils.checkpoint) the hooks hold what
          they saved as Python objects, invisible to that check: there the hooks' own version
          check raises in backward (ckpt_graph: "modified by an inplace operation").
        - A channel whose weight is exactly 0 cannot give a weight gradient (forward raises);
          a tiny |weight| loses precision in the weight gradient. ELU outputs within rounding
          of -alpha (pre-activation below about -15 in float32) invert imprecisely, and
          exactly -alpha raises CkptGraphError in backward.
        - Batch statistics and the inversion run in the input's dtype: half and bfloat16
          inputs work but are less accurate than BatchNorm's float accumulation (untested).
        - torch.utils.checkpoint replays the module's forward and so updates running stats
          twice, as it does for nn.BatchNorm2d; ckpt_graph regions update them once.
        - Double backward (create_graph=True) is not supported.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        _check_activation(activation, activation_param)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.activation = activation
        self.activation_param = float(activation_param)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise CkptGraphValueError(
                f"ckpt_graph: InPlaceABN expects an input of shape (N, C, ...), got {input.dim()}-D"
            )
        if input.shape[1] != self.num_features:
            raise CkptGraphValueError(
                f"ckpt_graph: InPlaceABN({self.num_features}) got an input with "
                f"{input.shape[1]} channels (shape {tuple(input.shape)})"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise and activate `input` in place; returns it."""
        self._check_input_dim(input)
        _check_writable(input)
        # Running-stat bookkeeping mirrors torch.nn.modules.batchnorm._BatchNorm.forward.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if use_batch_stats and input.numel() // input.shape[1] <= 1:
            raise CkptGraphValueError(
                "ckpt_graph: InPlaceABN expected more than 1 value per channel when training, "
                f"got input of shape {tuple(input.shape)}"
            )
        weight = self.weight
        if (
            weight is not None
            and weight.requires_grad
            and torch.is_grad_enabled()
            and bool((weight == 0).any())
        ):
            zero = (weight == 0).nonzero().flatten().tolist()
            raise CkptGraphError(
                f"ckpt_graph: InPlaceABN cannot compute the weight gradient of channels {zero}: "
                "their weight is 0, so the output no longer holds the normalised input. "
                "Initialise the weight away from 0, freeze it (requires_grad_(False)), or use "
                "nn.BatchNorm for this layer."
            )
        track = not self.training or self.track_running_stats
        return inplace_abn(
            input,
            weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            use_batch_stats,
            factor,
            self.eps,
            self.activation,
            self.activation_param,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}, activation_param={self.activation_param}"


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _as_activation(module: nn.Module) -> tuple[str, float] | None:
    if isinstance(module, nn.LeakyReLU) and module.negative_slope > 0:
        return "leaky_relu", float(module.negative_slope)
    if isinstance(module, nn.ELU) and module.alpha > 0:
        return "elu", float(module.alpha)
    if isinstance(module, nn.Identity):
        return "identity", 0.0
    return None


def convert_bn_act(model: M) -> M:
    """Replace BatchNorm + LeakyReLU/ELU/Identity pairs inside ``nn.Sequential``s by InPlaceABN.

    The BatchNorm at index i becomes an :class:`InPlaceABN` with its parameters, buffers and
    train/eval mode; the activation at i + 1 becomes ``nn.Identity()``, so the indices (and the
    ``state_dict`` keys) of the other children do not move. ReLU (slope 0) is not invertible and
    is left alone, as are BatchNorm subclasses such as SyncBatchNorm. The model is changed in
    place and returned.

    Args:
        model: any module; every nested ``nn.Sequential`` is scanned.

    Returns:
        `model`.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
        ...                           torch.nn.LeakyReLU(0.1))
        >>> [type(m).__name__ for m in convert_bn_act(net)]
        ['Conv2d', 'InPlaceABN', 'Identity']
    """
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        children = list(seq)
        for i in range(len(children) - 1):
            bn, act = children[i], children[i + 1]
            spec = _as_activation(act)
            if type(bn) not in _BATCH_NORMS or spec is None:
                continue
            assert isinstance(bn, _NormBase)
            abn = _from_batch_norm(bn, *spec)
            seq[i] = abn
            seq[i + 1] = nn.Identity()
            children[i + 1] = seq[i + 1]
            children[i] = abn
    return model


def _from_batch_norm(bn: _NormBase, activation: str, param: float) -> InPlaceABN:
    ref: Any = bn.weight if bn.weight is not None else bn.running_mean
    abn = InPlaceABN(
        bn.num_features,
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        activation=activation,
        activation_param=param,
        track_running_stats=bn.track_running_stats,
        device=None if ref is None else ref.device,
        dtype=None if ref is None else ref.dtype,
    )
    abn.load_state_dict(bn.state_dict())
    if bn.weight is not None and abn.weight is not None:
        abn.weight.requires_grad_(bn.weight.requires_grad)
        abn.bias.requires_grad_(bn.bias.requires_grad)  # type: ignore[union-attr]
    abn.train(bn.training)
    return abn
