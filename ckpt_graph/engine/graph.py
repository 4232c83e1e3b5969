"""Op nodes, handles and per-op schema facts: the region's recorded graph.

A region records every aten op that runs inside it as an :class:`OpNode`. Each tensor
output of an op node is a :class:`Handle`. Tensors that did not come from an op of the
region (parameters, the region's inputs) get a handle without a producer: a *region
input*, which is always kept.

# Note [Lazy recording]
# The recorder never copies data. An op node stores the op, its positional and keyword
# arguments with every tensor replaced by the handle of the value it held at that point of
# the forward, and for each tensor output a handle carrying metadata (shape, dtype, bytes).
# Only *kept* handles hold a tensor (``Handle.value``): region inputs, outputs the policy
# stack decided to keep, tagged values and values the engine must keep for correctness
# (``Handle.reason`` says which). Every other value is released by the forward as usual and
# comes back in backward by realizing its handle (see Note [Realize order]).
#
# Ownership has no cycles once the region is closed: region -> op nodes -> handles -> kept
# values. Handles refer to their producer by position (``node_index``), never by
# reference; a view's handle refers to its ``base`` handle, which never refers back. While
# the region is open, its recorder, saved-tensor hook closures and policy context refer to
# it; closing drops all three. After that nothing refers back to the region but the
# packed objects autograd holds (see Note [Packed lifetime]) and the user's own variable.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch._ops import OpOverload

__all__ = ["Handle", "KeptReason", "OpInfo", "OpNode", "arg_at", "op_info", "version_of"]

# Ops returning aliases of their input without saying so in their schema (each output has
# a version counter of its own). See Note [Mutation and views], rule 6 (mutation.py); a
# replayed write to such an output runs on a copy (``realize.run_node``).
UNANNOTATED_ALIASES = frozenset(
    {
        torch.ops.aten.unsafe_split.Tensor,
        torch.ops.aten.unsafe_split_with_sizes.default,
        torch.ops.aten.unsafe_chunk.default,
        torch.ops.aten._unsafe_view.default,
    }
)


class KeptReason(StrEnum):
    """Why a handle's value is kept (``Handle.reason``; ``None`` means recomputed).

    A ``str`` whose value is the readable text (``"policy"``, ``"engine: ..."``), so that
    summaries and exports print it as is. The engine's own reasons (``by_engine``) hold
    whatever a policy or a tag says: recomputing such a value would give wrong results.
    """

    INPUT = "input"
    POLICY = "policy"
    TAG = "tag"
    MUTATED_ALIAS = "engine: value changed by an in-place op on an alias"
    INPLACE_ON_KEPT = "engine: in-place op on a kept value"
    SILENT_WRITE = "engine: written in place without a version bump (backward reads the new value)"
    CLONED_BEFORE_MUTATION = "engine: copy of a kept value taken before an in-place op"
    RANDOM_WITHOUT_REPLAY = "engine: random op on a device without generator replay"

    @property
    def by_engine(self) -> bool:
        """Whether the engine keeps the value for correctness (no policy or tag may drop it)."""
        return self not in _CHOSEN


_CHOSEN = frozenset({KeptReason.INPUT, KeptReason.POLICY, KeptReason.TAG})
INPUT = KeptReason.INPUT
POLICY = KeptReason.POLICY
TAG = KeptReason.TAG
MUTATED_ALIAS = KeptReason.MUTATED_ALIAS
INPLACE_ON_KEPT = KeptReason.INPLACE_ON_KEPT
SILENT_WRITE = KeptReason.SILENT_WRITE
CLONED_BEFORE_MUTATION = KeptReason.CLONED_BEFORE_MUTATION
RANDOM_WITHOUT_REPLAY = KeptReason.RANDOM_WITHOUT_REPLAY


def arg_at(args: Sequence[Any], kwargs: dict[str, Any], where: int | str) -> Any:
    """The argument at a position (int) or keyword (str) of ``OpInfo.writes``."""
    return args[where] if isinstance(where, int) else kwargs.get(where)


_weakref = weakref.ref


def version_of(t: torch.Tensor) -> int:
    """``t._version``; 0 for inference tensors, which have no version counter (and cannot
    be modified outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return 0


class Handle:
    """One value of the region: an op node output at one version, or a region input.

    Attributes:
        node_index: position of the producing op node in ``region.nodes``; -1 for a
            region input or a value the engine took as is.
        index: output index within the producer.
        version: the tensor's ``_version`` when this value was current (-1 until first
            observed after an in-place op; see Note [Mutation and views]).
        ref: weak reference to the forward tensor, for version checks.
        value: the kept tensor, or ``None`` when the value is recomputed.
        reason: why the value is kept, a :class:`KeptReason` (``None`` when recomputed).
        offload_device: original device of a value kept in host memory, else ``None``.
        shape, dtype, nbytes: metadata of the value; stride and device are filled in
            when autograd saves it (the fake implementation of ``ckpt_graph::unpack``).
        is_view: the value aliases the storage of another handle (a view op output).
        base: for a view (``is_view``), the handle of the value it is a view of, followed
            through views to one that is not a view: the value whose storage and version
            counter it shares (see Note [Mutation and views]); ``None`` otherwise.
        has_views: some view op of the region took this value as input.
        superseded: an in-place op of the region wrote over this value; autograd saved
            tensors of this value raise the version-counter error when unpacked.
        writes: how many writes of the region went over this value (a view's base counts
            the writes through its views).
        base_writes: for a view, its base's ``writes`` when the view was made: a later
            write changed the view's elements (see Note [Mutation and views], rule 6).
        uses: number of op nodes and saved tensors of the forward that consumed it.
        packs: number of saved tensors (autograd packs) that refer to it.
        live: after forward, saved tensors and runnable op nodes that may still need the
            value (see Note [Releasing kept values]).
        pending: per backward pass, users that still need the value (see Note [Use counts
            and freeing]).
        cache: per backward pass, the recomputed value while ``pending > 0``.
        transient: per backward pass, a cheap value recomputed at each use instead of
            cached between uses (see Note [Transient values]).
        pins: per backward pass, op nodes waiting to run that need the cached value of a
            transient handle.
    """

    __slots__ = (
        "__weakref__",
        "base",
        "base_writes",
        "cache",
        "device",
        "dtype",
        "has_views",
        "index",
        "is_view",
        "live",
        "nbytes",
        "node_index",
        "offload_device",
        "packs",
        "pending",
        "pins",
        "reason",
        "ref",
        "shape",
        "stride",
        "superseded",
        "transient",
        "uses",
        "value",
        "version",
        "writes",
    )

    def __init__(self, t: torch.Tensor, node_index: int, index: int) -> None:
        self.node_index = node_index
        self.index = index
        try:  # version_of(), inlined: a handle is made for every op output
            self.version = t._version
        except RuntimeError:
            self.version = 0
        self.ref: weakref.ref[torch.Tensor] | None = _weakref(t)
        self.shape = t.shape
        self.dtype = t.dtype
        self.nbytes: int = t.nbytes
        self.value: torch.Tensor | None = None
        self.reason: KeptReason | None = None
        self.offload_device: torch.device | None = None
        self.stride: tuple[int, ...] | None = None  # set when autograd saves the value
        self.device: torch.device | None = None  # likewise
        self.is_view = False
        self.base: Handle | None = None
        self.base_writes = 0
        self.writes = 0
        self.has_views = False
        self.superseded = False
        self.uses = 0
        self.packs = 0
        self.live = 0
        self.pending = 0
        self.cache: torch.Tensor | None = None
        self.transient = False
        self.pins = 0

    @property
    def kept(self) -> bool:
        """Whether the region holds this value (it is never recomputed)."""
        return self.reason is not None

    def keep(self, t: torch.Tensor, reason: KeptReason) -> None:
        """Hold ``t`` as this handle's value for the backward."""
        self.value = t
        self.reason = reason

    def drop(self) -> None:
        """Stop holding the value: it will be recomputed."""
        self.value = None
        self.reason = None

    def __repr__(self) -> str:
        where = "input" if self.node_index < 0 else f"op {self.node_index}[{self.index}]"
        state = f"kept ({self.reason})" if self.kept else "recomputed"
        return f"Handle({where}, {tuple(self.shape)}, {self.dtype}, {state})"


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
# written (and bumped) as any in-place op's. See Note [Silent writes] in write_prep.py.
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
    return OpInfo(
        name=str(op),
        writes=tuple(writes),
        returns_written=returns_written,
        view_outputs=view_outputs,
        is_random=torch.Tag.nondeterministic_seeded in tags,
        is_inplace_view=torch.Tag.inplace_view in tags,
        silent_writes=silent,
        silent_args=silent_args,
        is_pointwise=torch.Tag.pointwise in tags,
        options=options,
    )


class OpNode:
    """One recorded op call of the region.

    Attributes:
        index: position in the region's forward (0-based).
        op: the aten ``OpOverload``.
        info: its :class:`OpInfo`.
        args, kwargs: the call's arguments with tensors replaced by handles (lists of
            tensors become lists of handles).
        inputs: the distinct handles among the arguments.
        outputs: one handle per tensor output (``None`` for non-tensor outputs).
        out_is_tuple: whether the op returned a tuple/list (vs. a single tensor).
        rng: ``(generator, state)`` captured just before a random op ran, else ``None``.
        decision: the resolved :class:`~torch.utils.checkpoint.CheckpointPolicy`.
        decided_by: name of the policy that set the decision (``""`` for the default,
            ``"engine"`` for an op node the engine added).
        module_path: qualified name of the innermost module running the op.
        flops: estimated FLOPs of one run (filled lazily; -1 until asked).
        stack: Python stack of the forward call (only with ``debug=True``).
        checksums: per output, a checksum of the forward value (only with ``debug=True``).
        realized: how many times the op ran during backward passes.
        transient: per backward pass, its output is transient (see Note [Transient values]).
        owed: per bounded pass, an output was dropped while pending: the op runs again
            (see Note [Bounded recompute cache]).
    """

    # Class-level defaults (OpNode has no ``__slots__``, unlike Handle, whose every field
    # ``__init__`` sets): ``__init__`` sets what every node has; the rest reads these until
    # an instance sets its own, so a plain op node costs six attribute stores.
    outputs: tuple[Handle | None, ...] = ()
    out_is_tuple = False
    rng: tuple[torch.Generator, torch.Tensor] | None = None
    decision: Any = None
    decided_by = ""
    module_path = ""
    flops = -1
    stack: str | None = None
    checksums: tuple[tuple[float, float, float] | None, ...] | None = None
    realized = 0
    pass_id = -1
    live = False
    transient = False
    owed = False

    def __init__(
        self,
        index: int,
        op: OpOverload,
        info: OpInfo,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: tuple[Handle, ...],
    ) -> None:
        self.index = index
        self.op = op
        self.info = info
        self.args = args
        self.kwargs = kwargs
        self.inputs = inputs

    def __repr__(self) -> str:
        return f"OpNode(#{self.index} {self.info.name})"
