"""Decisions and the policy stack: how nested policies answer for one op.

# Note [Policy stack resolution]
# A region's policies form a stack, one entry per open ``save_recompute_policy`` block,
# asked outermost to innermost, once per recorded op during the forward (never during
# backward or recompute). The decision starts at PREFER_SAVE, plain autograd behaviour.
#   1. ``None`` abstains: the decision is unchanged.
#   2. ``True`` means MUST_SAVE and ``False`` PREFER_RECOMPUTE (torch's convention).
#   3. A PREFER_* answer replaces the current decision unless that is a MUST_*.
#   4. A MUST_* answer replaces any PREFER_*; a different MUST_* already in place is a
#      conflict, reported with the op and both policies (no silent winner).
# Anything else a policy returns is a CkptGraphError naming the policy and the op; not a
# TypeError, which torch turns into NotImplemented when the op runs under a Python operator
# (``x * 2``, ``a @ b``): Python then raised "unsupported operand type(s)" and the message
# was lost. Tags (``tag_with_policy``) are applied after the stack and override it for one
# value.
#
# Note [Policy keyword arguments]
# A policy is called as ``policy(ctx, out, op, *args, **kwargs)``: the op's positional
# arguments follow ``op``, and its keyword arguments are passed as keywords under their own
# names, except a keyword named like a parameter of the protocol (``ctx``, ``out``, ``op``),
# which would bind to that parameter (or raise "got multiple values for argument"). Such a
# keyword gets a trailing underscore: the op's ``out=`` tensor (``torch.mv(w, v, out=u)``)
# reaches the policy as ``kwargs["out_"]``, while ``out`` is always the op's result. Of
# aten's keyword-only arguments only ``out`` is affected (checked by a test over every
# schema). ``from_torch_sac`` renames it back: torch's SAC signature has no ``out``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphError, CkptGraphTypeError, CkptGraphValueError
from ckpt_graph.engine.flops import estimate_flops

if TYPE_CHECKING:
    from ckpt_graph.engine.lowering import CompileContext
    from ckpt_graph.engine.op_info import OpInfo
    from ckpt_graph.engine.region import Region

__all__ = [
    "POLICY_NAMES",
    "PolicyContext",
    "PolicyFn",
    "normalize_policy",
    "policy_kwargs",
    "policy_names",
    "register_policy_name",
    "resolve",
    "to_decision",
]

PolicyFn = Callable[..., Any]

_MUST = (
    CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE,
    CheckpointPolicy.MUST_CPU_OFFLOAD,
)


class _ConstantPolicy:
    """A policy that gives the same answer for every op (the string-named policies)."""

    __slots__ = ("answer", "name")

    def __init__(self, name: str, answer: CheckpointPolicy) -> None:
        self.name = name
        self.answer = answer

    def __call__(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return self.answer

    def __repr__(self) -> str:
        return repr(self.name)


# The constant policies, one object each: a stack made of them decides without calls.
POLICY_NAMES: dict[str, _ConstantPolicy] = {
    "recompute_all": _ConstantPolicy("recompute_all", CheckpointPolicy.PREFER_RECOMPUTE),
    "must_save_all": _ConstantPolicy("must_save_all", CheckpointPolicy.MUST_SAVE),
}

# Note [Policy names]
# A policy may be given by name wherever a policy is accepted (``save_recompute_policy``,
# ``checkpoint``, ``wrap``, the combinators, the HF integration) and by the same names on the
# command line (``ckpt-graph compare --policy NAME``): one table, so that the two cannot
# disagree. The names are the engine's constant policies (``POLICY_NAMES``) and the built-ins
# of ``ckpt_graph.policies`` that take no argument (``save_matmuls``), which that package
# registers here when it is imported: the engine may not import the stages above it (see
# tests/test_layers.py), and importing any module of ckpt_graph imports the package, which
# imports ``policies``. A registered name stands for a factory, called once per use, so no
# policy object is shared between regions. A built-in that needs arguments (``memory_budget``
# needs a budget, and plans across steps only as one object kept between them) has no name:
# it is registered with an example of the call, which the "unknown policy" error shows.
_FACTORIES: dict[str, Callable[[], PolicyFn]] = {}
_CALL_EXAMPLES: dict[str, str] = {}


def register_policy_name(
    name: str, factory: Callable[[], PolicyFn] | None = None, *, example: str = ""
) -> None:
    """Make ``name`` stand for ``factory()`` wherever a policy is accepted.

    With ``factory=None``, ``name`` is a built-in that takes arguments: using it as a name
    raises, showing ``example`` (a call of it). See Note [Policy names].

    Example:
        >>> register_policy_name("save_matmuls", save_matmuls)  # doctest: +SKIP
        >>> register_policy_name("memory_budget", example="policies.memory_budget(0.5)")  # doctest: +SKIP
    """
    if factory is None:
        _CALL_EXAMPLES[name] = example
    else:
        _FACTORIES[name] = factory


def policy_names() -> tuple[str, ...]:
    """Every name a policy argument accepts, the constant policies first.

    See Note [Policy names].
    """
    return (*POLICY_NAMES, *_FACTORIES)


def normalize_policy(policy: Any) -> PolicyFn:
    """Turn a policy argument (a name of :func:`policy_names` or a callable) into a callable.

    Raises:
        ValueError: for an unknown policy name.
        TypeError: for anything that is neither a string nor callable.
    """
    if isinstance(policy, str):
        constant = POLICY_NAMES.get(policy)
        if constant is not None:
            return constant
        factory = _FACTORIES.get(policy)
        if factory is not None:
            return factory()
        names = ", ".join(repr(n) for n in policy_names())
        example = _CALL_EXAMPLES.get(policy)
        why = (
            f"{policy} takes arguments, so it has no name: pass the policy, e.g. {example}; "
            if example is not None
            else ""
        )
        raise CkptGraphValueError(
            f"ckpt_graph: unknown policy {policy!r}; {why}valid names are {names}, or pass a "
            "callable policy(ctx, out, op, *args, **kwargs) -> CheckpointPolicy | bool | None"
        )
    if callable(policy):
        if not isinstance(policy, _ConstantPolicy):
            from ckpt_graph.engine.torch_sac import adapt_if_torch_sac  # late: it imports us

            return adapt_if_torch_sac(policy)
        return policy
    raise CkptGraphTypeError(
        f"ckpt_graph: a policy must be a name or a callable "
        f"policy(ctx, out, op, *args, **kwargs), got {type(policy).__name__}"
    )


def policy_name(policy: PolicyFn) -> str:
    """A readable name of a policy for error messages and introspection."""
    if isinstance(policy, _ConstantPolicy):
        return policy.name
    name = getattr(policy, "__qualname__", None)
    return name if isinstance(name, str) else repr(policy)


def to_decision(answer: Any, policy: PolicyFn, op_name: str) -> CheckpointPolicy | None:
    """Convert one policy answer to a ``CheckpointPolicy`` (``None`` abstains)."""
    if answer is None or type(answer) is CheckpointPolicy:
        return answer
    if answer is True:
        return CheckpointPolicy.MUST_SAVE
    if answer is False:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if isinstance(answer, CheckpointPolicy):
        return answer
    raise CkptGraphError(  # not a TypeError: see Note [Policy stack resolution]
        f"ckpt_graph: policy {policy_name(policy)} returned {answer!r} for op {op_name}; a policy "
        "must return a torch.utils.checkpoint.CheckpointPolicy, a bool, or None to abstain"
    )


# Keyword names of the policy protocol's own parameters. See Note [Policy keyword arguments].
PROTOCOL_NAMES = ("ctx", "out", "op")


def policy_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's keyword arguments as a policy receives them: a keyword named ``ctx``,
    ``out`` or ``op`` gets a trailing underscore (``out=`` becomes ``out_=``).

    See Note [Policy keyword arguments].

    Example:
        >>> sorted(policy_kwargs({"out": 1, "alpha": 2}))
        ['alpha', 'out_']
    """
    if not ("out" in kwargs or "ctx" in kwargs or "op" in kwargs):
        return kwargs
    return {(k + "_" if k in PROTOCOL_NAMES else k): v for k, v in kwargs.items()}


