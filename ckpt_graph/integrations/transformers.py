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
# Under torch.compile ``checkpoint`` lowers the layer's region to torch's checkpoint with a
# selective-checkpoint policy (Note [Regions under torch.compile] in engine/lowering.py); a
# policy that needs the region at run time goes through a dynamo-disabled function instead
# (one graph break per layer, the layer runs eagerly in its region, with a warning), as for
# ``ckpt_graph.wrap``: see Note [Wrapped modules under torch.compile] in integrations/wrap.py.

# Note [Surviving gradient_checkpointing_enable]
# ``Trainer(args=TrainingArguments(gradient_checkpointing=True))`` calls the model's public
# ``activation_checkpointing_enable(kwargs, every_n_layers, offload)`` (transformers 5; older
# versions ``gradient_checkpointing_enable(gradient_checkpointing_kwargs)``), which installs
# ``torch.utils.checkpoint`` and so would silently replace ckpt_graph. ``enable`` therefore
# binds both public methods on the model instance to ``_enable_from_hf``:
#   1. transformers' ``activation_checkpointing_enable`` treats an instance attribute
#      ``gradient_checkpointing_enable`` as an override and calls it; binding both covers the
#      5.x path, the deprecated one, and code that calls either directly.
#   2. The kwargs dict (``gradient_checkpointing_kwargs`` / ``activation_checkpointing_kwargs``)
#      may carry ``policy`` (default: the policy given to ``enable``); the other keys are
#      torch's checkpoint keywords, which ``ckpt_graph.checkpoint`` accepts
#      (see Note [checkpoint as a drop-in for torch's] in ckpt_graph/engine/api.py). ``offload=True``
#      raises: offloading is a policy decision (``policies.offload``).
#   3. The bindings are bound methods in the instance ``__dict__``: ``copy.deepcopy`` rebinds
#      them to the copy; ``disable`` removes them. ``activation_checkpointing_disable`` turns
#      checkpointing off and keeps the bindings: a later enable installs ckpt_graph again.
#   4. Anything that sets ``_gradient_checkpointing_func`` another way (a direct
#      ``_set_gradient_checkpointing`` call, another library) is not seen when it happens:
#      ``check(model)`` and ``CheckpointCallback`` (a ``TrainerCallback``, at the start of
#      training) warn when a model ``enable`` was called on checkpoints with a foreign function.
# The test tests/integration/test_trainer.py pins the transformers behaviour relied on here.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ckpt_graph._errors import (
    CkptGraphError,
    CkptGraphImportError,
    CkptGraphTypeError,
    CkptGraphValueError,
)
from ckpt_graph.engine.api import checkpoint
from ckpt_graph.engine.lowering import runs_eagerly
from ckpt_graph.engine.region import current_region
from ckpt_graph.integrations.activity import announce, describe_modules, describe_policy

# CheckpointCallback is built by the module __getattr__ (transformers imported then).
__all__ = [  # noqa: F822
    "CheckpointCallback",
    "HFCheckpointFunction",
    "check",
    "describe",
    "disable",
    "enable",
    "is_enabled",
]

_POLICY_ATTR = "_ckpt_graph_policy"
_ENTRY_POINTS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


class HFCheckpointFunction:
    """The ``_gradient_checkpointing_func`` that ``enable`` installs: one region per call.

    Attributes:
        policy: the region policy, as for ``ckpt_graph.save_recompute_policy``.

    Example:
        >>> f = HFCheckpointFunction("recompute_all")
        >>> y = f(torch.nn.functional.gelu, torch.randn(3, requires_grad=True))
    """

    __slots__ = ("options", "policy")

    def __init__(self, policy: Any, **options: Any) -> None:
        self.policy = policy
        self.options = options

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and runs_eagerly(self.policy):
            return _checkpoint_eagerly(self.policy, function, args, {**self.options, **kwargs})
        # under compile, ``checkpoint`` lowers the region: See Note [HF checkpoint function]
        if not torch.compiler.is_compiling() and current_region() is None:
            function = _Labelled(function)  # the region this call opens says who opened it
        return checkpoint(function, *args, policy=self.policy, **self.options, **kwargs)

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"HFCheckpointFunction(policy={self.policy!r}{options})"


