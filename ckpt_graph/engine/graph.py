"""Op nodes and handles: the region's recorded graph.

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
# (``Handle.reason`` says which). Every other value is freed by the forward as usual and
# comes back in backward by realizing its handle (see Note [Realize order]).
#
# Ownership has no cycles once the region is closed: region -> op nodes -> handles -> kept
# values. Handles refer to their producer by position (``node_index``), never by
# reference; a view's handle refers to its ``base`` handle, which never refers back. While
# the region is open, its recorder, saved-tensor hook closures and policy context refer to
# it; closing frees all three. After that nothing refers back to the region but the
# packed objects autograd holds (see Note [Packed lifetime]) and the user's own variable.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from torch._ops import OpOverload

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.engine.op_info import OpInfo

if TYPE_CHECKING:
    from ckpt_graph.engine.modules import ModuleCall

__all__ = ["Handle", "KeptReason", "OpNode", "arg_at", "version_of"]


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
    INPUTS_FREED = "engine: a tag asked to recompute it after its kept inputs were freed"
    SAVED_AFTER_INPUTS_FREED = (
        "engine: saved after the kept values its recomputation reads were freed"
    )

    @property
    def by_engine(self) -> bool:
        """Whether the engine keeps the value for correctness (no policy or tag may recompute it)."""
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
INPUTS_FREED = KeptReason.INPUTS_FREED
SAVED_AFTER_INPUTS_FREED = KeptReason.SAVED_AFTER_INPUTS_FREED


def arg_at(args: Sequence[Any], kwargs: dict[str, Any], where: int | str) -> Any:
    """The argument at a position (int) or keyword (str) of ``OpInfo.writes``."""
    return args[where] if isinstance(where, int) else kwargs.get(where)


_ref_new = weakref.ref.__new__


def version_of(t: torch.Tensor) -> int:
    """``t._version``; 0 for inference tensors, which have no version counter (and cannot
    be modified outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return 0


# Note [A handle is a weak reference]
# A handle needs a weak reference to its forward tensor (``Region.handle_of`` tells a tensor
# it has seen from a new one at the same address; version checks and live forward tensors
# read it). The handle *is* that reference: ``Handle`` subclasses ``weakref.ref`` (as the
# standard library's ``WeakMethod`` and ``KeyedRef`` do), so ``h()`` is the forward tensor or
# ``None``, and a recorded value costs one object, not two (the garbage collector's passes
# grow with the objects a region holds: Note [Objects made per op]). Rules:
#   1. Identity: ``weakref.ref`` compares and hashes by referent, but two handles of one
#      tensor (its values before and after an in-place op) are different values, so
#      ``Handle`` restores ``object``'s ``__eq__``, ``__ne__`` and ``__hash__``.
#   2. Unlinking: the engine makes a handle stop matching its tensor (a silently written
#      value whose version would still match: ``before_write``) with ``unlinked``; ``h.ref``
#      reads ``h`` or ``None`` accordingly, so readers keep the ``h.ref() if h.ref is not
#      None`` form, and the per-op and per-value paths read ``unlinked`` and call ``h()``.
#   3. No cycle: the handle refers to the tensor weakly and the tensor never refers to the
#      handle, as before (Note [Lazy recording]).
class Handle(weakref.ref[torch.Tensor]):
    """One value of the region: an op node output at one version, or a region input.

    Attributes:
        node_index: position of the producing op node in ``region.nodes``; -1 for a
            region input or a value the engine took as is.
        output_index: position among the producer's outputs; -1 for a region input.
        input_index: for a region input (``node_index == -1``), its position in
            ``region.inputs``; -1 for an op node output.
        number: the value's number in the region's pass graph (``PassState.handles``),
            given when the region makes the handle (see Note [Values numbered as
            recorded]); -1 for a handle made outside a region.
        version: the tensor's ``_version`` when this value was current (-1 until first
            observed after an in-place op; see Note [Mutation and views]).
        ref: weak reference to the forward tensor, for version checks: the handle itself
            (see Note [A handle is a weak reference]), or ``None`` once the engine unlinked
            it (a tensor whose version must not match the handle again).
        value: the kept tensor, or ``None`` when the value is recomputed.
        reason: why the value is kept, a :class:`KeptReason` (``None`` when recomputed).
        copied: ``value`` is an exact copy taken before a write (``hold_copy``), with a
            version counter of its own that no later write moves, not an alias of the
            forward tensor (see Note [Version checks through a copied base]).
        offload_device: original device of a value kept in host memory, else ``None``.
        shape, dtype, nbytes: metadata of the value; stride and device are filled in
            when autograd saves it (the fake implementation of ``ckpt_graph::unpack``).
        storage, storage_offset: a weak reference to the storage of the forward tensor
            (``UntypedStorage._weak_ref()``, an int; 0 for none) and its offset in it,
            filled in when autograd first saves the value and freed when the region
            frees its values; a tensor the program still holds is read as it is only
            while it has them (see Note [Live forward tensors]).
        is_view: the value aliases the storage of another handle (a view op output).
        base: for a view (``is_view``), the handle of the value it is a view of, followed
            through views to one that is not a view: the value whose storage and version
            counter it shares (see Note [Mutation and views]); ``None`` otherwise.
        has_views: some view op of the region took this value as input.
        superseded: an in-place op of the region wrote over this value; autograd saved
            tensors of this value raise the version-counter error when unpacked.
        unlinked: the handle no longer matches its forward tensor (``ref`` is ``None``).
        writes: how many writes of the region went over this value (a view's base counts
            the writes through its views).
        base_writes: for a view, its base's ``writes`` when the view was made: a later
            write changed the view's elements (see Note [Mutation and views], rule 6).
        forward_uses: op nodes and saved tensors of the forward that consumed the value,
            counted while recording and never decremented.
        recompute_input: an op node with a recomputed output took the value as input
            (set once, never cleared; before a silent write, see Note [Silent writes]).
        recompute_readers: while the region records, the op nodes with a recomputed
            output that a saved tensor needs (directly or through other recomputed values)
            and that take the value as input, one per input; with ``saved_refs`` it says
            whether the region may read a kept value again (see Note [Kept values live no
            longer than in eager]).
        saved_refs: saved tensors alive now (``hooks.Packed`` objects) that refer to the
            value; each is freed when autograd frees it.
        cache: per backward pass, the recomputed value while it has a use left (see Note
            [Use counts and freeing]).
        live: per backward pass, ``cache`` is the forward tensor the program still holds,
            unchanged, instead of a recomputed value (see Note [Live forward tensors]).
    """

    __slots__ = (
        "__weakref__",
        "base",
        "base_writes",
        "cache",
        "copied",
        "device",
        "dtype",
        "forward_uses",
        "has_views",
        "input_index",
        "is_view",
        "live",
        "nbytes",
        "node_index",
        "number",
        "offload_device",
        "output_index",
        "reason",
        "recompute_input",
        "recompute_readers",
        "saved_refs",
        "shape",
        "storage",
        "storage_offset",
        "stride",
        "superseded",
        "unlinked",
        "value",
        "version",
        "writes",
    )

    # See Note [A handle is a weak reference], rule 1 (assigned from ``object``, so that
    # hashing stays a C call).
    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    def __new__(
        cls,
        t: torch.Tensor,
        node_index: int,
        output_index: int,
        number: int = -1,
        input_index: int = -1,
    ) -> Handle:
        return _ref_new(cls, t)  # type: ignore[no-any-return]

    def __init__(
        self,
        t: torch.Tensor,
        node_index: int,
        output_index: int,
        number: int = -1,
        input_index: int = -1,
    ) -> None:
        self.node_index = node_index
        self.number = number
        self.output_index = output_index
        self.input_index = input_index
        try:  # version_of(), inlined: a handle is made for every op output
            self.version = t._version
        except RuntimeError:
            self.version = 0
        self.unlinked = False  # See Note [A handle is a weak reference], rule 2.
        self.shape = t.shape
        self.dtype = t.dtype
        self.nbytes: int = t.nbytes
        self.value: torch.Tensor | None = None
        self.reason: KeptReason | None = None
        self.copied = False
        self.offload_device: torch.device | None = None
        self.stride: tuple[int, ...] | None = None  # set when autograd saves the value
        self.device: torch.device | None = None  # likewise
        self.storage = 0  # likewise
        self.storage_offset = 0
        self.is_view = False
        self.base: Handle | None = None
        self.base_writes = 0
        self.writes = 0
        self.has_views = False
        self.superseded = False
        self.forward_uses = 0
        self.recompute_input = False
        self.recompute_readers = 0
        self.saved_refs = 0
        self.cache: torch.Tensor | None = None
        self.live = False

    @property
    def ref(self) -> Handle | None:
        """The weak reference to the forward tensor: the handle itself, or ``None`` once
        unlinked. See Note [A handle is a weak reference]."""
        return None if self.unlinked else self

    @ref.setter
    def ref(self, ref: Handle | None) -> None:
        if ref is not None and ref is not self:
            raise CkptGraphValueError(
                "ckpt_graph: Handle.ref can only be set to the handle itself (its forward "
                "tensor) or None (unlinked); pass None to unlink it"
            )
        self.unlinked = ref is None

    @property
    def kept(self) -> bool:
        """Whether the region holds this value (it is never recomputed)."""
        return self.reason is not None

    def keep(self, t: torch.Tensor, reason: KeptReason) -> None:
        """Hold ``t`` as this handle's value for the backward."""
        self.value = t
        self.reason = reason
        self.copied = False

    def free(self) -> None:
        """Free the value: it will be recomputed."""
        self.value = None
        self.reason = None
        self.copied = False

    def __repr__(self) -> str:
        where = "input" if self.node_index < 0 else f"op {self.node_index}[{self.output_index}]"
        state = f"kept ({self.reason})" if self.kept else "recomputed"
        return f"Handle({where}, {tuple(self.shape)}, {self.dtype}, {state})"


# Note [Objects made per op]
# The recorder makes an op node and a handle per output for every op, and every object it
# keeps counts towards the garbage collector's next young-generation pass, which then walks
# them (Note [One recording path], rule 3). So:
#   1. A handle is the weak reference to its forward tensor, not an object holding one
#      (Note [A handle is a weak reference]).
#   2. The pass graph rows of a value, ``(v,)``, are one tuple per number shared by all
#      regions (``passes.one_row``; Note [Values numbered as recorded]).
#   3. ``OpNode`` has ``__slots__`` like ``Handle``: with an instance dictionary, the first
#      backward pass sets ``realized`` and ``pass_id`` after thousands of nodes closed the
#      class's shared key table, and each node then got a dictionary of its own.
#   4. ``record_node`` makes the op node and the handle of a one-tensor op with
#      ``object.__new__`` / ``weakref.ref.__new__`` and sets their fields inline, the same
#      fields to the same values as ``OpNode.__init__`` and ``Handle.__init__``:
#      ``Handle(...)`` goes through ``type.__call__`` and a second evaluation loop, and even
#      a direct ``__init__`` call (a frame, 14 arguments) cost about 700 instructions per op
#      more than the stores. A field added to either class is added there too
#      (tests/engine/test_inline_init.py checks both). Everything else calls the constructors.
# Instructions per phase, before and after: BENCHMARKS.md, "Recording overhead"
# (``benchmarks/bench_overhead_instructions.py``).
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
        module_call: the innermost module call running the op (``None`` outside modules);
            see Note [Module path tracking].
        flops: estimated FLOPs of one run (filled lazily; -1 until asked).
        stack: Python stack of the forward call (only with ``debug=True``).
        checksums: per output, a checksum of the forward value (only with ``debug=True``).
        realized: how many times the op ran during backward passes.
        pass_id: the number of the last backward pass it ran in (``PassState.number``).
    """

    # Slots, as Handle's: see Note [Objects made per op].
    __slots__ = (
        "args",
        "checksums",
        "decided_by",
        "decision",
        "flops",
        "index",
        "info",
        "inputs",
        "kwargs",
        "module_call",
        "module_path",
        "op",
        "out_is_tuple",
        "outputs",
        "pass_id",
        "realized",
        "rng",
        "stack",
    )

    def __init__(
        self,
        index: int,
        op: OpOverload,
        info: OpInfo,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: tuple[Handle, ...],
        outputs: tuple[Handle | None, ...] = (),
        decision: Any = None,
        decided_by: str = "",
        module_path: str = "",
        module_call: ModuleCall | None = None,
        rng: tuple[torch.Generator, torch.Tensor] | None = None,
        out_is_tuple: bool = False,
    ) -> None:
        self.index = index
        self.op = op
        self.info = info
        self.args = args
        self.kwargs = kwargs
        self.inputs = inputs
        self.outputs = outputs
        self.decision = decision
        self.decided_by = decided_by
        self.module_path = module_path
        self.module_call = module_call
        self.rng = rng
        self.out_is_tuple = out_is_tuple
        self.flops = -1
        self.stack: str | None = None
        self.checksums: tuple[tuple[float, float, float] | None, ...] | None = None
        self.realized = 0
        self.pass_id = -1

    def __repr__(self) -> str:
        return f"OpNode(#{self.index} {self.info.name})"