def resolve(
    stack: list[PolicyFn],
    ctx: PolicyContext | CompileContext,
    out: Any,
    op: Any,
    args: Any,
    kwargs: Any,
    names: list[str] | None = None,
) -> tuple[CheckpointPolicy, str]:
    """Ask every policy of the stack about one op. See Note [Policy stack resolution].

    Each policy is called as ``policy(ctx, out, op, *args, **policy_kwargs(kwargs))``: see
    Note [Policy keyword arguments]. ``names``: the policies' names, when the caller
    keeps them (a name can cost a ``repr`` per op).

    Returns:
        The decision and the name of the policy that set it (``""`` for the default).
    """
    if kwargs:
        kwargs = policy_kwargs(kwargs)
    if len(stack) == 1:  # the common case, without the conflict bookkeeping
        policy = stack[0]
        answer = policy(ctx, out, op, *args, **kwargs)
        if answer is None:
            return CheckpointPolicy.PREFER_SAVE, ""
        if type(answer) is not CheckpointPolicy:
            answer = to_decision(answer, policy, ctx.op_name)
        return answer, names[0] if names is not None else policy_name(policy)
    decision = CheckpointPolicy.PREFER_SAVE
    by = ""
    for k, policy in enumerate(stack):
        answer = to_decision(policy(ctx, out, op, *args, **kwargs), policy, ctx.op_name)
        if answer is None:
            continue
        if answer in _MUST:
            if decision in _MUST and decision is not answer:
                raise CkptGraphError(
                    f"ckpt_graph: conflicting policies for op {ctx.op_name} (#{ctx.op_index}): "
                    f"{by} answered {decision.name} and {policy_name(policy)} answered "
                    f"{answer.name}; make one of them answer a PREFER_* decision or abstain "
                    "(return None) for this op"
                )
        elif decision in _MUST:
            continue
        decision = answer
        by = names[k] if names is not None else policy_name(policy)
    return decision, by


