"""torch's selective-checkpoint protocol, adapted to ckpt_graph's.

A torch SAC policy is ``policy_fn(ctx, op, *args, **kwargs)`` with a
``SelectiveCheckpointContext``; a ckpt_graph policy is ``policy(ctx, out, op, *args,
**kwargs)``. The engine adapts torch's where it meets one: a SAC-signature policy passed as a
ckpt_graph policy, and ``checkpoint(..., context_fn=...)``. ``policies.from_torch_sac`` is the
public spelling of the same adapter.
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine.decisions import PROTOCOL_NAMES, PolicyFn, policy_name

__all__ = [
    "TorchSACPolicy",
    "adapt_if_torch_sac",
    "adapt_torch_sac",
    "has_torch_sac_signature",
    "policy_from_context_fn",
]


class _TorchSACContext:
    """The part of torch's ``SelectiveCheckpointContext`` a SAC policy may read."""

    __slots__ = ("is_recompute", "op_output")

    def __init__(self, op_output: Any) -> None:
        self.is_recompute = False  # ckpt_graph calls policies in forward only
        self.op_output = op_output


class TorchSACPolicy:
    """A torch SAC ``policy_fn(ctx, op, *args, **kwargs)`` called as a ckpt_graph policy.

    The policy gets a context with ``is_recompute=False`` (ckpt_graph asks policies in forward
    only) and ``op_output``, and the op's keyword arguments under their own names (``out=``
    too; see Note [Policy keyword arguments]).
    """

    __slots__ = ("fn", "name")

    def __init__(self, fn: PolicyFn) -> None:
        self.fn = fn
        self.name: str = getattr(fn, "__qualname__", None) or repr(fn)

    def __call__(
        self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | bool | None:
        if "out_" in kwargs or "ctx_" in kwargs or "op_" in kwargs:
            # See Note [Policy keyword arguments]: torch's signature has no ``out``.
            kwargs = {
                (k[:-1] if k.endswith("_") and k[:-1] in PROTOCOL_NAMES else k): v
                for k, v in kwargs.items()
            }
        answer: CheckpointPolicy | bool | None = self.fn(_TorchSACContext(out), op, *args, **kwargs)
        return answer

    def __repr__(self) -> str:
        return f"from_torch_sac({self.name})"


# Note [torch SAC policies passed as ckpt_graph policies]
# A torch selective-checkpoint policy is ``policy_fn(ctx, op, *args, **kwargs)``; a ckpt_graph
# policy gets the op's output first: ``policy(ctx, out, op, *args, **kwargs)``. Called the
# ckpt_graph way, a SAC policy sees the output where it expects the op, matches no op, and
# answers "recompute" for everything: a silent change of what is kept. Where a policy is
# accepted (``normalize_policy``, the combinators' ``_resolve``) its signature is inspected:
#   1. exactly two positional parameters before ``*args``, the second not named ``out``, is
#      torch's signature; ``(ctx, out, *args)`` is not (``out`` says which convention it uses);
#   2. such a policy is adapted as ``policies.from_torch_sac(policy)`` would, with a warning
#      (shown once per policy and call site by Python's default warning filter) naming the fix;
#   3. plain functions are read from their code object (no ``inspect`` on the common path);
#      other callables through ``inspect.signature``; ckpt_graph's own policy objects
#      (their ``__call__`` has ``out``) and callables without a readable signature are taken as they are.
# A policy with ``*args`` only (``lambda *a: ...``) cannot be told apart and is not adapted.


def has_torch_sac_signature(policy: Any) -> bool:
    """Whether ``policy`` is written as ``(ctx, op, *args, **kwargs)``.

    See Note [torch SAC policies passed as ckpt_graph policies].
    """
    fn = policy.__func__ if isinstance(policy, types.MethodType) else policy
    if isinstance(fn, types.FunctionType):
        code = fn.__code__
        if not code.co_flags & inspect.CO_VARARGS:
            return False
        names = code.co_varnames[: code.co_argcount]
        if fn is not policy:  # a bound method: ``self`` is not a policy argument
            names = names[1:]
    else:
        try:
            params = list(inspect.signature(policy).parameters.values())
        except (TypeError, ValueError):
            return False
        if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            return False
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = tuple(p.name for p in params if p.kind in positional)
    return len(names) == 2 and names[1] != "out"


def adapt_torch_sac(policy: Any) -> PolicyFn:
    """``policy`` adapted as ``policies.from_torch_sac(policy)`` would, with a warning.

    See Note [torch SAC policies passed as ckpt_graph policies].
    """
    name = policy_name(policy)
    warnings.warn(
        f"ckpt_graph: policy {name} has torch's selective-checkpoint signature "
        "(ctx, op, *args, **kwargs), not ckpt_graph's (ctx, out, op, *args, **kwargs); it is "
        f"used as policies.from_torch_sac({name}). Pass policies.from_torch_sac({name}) "
        "yourself, or add the `out` parameter, to silence this warning",
        UserWarning,
        stacklevel=4,
    )
    return TorchSACPolicy(policy)


def adapt_if_torch_sac(policy: PolicyFn) -> PolicyFn:
    """``policy`` itself, or adapted with a warning if it has torch SAC's signature."""
    return adapt_torch_sac(policy) if has_torch_sac_signature(policy) else policy


def policy_from_context_fn(context_fn: Callable[[], Any] | None) -> TorchSACPolicy | None:
    """torch's SAC ``context_fn`` as a ckpt_graph policy (None for none or torch's no-op).

    Relies on torch's private ``_CachingTorchDispatchMode.policy_fn`` (pinned by a test in
    tests/integration/test_checkpoint_dropin.py): torch has no public accessor for it.
    """
    from torch.utils import checkpoint as torch_checkpoint

    if context_fn is None or context_fn is torch_checkpoint.noop_context_fn:
        return None
    contexts = context_fn()
    forward_ctx = contexts[0] if isinstance(contexts, tuple) and len(contexts) == 2 else None
    policy_fn = getattr(forward_ctx, "policy_fn", None)
    caching_mode = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
    if caching_mode is None or not isinstance(forward_ctx, caching_mode) or policy_fn is None:
        raise CkptGraphError(
            f"ckpt_graph: checkpoint(context_fn={getattr(context_fn, '__qualname__', context_fn)!r}) "
            f"returned {contexts!r}, which is not torch's selective checkpointing pair from "
            "create_selective_checkpoint_contexts; a region records aten ops itself and cannot "
            "run other context managers around its recompute. Pass "
            "policy=ckpt_graph.policies.from_torch_sac(policy_fn) instead, or enter the "
            "context managers inside the checkpointed function"
        )
    return TorchSACPolicy(policy_fn)