class _Labelled:
    """A layer's checkpointed function that labels the region it runs in first.

    See Note [Integrations say when they are active].
    """

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        region = current_region()
        if region is not None:
            region.opened_by = f"transformers.enable: {_layer_name(self.function)}"
        return self.function(*args, **kwargs)


def _layer_name(function: Callable[..., Any]) -> str:
    """The class of the layer whose ``__call__`` transformers checkpoints (a ``partial``)."""
    target = getattr(function, "func", function)
    owner = getattr(target, "__self__", None)
    bound = getattr(function, "args", ())  # partial(forward, layer, ...) in transformers 5
    for candidate in (owner, bound[0] if bound else None):
        if isinstance(candidate, torch.nn.Module):
            return type(candidate).__name__
    return str(getattr(target, "__qualname__", type(target).__name__))


@torch._dynamo.disable  # type: ignore[untyped-decorator,misc]
def _checkpoint_eagerly(
    policy: Any, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The graph break of a checkpointed layer under torch.compile. See Note [HF checkpoint function]."""
    name = getattr(getattr(function, "func", function), "__qualname__", repr(function))
    warnings.warn(
        f"ckpt_graph: {name} (checkpointed by ckpt_graph.integrations.transformers) runs "
        f"eagerly under torch.compile: its policy {policy!r} needs the region at run time "
        "(on_region_enter), so it cannot be lowered to torch's selective checkpointing; "
        "gradients are exact",
        UserWarning,
        stacklevel=2,
    )
    return checkpoint(function, *args, policy=policy, **kwargs)


def _transformers(caller: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise CkptGraphImportError(
            f"ckpt_graph: integrations.transformers.{caller}() needs the 'transformers' "
            "package (pip install 'transformers>=4.35'); for any other model use "
            "ckpt_graph.wrap(model)"
        ) from None
    return transformers


def _pretrained(model: Any, caller: str) -> Any:
    transformers = _transformers(caller)
    if not isinstance(model, transformers.PreTrainedModel):
        raise CkptGraphTypeError(
            f"ckpt_graph: integrations.transformers.{caller}() takes a transformers "
            f"PreTrainedModel, got {type(model).__name__}; use ckpt_graph.wrap(model) instead"
        )
    return model


def enable(model: torch.nn.Module, policy: Any = "recompute_all", every_n_layers: int = 1) -> Any:
    """Turn on the model's gradient checkpointing, with ckpt_graph regions as the mechanism.

    Each checkpointed layer's forward runs in its own region (``ckpt_graph.checkpoint``) in
    training mode (``model.train()``), as transformers' own gradient checkpointing does. See
    Note [HF checkpoint function]. Later calls of the model's ``gradient_checkpointing_enable``
    / ``activation_checkpointing_enable`` (the HF ``Trainer`` makes one with
    ``gradient_checkpointing=True``) install ckpt_graph again, with the ``policy`` key of their
    kwargs if given: see Note [Surviving gradient_checkpointing_enable].

    Args:
        model: a ``transformers.PreTrainedModel`` whose class supports gradient checkpointing.
        policy: the region policy (``"recompute_all"``, ``"must_save_all"``, a callable or a
            policy object from ``ckpt_graph.policies``). A ``policies.memory_budget`` object
            budgets the whole step: the layers' regions are planned jointly (Note [Step
            budget across regions] in ``ckpt_graph/planner/step_budget.py``).
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
        >>> Trainer(model, TrainingArguments(..., gradient_checkpointing=True)).train()  # regions
        >>> model.train(); model(ids, labels=ids).loss.backward()
    """
    pretrained = _pretrained(model, "enable")
    if not getattr(pretrained, "supports_gradient_checkpointing", False):
        raise CkptGraphValueError(
            f"ckpt_graph: {type(model).__name__} does not support gradient checkpointing "
            "(supports_gradient_checkpointing is False); use ckpt_graph.wrap(model) instead"
        )
    _install(pretrained, policy, every_n_layers, {})
    setattr(pretrained, _POLICY_ATTR, policy)
    for name in _ENTRY_POINTS:  # See Note [Surviving gradient_checkpointing_enable]
        if hasattr(type(pretrained), name):
            setattr(pretrained, name, types.MethodType(_enable_from_hf, pretrained))
    announce(describe(pretrained))  # See Note [Integrations say when they are active].
    return model


_CHECKPOINT_KEYWORDS = frozenset(
    {
        "use_reentrant",
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
    }
)


def _install(model: Any, policy: Any, every_n_layers: int, options: dict[str, Any]) -> None:
    if every_n_layers < 1:
        raise CkptGraphValueError(f"ckpt_graph: every_n_layers must be >= 1, got {every_n_layers}")
    unknown = sorted(set(options) - _CHECKPOINT_KEYWORDS)
    if unknown:
        raise CkptGraphError(
            f"ckpt_graph: gradient_checkpointing_kwargs {unknown} of {type(model).__name__} are "
            "not checkpoint keywords; ckpt_graph takes 'policy' and torch's "
            f"{sorted(_CHECKPOINT_KEYWORDS)}: remove the others"
        )
    model._set_gradient_checkpointing(
        enable=True,
        gradient_checkpointing_func=HFCheckpointFunction(policy, **options),
        every_n_layers=every_n_layers,
    )


def _enable_from_hf(
    model: Any,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    every_n_layers: int = 1,
    offload: bool = False,
    activation_checkpointing_kwargs: dict[str, Any] | None = None,
) -> None:
    """The model's ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` after
    ``enable``: install ckpt_graph regions. See Note [Surviving gradient_checkpointing_enable].
    """
    options = dict(gradient_checkpointing_kwargs or activation_checkpointing_kwargs or {})
    policy = options.pop("policy", getattr(model, _POLICY_ATTR, "recompute_all"))
    every_n_layers = options.pop("every_n_layers", every_n_layers)
    if options.pop("offload", offload):
        raise CkptGraphError(
            f"ckpt_graph: {type(model).__name__} checkpoints through ckpt_graph, which does not "
            "take offload=True; offload kept values with a policy instead: "
            "gradient_checkpointing_kwargs={'policy': ckpt_graph.policies.offload(...)}"
        )
    _install(model, policy, every_n_layers, options)
    # Called by the Trainer (or the user): say it among transformers' own lines too.
    announce(describe(model), logging.getLogger("transformers.modeling_utils"))


def disable(model: torch.nn.Module) -> Any:
    """Turn the model's gradient checkpointing off (whichever function it used); returns it.

    Example:
        >>> cg_hf.disable(model).is_activation_checkpointing
        False
    """
    pretrained = _pretrained(model, "disable")
    for name in (*_ENTRY_POINTS, _POLICY_ATTR):
        pretrained.__dict__.pop(name, None)
    pretrained._set_gradient_checkpointing(enable=False)
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


def _checkpointing_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers that checkpoint now (transformers' ``GradientCheckpointingLayer``s whose
    flag is on; on older transformers every flagged submodule)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52: no common layer class
        layer_class: Any = torch.nn.Module
    else:
        layer_class = GradientCheckpointingLayer
    return [
        m
        for m in model.modules()
        if m is not model
        and isinstance(m, layer_class)
        and getattr(m, "gradient_checkpointing", False)
    ]


def describe(model: torch.nn.Module) -> str:
    """One line saying how the model's layers checkpoint now: through ckpt_graph (how many,
    which policy), with another function, or not at all.

    See Note [Integrations say when they are active].

    Example:
        >>> cg_hf.describe(cg_hf.enable(model))  # doctest: +SKIP
        "transformers: GPT2LMHeadModel: 2 modules (GPT2Block x2) checkpoint through ckpt_graph
        regions (policy='recompute_all')"
    """
    layers = _checkpointing_layers(model)
    head = f"transformers: {type(model).__name__}:"
    if not layers:
        return f"{head} gradient checkpointing is off (no layer checkpoints)"
    functions = {m: getattr(m, "_gradient_checkpointing_func", None) for m in layers}
    ours = [m for m, f in functions.items() if isinstance(f, HFCheckpointFunction)]
    parts = []
    if ours:
        policies = {describe_policy(getattr(functions[m], "policy", None)): None for m in ours}
        parts.append(
            f"{describe_modules(ours)} checkpoint through ckpt_graph regions "
            f"(policy={', '.join(policies)})"
        )
    others = [m for m in layers if m not in ours]
    if others:
        names = {_function_name(functions[m]): None for m in others}
        parts.append(
            f"{describe_modules(others)} checkpoint with {', '.join(names)}, not ckpt_graph"
        )
    return f"{head} {'; '.join(parts)}"


def _function_name(function: Any) -> str:
    target = getattr(function, "func", function)  # transformers binds a partial of torch's
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or repr(target)
    return f"{module}.{name}" if module else name


def check(model: torch.nn.Module) -> bool:
    """Log how the model checkpoints; warn if a model ``enable`` was called on now
    checkpoints with another function.

    The INFO line on the ``ckpt_graph`` logger is ``describe(model)``. See Note [Surviving
    gradient_checkpointing_enable], rule 4.

    Returns:
        Whether the model is as ``enable`` left it (or was never enabled).

    Example:
        >>> cg_hf.enable(model)
        >>> model._set_gradient_checkpointing(True)  # torch.utils.checkpoint again
        >>> cg_hf.check(model)  # warns, returns False
        False
    """
    announce(describe(model))
    if _POLICY_ATTR not in model.__dict__:
        return True
    foreign = {
        getattr(m, "_gradient_checkpointing_func", None)
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False)
        and not isinstance(getattr(m, "_gradient_checkpointing_func", None), HFCheckpointFunction)
    }
    if not foreign:
        return True
    names = sorted(getattr(f, "__qualname__", None) or repr(f) for f in foreign)
    warnings.warn(
        f"ckpt_graph: {type(model).__name__} was enabled with "
        f"ckpt_graph.integrations.transformers.enable(), but its layers now checkpoint with "
        f"{', '.join(names)}, which replaced ckpt_graph's function; call enable(model) again "
        "after whatever replaced it (or gradient_checkpointing_enable(), which enable() routes "
        "to ckpt_graph)",
        UserWarning,
        stacklevel=2,
    )
    return False


def __getattr__(name: str) -> Any:
    if name == "CheckpointCallback":  # a TrainerCallback subclass: transformers imported now
        cls = _callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _callback_class() -> type:
    base: type = _transformers("CheckpointCallback").TrainerCallback

    class CheckpointCallback(base):  # type: ignore[misc,valid-type]
        """A ``TrainerCallback`` that makes the model train with ckpt_graph regions.

        At the start of training it calls ``enable(model, policy)`` if ``policy`` is given
        (so ``gradient_checkpointing=True`` is not needed), then ``check(model)``, which
        warns if something replaced ckpt_graph's checkpoint function.

        Example:
            >>> trainer = Trainer(model, args, callbacks=[cg_hf.CheckpointCallback("recompute_all")])
        """

        def __init__(self, policy: Any = None, every_n_layers: int = 1) -> None:
            self.policy = policy
            self.every_n_layers = every_n_layers

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model = kwargs.get("model")
            if model is None:
                return
            if self.policy is not None and not is_enabled(model):
                enable(model, self.policy, self.every_n_layers)
            check(model)
            # See Note [Integrations say when they are active], rule 2.
            logging.getLogger("transformers.trainer").info("ckpt_graph: %s", describe(model))

    return CheckpointCallback
