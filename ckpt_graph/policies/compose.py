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
from contextlib import ExitStack
from typing import Any

from torch._ops import OpOverload
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphTypeError, CkptGraphValueError
from ckpt_graph.engine.decisions import normalize_policy, policy_names
from ckpt_graph.engine.lowering import needs_region
from ckpt_graph.engine.torch_sac import TorchSACPolicy, adapt_if_torch_sac
from ckpt_graph.policies.builtins import Answer, Policy, PolicyLike, save_ops

__all__ = ["any_save", "first_answer", "from_torch_sac"]

_MUST_SAVE = CheckpointPolicy.MUST_SAVE
_PREFER_SAVE = CheckpointPolicy.PREFER_SAVE
_PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


def _normalise(answer: Answer) -> CheckpointPolicy | None:
    """Map torch's bool convention onto decisions (True = MUST_SAVE, False = PREFER_RECOMPUTE)."""
    if answer is True:
        return _MUST_SAVE
    if answer is False:
        return _PREFER_RECOMPUTE
    return answer


def _resolve(policy: PolicyLike, where: str) -> Callable[..., Answer]:
    """Turn a string name into its policy; check that anything else is callable."""
    if isinstance(policy, str):
        resolved: Callable[..., Answer] = normalize_policy(policy)
        return resolved
    if not callable(policy):
        raise CkptGraphTypeError(
            f"ckpt_graph: {where}: expected a policy (a callable or one of the names "
            f"{', '.join(repr(n) for n in policy_names())}), "
            f"got {policy!r} of type {type(policy).__name__}"
        )
    # See Note [torch SAC policies passed as ckpt_graph policies]
    return adapt_if_torch_sac(policy)


class _Combinator(Policy):
    """A policy made of member policies: shared construction, repr and region events."""

    def __init__(self, *policies: PolicyLike) -> None:
        name = type(self).__name__
        if not policies:
            raise CkptGraphValueError(f"ckpt_graph: {name}: needs at least one policy")
        self._given = policies
        self._policies = tuple(_resolve(p, name) for p in policies)

    def _repr_args(self) -> str:
        return ", ".join(repr(p) for p in self._given)

    # Note [Combinator region events]
    # A member's ``on_region_enter`` may raise after earlier members entered (installed
    # module hooks, started a budget run). The engine then pops the combinator without
    # calling its ``on_region_exit`` (Note [Failed policy push] in region.py), so the
    # members that entered are exited here, in reverse order, before the error propagates:
    # otherwise ``save_module_outputs``'s hooks stayed installed and tagged tensors outside
    # any region. On exit every member is exited, even if one raises.
    def on_region_enter(self, region: Any) -> None:
        with ExitStack() as entered:  # See Note [Combinator region events].
            for policy in self._policies:
                enter = getattr(policy, "on_region_enter", None)
                if enter is not None:
                    enter(region)
                leave = getattr(policy, "on_region_exit", None)
                if leave is not None:
                    entered.callback(leave, region)
            entered.pop_all()

    def on_region_exit(self, region: Any) -> None:
        with ExitStack() as leaving:  # every member, in order, even if one raises
            for policy in reversed(self._policies):
                leave = getattr(policy, "on_region_exit", None)
                if leave is not None:
                    leaving.callback(leave, region)

    @property
    def needs_region(self) -> bool:
        """Whether a member needs the region at run time (then no lowering under compile).

        See Note [Regions under torch.compile] in engine/lowering.py.
        """
        return any(needs_region(p) for p in self._policies)


class first_answer(_Combinator):
    """Ask the policies in order; the first answer that is not None wins.

    Policy names ("recompute_all", "must_save_all", "save_matmuls") are accepted in place of
    policies. See Note [Policy names].

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
        self._fn: TorchSACPolicy | None = None
        self._ops: save_ops | None = None
        if isinstance(policy_fn_or_op_list, list | tuple):
            self._ops = save_ops(*policy_fn_or_op_list)
        elif callable(policy_fn_or_op_list):
            self._fn = TorchSACPolicy(policy_fn_or_op_list)
        else:
            raise CkptGraphTypeError(
                "ckpt_graph: from_torch_sac: expected a SAC policy function (ctx, op, *args, **kwargs) or a "
                f"list of aten ops, got {policy_fn_or_op_list!r}"
            )

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        if self._ops is not None:
            return self._ops(ctx, out, op)
        assert self._fn is not None
        return self._fn(ctx, out, op, *args, **kwargs)

    def _repr_args(self) -> str:
        if self._ops is not None:
            return "[" + ", ".join(self._ops._ops.names) + "]"
        assert self._fn is not None
        return self._fn.name
