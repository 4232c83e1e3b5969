"""HuggingFace transformers: make ckpt_graph the checkpoint function of a ``PreTrainedModel``.

# Note [HF checkpoint function]
# transformers (4.35+, 5.x) layers that support gradient checkpointing
# (``GradientCheckpointingLayer`` subclasses, e.g. ``GPT2Block``, ``LlamaDecoderLayer``,
# ``BertLayer``) call ``self._gradient_checkpointing_func(forward_with_kwargs, *args)`` when
# ``self.gradient_checkpointing and self.training``. ``PreTrainedModel._set_gradient_checkpointing
# (enable, gradient_checkpointing_func, every_n_layers)`` sets both attributes on every module
# that has the flag; ``enable`` hands it a ``HFCheckpointFunction`` that opens a region instead
# of calling ``torch.utils.checkpoint``. The layer's module hooks (FSDP2's too) stay outside the
# region because transformers checkpoints ``forward``, not ``__call__``. Unlike the reentrant
# torch checkpoint, a region needs no input that requires grad, so ``enable`` does not register
# transformers' ``enable_input_require_grads`` hook. ``transformers`` is imported lazily.
# Under torch.compile the call goes through a dynamo-disabled function (one graph break per
# layer, the layer runs eagerly in its region, with a warning), as for ``ckpt_graph.wrap``:
# see Note [Wrapped modules under torch.compile] in ckpt_graph/wrap.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..api import checkpoint

__all__ = ["HFCheckpointFunction", "disable", "enable", "is_enabled"]


class HFCheckpointFunction:
    """The ``_gradient_checkpointing_func`` that ``enable`` installs: one region per call.

    Attributes:
        policy: the region policy, as for ``ckpt_graph.save_recompute_policy``.

    Example:
        >>> f = HFCheckpointFunction("recompute_all")
        >>> y = f(torch.nn.functional.gelu, torch.randn(3, requires_grad=True))
    """

    __slots__ = ("policy",)

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # constant under dynamo; False when eager
            return _checkpoint_eagerly(self.policy, function, args, kwargs)
        return checkpoint(function, *args, policy=self.policy, **kwargs)

    def __repr__(self) -> str:
        return f"HFCheckpointFunction(policy={self.policy!r})"


@torch._dynamo.disable  # type: ignore[untyped-decorator,misc]
def _checkpoint_eagerly(
    policy: Any, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The graph break of a checkpointed layer under torch.compile. See Note [HF checkpoint function]."""
    name = getattr(getattr(function, "func", function), "__qualname__", repr(function))
    warnings.warn(
        f"ckpt_graph: {name} (checkpointed by ckpt_graph.integrations.transformers) runs "
        "eagerly under torch.compile: its region records aten ops with a TorchDispatchMode, "
        "which dynamo cannot trace; gradients are exact",
        UserWarning,
        stacklevel=2,
    )
    return checkpoint(function, *args, policy=policy, **kwargs)


def _pretrained(model: Any, caller: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"ckpt_graph: integrations.transformers.{caller}() needs the 'transformers' "
            "package (pip install 'transformers>=4.35'); for any other model use "
            "ckpt_graph.wrap(model)"
        ) from None
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"ckpt_graph: integrations.transformers.{caller}() takes a transformers "
            f"PreTrainedModel, got {type(model).__name__}; use ckpt_graph.wrap(model) instead"
        )
    return model


def enable(model: torch.nn.Module, policy: Any = "recompute_all", every_n_layers: int = 1) -> Any:
    """Turn on the model's gradient checkpointing, with ckpt_graph regions as the mechanism.

    Each checkpointed layer's forward runs in its own region (``ckpt_graph.checkpoint``) in
    training mode (``model.train()``), as transformers' own gradient checkpointing does. See
    Note [HF checkpoint function].

    Args:
        model: a ``transformers.PreTrainedModel`` whose class supports gradient checkpointing.
        policy: the region policy (``"recompute_all"``, ``"must_save_all"``, a callable or a
            policy object from ``ckpt_graph.policies``). A ``policies.memory_budget`` object
            budgets the whole step: the layers' regions are planned jointly (Note [Step
            budget across regions] in ``ckpt_graph/policies/_budget.py``).
        every_n_layers: checkpoint only every n-th layer (as transformers' own option).

    Returns:
        ``model``.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``model`` is not a ``PreTrainedModel``.
        ValueError: the model does not support gradient checkpointing.

    Example:
        >>> from ckpt_graph.integrations import transformers as cg_hf
        >>> model = cg_hf.enable(GPT2LMHeadModel(config))
        >>> model.train(); model(ids, labels=ids).loss.backward()
    """
    pretrained = _pretrained(model, "enable")
    if every_n_layers < 1:
        raise ValueError(f"ckpt_graph: every_n_layers must be >= 1, got {every_n_layers}")
    if not getattr(pretrained, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"ckpt_graph: {type(model).__name__} does not support gradient checkpointing "
            "(supports_gradient_checkpointing is False); use ckpt_graph.wrap(model) instead"
        )
    pretrained._set_gradient_checkpointing(
        enable=True,
        gradient_checkpointing_func=HFCheckpointFunction(policy),
        every_n_layers=every_n_layers,
    )
    return model


def disable(model: torch.nn.Module) -> Any:
    """Turn the model's gradient checkpointing off (whichever function it used); returns it.

    Example:
        >>> cg_hf.disable(model).is_activation_checkpointing
        False
    """
    _pretrained(model, "disable")._set_gradient_checkpointing(enable=False)
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether some module of ``model`` checkpoints through ckpt_graph.

    Example:
        >>> cg_hf.is_enabled(cg_hf.enable(model))
        True
    """
    return any(
        getattr(m, "gradient_checkpointing", False)
        and isinstance(getattr(m, "_gradient_checkpointing_func", None), HFCheckpointFunction)
        for m in model.modules()
    )
