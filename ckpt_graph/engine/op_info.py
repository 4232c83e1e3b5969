"""Per-op schema facts: what the recorder and replay need to know about an aten op.

Computed once per op from its schema and tags (``op_info``), plus what schemas do not say:
ops that write without annotating it, writes that bump no version counter, and ops that
return aliases of their input without saying so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._ops import OpOverload

__all__ = ["UNANNOTATED_ALIASES", "OpInfo", "op_info"]

# Ops returning aliases of their input without saying so in their schema (each output has
# a version counter of its own). See Note [Mutation and views], rule 6 (mutation/writes.py); a
# replayed write to such an output runs on a copy (``realize.run_node``).
UNANNOTATED_ALIASES = frozenset(
    {
        torch.ops.aten.unsafe_split.Tensor,
        torch.ops.aten.unsafe_split_with_sizes.default,
        torch.ops.aten.unsafe_chunk.default,
        torch.ops.aten._unsafe_view.default,
    }
)


@dataclass(frozen=True)
class OpInfo:
    """Schema facts about an op, computed once per op and cached.

    Attributes:
        name: short op name, e.g. ``"aten.mm.default"``.
        writes: positions (int) or keyword names (str) of arguments the op writes.
        returns_written: every return aliases a written argument (``add_``, ``out=``).
        view_outputs: indices of returns that are views of an input (``Tensor(a)``).
        is_random: the op draws from a random generator.
        is_inplace_view: the op changes only the metadata of its input (``t_``).
        is_pointwise: the op is elementwise (``torch.Tag.pointwise``): cheap to run again.
        options: names of the keyword-only ``dtype``, ``layout`` and ``device`` arguments
            of an op that takes no tensor (a factory: ``rand``, ``full``, ``arange``),
            whose result depends on global defaults when they are ``None``. See Note
            [Factory ops].
        silent_writes: the writes bump no version counter, whether or not the schema
            declares them (CPU ``native_batch_norm``; ``rrelu_with_noise``, whose noise
            argument autograd saves before the op writes it): eager autograd cannot see
            them, so a saved tensor of the old value reads the new one.
        silent_args: the written arguments whose write bumps no version counter: all of
            ``writes`` when ``silent_writes``, or some (the noise of ``rrelu_with_noise_``,
            whose ``self`` is written as any in-place op's).
        aliases: some output aliases an argument (``view_outputs`` or ``returns_written``).
        may_be_transient: pointwise, not random, writes nothing: a single output of the op
            may be transient (Note [Transient values]).
    """

    name: str
    writes: tuple[int | str, ...]
    returns_written: bool
    view_outputs: tuple[int, ...]
    is_random: bool
    is_inplace_view: bool
    silent_writes: bool = False
    is_pointwise: bool = False
    silent_args: tuple[int | str, ...] = ()
    options: tuple[str, ...] = ()
    aliases: bool = False
    may_be_transient: bool = False

    @property
    def is_inplace(self) -> bool:
        """Whether the op mutates one of its arguments."""
        return bool(self.writes)


# Ops that update running statistics without a write annotation in their schema: on CPU
# `native_batch_norm` updates running_mean/running_var in place and does not even bump
# their version counters. See Note [Mutation and views].
_UNANNOTATED_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}

# Ops whose schema declares a write that bumps no version counter in eager, by argument:
# ``rrelu_with_noise`` fills its noise argument, which its backward formula reads, and
# autograd saves that argument before the op runs; the in-place ``rrelu_with_noise_``
# (``nn.RReLU(inplace=True)``, ``F.rrelu_``) fills it the same way, while its ``self`` is
# written (and bumped) as any in-place op's. See Note [Silent writes] in mutation/silent_writes.py.
_UNVERSIONED_WRITES: dict[str, tuple[int, ...]] = {
    "aten::rrelu_with_noise": (1,),
    "aten::rrelu_with_noise_": (1,),
}

_OP_INFO: dict[OpOverload, OpInfo] = {}


def op_info(op: OpOverload) -> OpInfo:
    """Return the cached :class:`OpInfo` of ``op``."""
    info = _OP_INFO.get(op)
    if info is None:
        info = _OP_INFO[op] = _compute_op_info(op)
    return info


def _compute_op_info(op: OpOverload) -> OpInfo:
    schema = op._schema
    writes: list[int | str] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            writes.append(arg.name if arg.kwarg_only else i)
    silent = op.name() in _UNANNOTATED_WRITES and op._overloadname in ("default", "")
    silent_args: tuple[int | str, ...] = ()
    if silent:
        writes.extend(_UNANNOTATED_WRITES[op.name()])
        silent_args = tuple(writes)
    elif op.name() in _UNVERSIONED_WRITES and op._overloadname in ("default", ""):
        silent_args = _UNVERSIONED_WRITES[op.name()]
        silent = set(silent_args) == set(writes)
    returns = schema.returns
    returns_written = bool(returns) and all(
        r.alias_info is not None and r.alias_info.is_write for r in returns
    )
    view_outputs = tuple(
        i for i, r in enumerate(returns) if r.alias_info is not None and not r.alias_info.is_write
    )
    options: tuple[str, ...] = ()
    if not any("Tensor" in str(a.type) for a in schema.arguments):  # See Note [Factory ops].
        options = tuple(
            a.name
            for a in schema.arguments
            if a.kwarg_only and a.name in ("dtype", "layout", "device")
        )
    tags = op.tags
    is_random = torch.Tag.nondeterministic_seeded in tags
    is_pointwise = torch.Tag.pointwise in tags
    return OpInfo(
        name=str(op),
        writes=tuple(writes),
        returns_written=returns_written,
        view_outputs=view_outputs,
        is_random=is_random,
        is_inplace_view=torch.Tag.inplace_view in tags,
        silent_writes=silent,
        silent_args=silent_args,
        is_pointwise=is_pointwise,
        options=options,
        aliases=bool(view_outputs) or returns_written,
        may_be_transient=is_pointwise and not writes and not is_random,
    )
