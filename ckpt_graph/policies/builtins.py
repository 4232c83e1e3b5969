"""Built-in op-level policies: select by op, keep matmuls, offload; the policy base class.

Every built-in is a small callable object ``policy(ctx, out, op, *args, **kwargs)`` with a
readable ``repr`` (the engine names policies by their ``repr`` in error messages). They can be
passed to ``ckpt_graph.save_recompute_policy`` directly, nested, or combined with
``first_answer`` and ``any_save`` (``compose.py``).

Example:
    >>> import torch, ckpt_graph as cg
    >>> from ckpt_graph import policies
    >>> aten = torch.ops.aten
    >>> with cg.save_recompute_policy(policies.save_ops(aten.mm)):  # doctest: +SKIP
    ...     y = model(x)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphTypeError
from ckpt_graph.engine.decisions import register_policy_name

__all__ = [
    "Answer",
    "Policy",
    "PolicyLike",
    "offload",
    "recompute_ops",
    "save_matmuls",
    "save_ops",
]

Answer: TypeAlias = CheckpointPolicy | bool | None
"""What a policy returns for one op: a decision, a bool (torch's convention), or None."""

PolicyLike: TypeAlias = Callable[..., Answer] | str
"""Anything accepted where a policy is expected: a callable or a string name."""

_MUST_SAVE = CheckpointPolicy.MUST_SAVE
_PREFER_SAVE = CheckpointPolicy.PREFER_SAVE
_PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE

# Note [Built-in policy strengths]
#
# The policy stack (see Note [Policy stack resolution] in engine/decisions.py) starts at PREFER_SAVE,
# lets a PREFER_* answer replace any PREFER_* decision, lets a MUST_* answer replace any
# PREFER_*, and raises on two different MUST_* answers. The built-ins pick their strengths so
# that any nesting of them resolves without an error and means what a user expects:
#
# 1. A *positive selection to keep* (save_ops matches, save_matmuls matches, from_torch_sac op
#    lists, save_module_outputs' tags) is MUST_SAVE. A MUST is needed for two nested "save X"
#    policies to give the union "save X and Y": with PREFER_SAVE the inner policy's "recompute
#    the rest" (a PREFER) would undo the outer one's selection. Two saves never conflict: they
#    are the same MUST.
# 2. "Recompute the rest" is PREFER_RECOMPUTE, exactly what the string "recompute_all" answers,
#    so a built-in never overrides anyone's MUST and never conflicts with one.
# 3. recompute_ops answers PREFER_RECOMPUTE for its matches and abstains (None) otherwise: it
#    states a preference ("these are cheap, do not keep them") that a MUST_SAVE from another
#    policy or a tag wins over, silently. Pass ``must=True`` for MUST_RECOMPUTE when a conflict
#    with a MUST_SAVE should be an error instead.
# 4. offload answers PREFER_CPU_OFFLOAD for what it selects and abstains otherwise: keeping a
#    value on the device (MUST_SAVE) and keeping it in host memory are both "keep"; the MUST
#    one wins without an error. Because PREFER answers replace each other innermost-last, put
#    offload *inside* a policy that recomputes the rest (or compose with first_answer), not
#    outside it. ``must=True`` gives MUST_CPU_OFFLOAD.
# 5. Combinators return one of their members' answers (bools normalised to decisions), so they
#    add no strength of their own.
#
# Consequence: any nesting of save_ops / save_matmuls / save_module_outputs / recompute_ops /
# offload / "recompute_all" / "must_save_all" with default arguments resolves without a
# conflict; only ``must=True`` variants can meet a different MUST and raise.


class Policy(abc.ABC):
    """Base class of the built-in policies: a callable with a readable ``repr``.

    Subclasses implement ``__call__`` and ``_repr_args``. The engine may also call the optional
    methods ``on_region_enter(region)`` and ``on_region_exit(region)`` when a region using the
    policy opens and closes; the base class does nothing there.

    Example:
        >>> class every_other(Policy):
        ...     def __call__(self, ctx, out, op, *args, **kwargs):
        ...         return ctx.op_index % 2 == 0
        ...     def _repr_args(self):
        ...         return ""
        >>> every_other()
        every_other()
    """

    @abc.abstractmethod
    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        """Decide for one recorded op; see the module docstring."""

    @abc.abstractmethod
    def _repr_args(self) -> str:
        """The text between the parentheses of the ``repr``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_args()})"


class _OpSet:
    """A set of aten ops matched by overload or by packet (all overloads of a name).

    Invariants:
        ``overloads`` holds the OpOverloads given; ``packets`` the OpOverloadPackets given; an op
        matches if it is in ``overloads`` or its ``overloadpacket`` is in ``packets``.
        ``memo`` caches that answer per op: policies run once per recorded op.
    """

    __slots__ = ("given", "memo", "names", "overloads", "packets")

    def __init__(self, ops: Iterable[object], where: str) -> None:
        overloads: set[OpOverload] = set()
        packets: set[OpOverloadPacket] = set()
        given: list[OpOverload | OpOverloadPacket] = []
        for op in ops:
            if isinstance(op, OpOverload):
                overloads.add(op)
            elif isinstance(op, OpOverloadPacket):
                packets.add(op)
            else:
                raise CkptGraphTypeError(
                    f"ckpt_graph: {where}: expected aten ops such as torch.ops.aten.mm or "
                    f"torch.ops.aten.mm.default, got {op!r} of type {type(op).__name__}"
                )
            given.append(op)
        self.overloads = frozenset(overloads)
        self.packets = frozenset(packets)
        self.given = tuple(given)
        self.names = tuple(str(op) for op in given)
        # Keyed by id (``OpOverload.__hash__`` is Python code, and this runs for every op);
        # the op is stored with its answer so that a reused id cannot match.
        self.memo: dict[int, tuple[object, bool]] = {}

    def __contains__(self, op: object) -> bool:
        entry = self.memo.get(id(op))
        if entry is not None and entry[0] is op:
            return entry[1]
        packet = getattr(op, "overloadpacket", None)
        hit = op in self.overloads or (packet is not None and packet in self.packets)
        self.memo[id(op)] = (op, hit)
        return hit


class save_ops(Policy):
    """Keep the outputs of the given ops (MUST_SAVE); recompute everything else.

    Ops are matched by ``OpOverload`` (``torch.ops.aten.mm.default``) or by packet
    (``torch.ops.aten.mm`` matches ``aten.mm.default`` and ``aten.mm.out``). Unlike torch's
    op lists, packets are accepted.

    Args:
        *ops: the aten ops whose outputs are kept.
        rest: the answer for every other op. The default PREFER_RECOMPUTE gives torch's
            op-list behaviour; pass ``None`` to abstain, e.g. inside :func:`first_answer`.

    Note:
        Matches answer MUST_SAVE and the rest PREFER_RECOMPUTE so that nested ``save_ops``
        keep the union of their ops. See Note [Built-in policy strengths].

    Example:
        >>> aten = torch.ops.aten
        >>> with cg.save_recompute_policy(save_ops(aten.mm, aten.addmm)):  # doctest: +SKIP
        ...     y = mlp(x)
        >>> save_ops(aten.mm, aten.addmm.default)
        save_ops(aten.mm, aten.addmm.default)
    """

    def __init__(
        self, *ops: OpOverload | OpOverloadPacket, rest: CheckpointPolicy | None = _PREFER_RECOMPUTE
    ) -> None:
        self._ops = _OpSet(ops, "save_ops")
        if rest is not None and not isinstance(rest, CheckpointPolicy):
            raise CkptGraphTypeError(
                f"ckpt_graph: save_ops: rest must be a CheckpointPolicy or None, got {rest!r}"
            )
        self._rest = rest

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        return _MUST_SAVE if op in self._ops else self._rest

    @property
    def ops(self) -> tuple[OpOverload | OpOverloadPacket, ...]:
        """The ops this policy matches, as given (overloads and packets)."""
        return self._ops.given

    def _repr_args(self) -> str:
        parts = list(self._ops.names)
        if self._rest is not _PREFER_RECOMPUTE:
            parts.append(f"rest={self._rest}")
        return ", ".join(parts)


class recompute_ops(Policy):
    """Recompute the outputs of the given ops; abstain for every other op.

    Meant for cheap ops (activations, views, pointwise) under a policy that keeps a lot, or
    under no other policy: the stack's starting decision PREFER_SAVE then keeps the rest.

    Args:
        *ops: the aten ops to recompute, by ``OpOverload`` or packet as in :class:`save_ops`.
        must: answer MUST_RECOMPUTE instead of PREFER_RECOMPUTE, so that a MUST_SAVE from
            another policy for the same op is an error rather than silently winning.

    Note:
        See Note [Built-in policy strengths] for why the default is PREFER_RECOMPUTE.

    Example:
        >>> aten = torch.ops.aten
        >>> with cg.save_recompute_policy(recompute_ops(aten.gelu, aten.relu)):  # doctest: +SKIP
        ...     y = mlp(x)  # everything but the activations is kept
        >>> recompute_ops(aten.gelu, must=True)
        recompute_ops(aten.gelu, must=True)
    """

    def __init__(self, *ops: OpOverload | OpOverloadPacket, must: bool = False) -> None:
        self._ops = _OpSet(ops, "recompute_ops")
        self._must = must
        self._answer = _MUST_RECOMPUTE if must else _PREFER_RECOMPUTE

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        return self._answer if op in self._ops else None

    @property
    def ops(self) -> tuple[OpOverload | OpOverloadPacket, ...]:
        """The ops this policy matches, as given (overloads and packets)."""
        return self._ops.given

    def _repr_args(self) -> str:
        return ", ".join([*self._ops.names, *(["must=True"] if self._must else [])])


# Packets whose outputs save_matmuls keeps, when the installed torch has them. matmul and linear
# are composite: the recorder sees the mm / addmm / bmm they decompose into.
MATMUL_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "_int_mm",
    "_scaled_mm",
    "convolution",
    "_convolution",
    "convolution_overrideable",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "mkldnn_convolution",
    "miopen_convolution",
    "miopen_convolution_transpose",
    "miopen_depthwise_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _matmul_packets() -> list[OpOverloadPacket]:
    aten = torch.ops.aten
    return [getattr(aten, name) for name in MATMUL_OP_NAMES if hasattr(aten, name)]


class save_matmuls(save_ops):
    """Keep the outputs of matmuls, convolutions and fused attention; recompute the rest.

    The expensive ops are kept, so backward only recomputes cheap pointwise / normalisation /
    view ops. Matched packets (those present in the installed torch): mm, addmm, bmm, baddbmm,
    addbmm, _int_mm, _scaled_mm, the convolution family (convolution, _convolution, cudnn /
    mkldnn / miopen variants) and the SDPA kernels (_scaled_dot_product_flash_attention,
    _scaled_dot_product_flash_attention_for_cpu, _scaled_dot_product_efficient_attention,
    _scaled_dot_product_cudnn_attention, _scaled_dot_product_fused_attention_overrideable,
    _flash_attention_forward, _efficient_attention_forward). This is JAX's ``dots_saveable``.

    Note:
        MUST_SAVE for matches, PREFER_RECOMPUTE for the rest; see Note [Built-in policy
        strengths].

    Example:
        >>> with cg.save_recompute_policy(save_matmuls()):  # doctest: +SKIP
        ...     y = transformer(x)
        >>> save_matmuls()
        save_matmuls()
    """

    def __init__(self) -> None:
        super().__init__(*_matmul_packets())

    def _repr_args(self) -> str:
        return ""


class offload(Policy):
    """Keep the outputs that ``select`` picks in host memory; abstain for every other op.

    The engine copies offloaded values to host memory when it keeps them and back when
    backward needs them; for CPU tensors offloading is a no-op and the value is simply kept.

    Args:
        select: predicate ``select(ctx, out, op, *args, **kwargs) -> bool``.
        must: answer MUST_CPU_OFFLOAD instead of PREFER_CPU_OFFLOAD.

    Note:
        PREFER_CPU_OFFLOAD by default so that a MUST_SAVE from another policy keeps the value on
        the device instead of raising; nest offload inside a policy that recomputes the rest,
        since the innermost PREFER answer wins. See Note [Built-in policy strengths].

    Example:
        >>> big = offload(lambda ctx, out, op, *a, **k: ctx.out_bytes >= 1 << 20)
        >>> with cg.save_recompute_policy("recompute_all"):  # doctest: +SKIP
        ...     with cg.save_recompute_policy(big):
        ...         y = model(x)  # outputs of 1 MiB or more kept on the host, the rest recomputed
    """

    def __init__(self, select: Callable[..., bool], *, must: bool = False) -> None:
        if not callable(select):
            raise CkptGraphTypeError(
                f"ckpt_graph: offload: select must be a callable predicate, got {select!r}"
            )
        self._select = select
        self._must = must
        self._answer = (
            CheckpointPolicy.MUST_CPU_OFFLOAD if must else CheckpointPolicy.PREFER_CPU_OFFLOAD
        )

    def __call__(self, ctx: Any, out: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Answer:
        return self._answer if self._select(ctx, out, op, *args, **kwargs) else None

    def _repr_args(self) -> str:
        name = getattr(self._select, "__qualname__", None) or repr(self._select)
        return name + (", must=True" if self._must else "")


# The built-ins by name; those that take arguments only say how to call them. See Note
# [Policy names].
register_policy_name("save_matmuls", save_matmuls)
for _name, _example in (
    ("memory_budget", "ckpt_graph.policies.memory_budget(0.5) (one object for every step)"),
    ("save_ops", "ckpt_graph.policies.save_ops(torch.ops.aten.mm)"),
    ("recompute_ops", "ckpt_graph.policies.recompute_ops(torch.ops.aten.gelu)"),
    ("save_module_outputs", 'ckpt_graph.policies.save_module_outputs("blocks.*")'),
    ("offload", "ckpt_graph.policies.offload(lambda ctx, out, op, *a, **k: ctx.out_bytes > 2**20)"),
):
    register_policy_name(_name, example=_example)
