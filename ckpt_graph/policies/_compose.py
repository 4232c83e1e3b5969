"""Policy combinators (first_answer, any_save) and the torch SAC adapter (from_torch_sac).

Example:
    >>> import torch
    >>> from ckpt_graph import policies
    >>> aten = torch.ops.aten
    >>> policies.first_answer(policies.save_ops(aten.mm, rest=None), "recompute_all")
    first_answer(save_ops(aten.mm, rest=None), 'recompute_all')
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch._ops import OpOverload
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph.policies._builtins import (
    Answer,
    Policy,
    PolicyLike,
    _normalise,
    _resolve,
    save_ops,
)
from ckpt_graph.policies._core import PROTOCOL_NAMES

__all__ = ["any_save", "first_answer", "from_torch_sac"]

_MUST_SAVE = CheckpointPolicy.MUST_SAVE
_PREFER_SAVE = CheckpointPolicy.PREFER_SAVE


class _Combinator(Policy):
    """A policy made of member policies: shared construction, repr and region events."""

    def __init__(self, *policies: PolicyLike) -> None:
        name = type(self).__name__
        if not policies:
            raise ValueError(f"{name}: needs at least one policy")
        self._given = policies
        self._policies = tuple(_resolve(p, name) for p in policies)

    def _repr_args(self) -> str:
        return ", ".join(repr(p) for p in self._given)

    def on_region_enter(self, region: Any) -> None:
        _forward_event(self._policies, "on_region_enter", region)

    def on_region_exit(self, region: Any) -> None:
        _forward_event(self._policies, "on_region_exit", region)


class first_answer(_Combinator):
    """Ask the policies in order; the first answer that is not None wins.

    String names ("recompute_all", "must_save_all") are accepted in place of policies.

    Example:
        >>> aten = torch.ops.aten
        >>> p = first_answer(save_ops(aten.mm, rest=None), recompute_ops(aten.gelu), "must_save_all")
        >>> # mm kept (MUST_SAVE), gelu recomputed, every other op kept (MUST_SAVE)
    """

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        for policy in self._policies:
            answer = policy(ctx, out, op, *args, **kwargs)
            if answer is not None:
                return _normalise(answer)
        return None


class any_save(_Combinator):
    """Keep an op's outputs if any policy says save; otherwise the first other answer.

    Every policy is asked. If any answers MUST_SAVE (or True) the result is MUST_SAVE, else if
    any answers PREFER_SAVE it is PREFER_SAVE; otherwise the first answer that is not None
    (e.g. PREFER_RECOMPUTE from a "recompute the rest" built-in). Use it to keep the union of
    several selections inside one stack entry.

    Example:
        >>> aten = torch.ops.aten
        >>> big = offload(lambda ctx, *a, **k: ctx.out_bytes > 4096)
        >>> p = any_save(big, save_ops(aten.mm))
        >>> # mm kept on the device (MUST_SAVE); other big outputs offloaded (big answers
        >>> # first); everything else recomputed (save_ops' rest)
    """

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        first: CheckpointPolicy | None = None
        prefer_save = False
        for policy in self._policies:
            answer = _normalise(policy(ctx, out, op, *args, **kwargs))
            if answer is _MUST_SAVE:
                return _MUST_SAVE
            if answer is _PREFER_SAVE:
                prefer_save = True
            elif first is None:
                first = answer
        return _PREFER_SAVE if prefer_save else first


def _forward_event(policies: Iterable[object], name: str, region: Any) -> None:
    """Pass an optional region event on to the members of a combinator that define it."""
    for policy in policies:
        method = getattr(policy, name, None)
        if method is not None:
            method(region)


class _TorchSACContext:
    """The part of torch's ``SelectiveCheckpointContext`` a SAC policy may read."""

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, op_output: Any) -> None:
        self.is_recompute = False  # ckpt_graph calls policies in forward only
        self.op_output = op_output


class from_torch_sac(Policy):
    """Adapt a ``torch.utils.checkpoint`` selective-checkpoint policy or op list.

    A SAC policy has the signature ``policy_fn(ctx, op, *args, **kwargs)`` (no ``out``); it
    gets a context with ``is_recompute=False`` and ``op_output``, and the op's keyword
    arguments under their own names (``out=`` too; see Note [Policy keyword arguments]). An op list means what it
    means for ``create_selective_checkpoint_contexts``: MUST_SAVE for the listed ops,
    PREFER_RECOMPUTE for the rest (it becomes :class:`save_ops`; packets are accepted too).

    Args:
        policy_fn_or_op_list: a SAC policy function, or a list / tuple of aten ops.

    Example:
        >>> def sac_policy(ctx, op, *args, **kwargs):
        ...     return (
        ...         CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default
        ...         else CheckpointPolicy.PREFER_RECOMPUTE
        ...     )
        >>> with cg.save_recompute_policy(from_torch_sac(sac_policy)):  # doctest: +SKIP
        ...     y = model(x)
        >>> from_torch_sac([torch.ops.aten.mm.default])
        from_torch_sac([aten.mm.default])
    """

    def __init__(self, policy_fn_or_op_list: Callable[..., Answer] | Iterable[Any]) -> None:
        self._fn: Callable[..., Answer] | None = None
        self._ops: save_ops | None = None
        if isinstance(policy_fn_or_op_list, list | tuple):
            self._ops = save_ops(*policy_fn_or_op_list)
        elif callable(policy_fn_or_op_list):
            self._fn = policy_fn_or_op_list
        else:
            raise TypeError(
                "from_torch_sac: expected a SAC policy function (ctx, op, *args, **kwargs) or a "
                f"list of aten ops, got {policy_fn_or_op_list!r}"
            )

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        if self._ops is not None:
            return self._ops(ctx, out, op)
        assert self._fn is not None
        if "out_" in kwargs or "ctx_" in kwargs or "op_" in kwargs:
            # See Note [Policy keyword arguments]: torch's signature has no ``out``.
            kwargs = {
                (k[:-1] if k.endswith("_") and k[:-1] in PROTOCOL_NAMES else k): v
                for k, v in kwargs.items()
            }
        return self._fn(_TorchSACContext(out), op, *args, **kwargs)

    def _repr_args(self) -> str:
        if self._ops is not None:
            return "[" + ", ".join(self._ops._ops.names) + "]"
        return getattr(self._fn, "__qualname__", None) or repr(self._fn)