class PolicyContext:
    """What a policy knows about the op it decides on.

    One object per region, updated before each call (policies must not keep it).

    Attributes:
        region: the :class:`~ckpt_graph.engine.region.Region` being recorded.
        op_index: position of the op in the region's forward (0-based).
        op_name: the op's name, e.g. ``"aten.mm.default"``.
        out_bytes: bytes of the op's tensor outputs.
        kept_bytes: bytes the region keeps so far (before this op's decision).
        is_random: the op draws random numbers.
        is_inplace: the op writes one of its arguments.
        module_path: dotted name of the innermost module whose forward is running,
            relative to the outermost module called in the region (``""`` outside modules).
        module: that module, or ``None``.
        flops: estimated FLOPs of the op (``torch.utils.flop_counter`` formulas; 0 if
            unknown).
        compiling: ``False`` here; ``True`` on the context a policy gets while torch.compile
            traces a lowered region (See Note [Regions under torch.compile]).
    """

    __slots__ = ("_args", "_info", "_kwargs", "_op", "_out", "op_index", "region")

    compiling = False

    def __init__(self, region: Region) -> None:
        self.region = region
        self.op_index = 0
        self._op: Any = None
        self._info: OpInfo | None = None
        self._out: Any = None
        self._args: Any = ()
        self._kwargs: Any = {}

    def ask(
        self,
        stack: list[PolicyFn],
        names: list[str] | None,
        index: int,
        op: Any,
        info: OpInfo,
        out: Any,
        args: Any,
        kwargs: Any,
    ) -> tuple[CheckpointPolicy, str]:
        """Point the context at one op, ``resolve`` the stack's decision for it, and drop
        the op's tensors again, so the context holds none between ops (the engine calls it,
        not policies; one call, as it runs for every op a policy function decides)."""
        self.op_index = index
        self._op = op
        self._info = info
        self._out = out
        self._args = args
        self._kwargs = kwargs
        try:
            return resolve(stack, self, out, op, args, kwargs, names)
        finally:
            self._out = self._args = self._kwargs = None

    @property
    def op_name(self) -> str:
        return self._info.name if self._info is not None else "?"

    @property
    def is_random(self) -> bool:
        return self._info is not None and self._info.is_random

    @property
    def is_inplace(self) -> bool:
        return self._info is not None and self._info.is_inplace

    @property
    def out_bytes(self) -> int:
        return tensor_bytes(self._out)

    @property
    def kept_bytes(self) -> int:
        return self.region.kept_bytes

    @property
    def module_path(self) -> str:
        return self.region.module_stack.path()

    @property
    def module(self) -> torch.nn.Module | None:
        return self.region.module_stack.current()

    @property
    def flops(self) -> int:
        return estimate_flops(self._op, self._out, self._args, self._kwargs)


def tensor_bytes(out: Any) -> int:
    """Bytes of the tensors in an op result (a tensor, or a tuple/list of them)."""
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(o.numel() * o.element_size() for o in out if isinstance(o, torch.Tensor))
    return 0
