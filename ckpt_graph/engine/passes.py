"""Backward passes of a region: use counts, transient values, end-of-pass cleanup.

# Note [Use counts and freeing]
# Each backward pass of a region starts at the first unpack whose autograd graph task id
# differs from the last one seen. It computes, for every recomputed handle, its use count
# for the pass (``Handle.pass_uses``): the saved tensors still alive that refer to it, plus
# every op node that will have to run and takes it as input. Op nodes are recorded in
# forward order, which is a topological order, so one sweep from the last node back
# decides which nodes will run (some recomputed output is pending) and adds their inputs.
# When a node runs, its outputs with a pending use are cached and the others dropped at
# once; each of its inputs loses one use. An unpack takes one use of its handle. A cached
# value is freed (``cache = None``) the moment its use count reaches zero. The pass ends
# with an autograd engine callback that frees whatever a partial backward left cached
# (``torch.autograd.grad`` on part of the outputs, ``inputs=``); the next pass, e.g. after
# ``retain_graph=True``, counts again from scratch.
#
# Note [Transient values]
# Caching every recomputed value until its last use can hold more than the forward did: in
# a residual network with only the matmul outputs kept, the first unpack of backward
# recomputes the residual stream from the first block to the last, and each residual value
# stays cached until its own block's backward. Cheap values are therefore *transient*: not
# cached between uses, but recomputed at each use. After the use counts of a pass are set,
# one forward sweep marks a recomputed handle ``h`` transient when
# - its producer is pointwise (``OpInfo.is_pointwise``), not random, not in place, and has
#   the single tensor output ``h``;
# - ``h`` is not a view, has no views, has two or more pending uses, and has at least
#   ``TRANSIENT_MIN_BYTES`` (an extra run costs microseconds of Python: not worth it for
#   small values);
# - every recomputed input of the producer is either a view of a kept value (free to hold)
#   or is not transient (so each recomputation is one op), not a view, and has a pending
#   use besides the producer (it is cached after the producer ran anyway); these inputs
#   add up to no more bytes than ``h``.
#
# The uses of the producer's inputs are tied to the uses of ``h``: each input gets
# ``h.pass_uses - 1`` extra uses, running the producer releases nothing, and every use of
# ``h`` served releases one use of each input. So the inputs stay cached exactly as long as
# ``h`` could be needed again, whatever the number of actual runs. The cached value of ``h``
# is dropped as soon as no op node waiting to run needs it: ``realize`` *pins* a transient
# input when it expands a node and unpins it after the node ran
# (``Handle.waiting_readers``), and ops in one realize share one run. Memory never grows: at
# any time the producer's recomputed inputs held for ``h`` (no more bytes than ``h``, and
# cached for other users anyway) replace ``h`` itself; the cost is one cheap pointwise op
# per extra use. In the residual example, the value between attention and MLP (``x + attn``)
# becomes transient and half of the residual stream is no longer cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ckpt_graph.engine.cache_bound import decide_bound, plan_bound
from ckpt_graph.engine.graph import Handle, version_of
from ckpt_graph.engine.holding import detached, unhold

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.region import Region
    from ckpt_graph.engine.segment_plan import SegmentProfile

__all__ = [
    "TRANSIENT_MIN_BYTES",
    "PassState",
    "begin_pass",
    "decide",
    "end_pass",
    "live_forward",
]


class PassState:
    """Per-region state of the current backward pass."""

    __slots__ = (
        "active",
        "cached_bytes",
        "checkpoints",
        "closed_segments",
        "closing",
        "cuts",
        "need",
        "number",
        "peak_cached_bytes",
        "pinned",
        "profile",
        "recomputed_ops",
        "roots",
        "segment",
        "segment_limit",
        "task",
        "undecided",
    )

    def __init__(self) -> None:
        self.task = -2
        self.number = 0
        self.recomputed_ops = 0
        self.cached_bytes = 0
        self.peak_cached_bytes = 0
        # See Note [Bounded recompute cache]; segment_limit 0: the pass caches without bound,
        # else the planned peak of the cache, with segments closed at ``cuts`` (op indices).
        self.segment_limit = 0
        self.cuts: list[int] = []
        self.undecided = False  # an automatic bound waits for the first realize that caches
        self.profile: SegmentProfile | None = None  # until decided and the tail cut placed
        self.segment: list[Handle] = []
        self.closing = False  # whether the running realize may close segments
        self.closed_segments = 0  # in the current or last pass
        self.active: dict[Handle, None] = {}  # values of this realize that `need` > 0
        self.need: dict[Handle, int] = {}  # per value, collected ops of the realize to read it
        self.checkpoints: set[Handle] = set()
        self.pinned: list[Handle] = []  # checkpoints of the last cut, until the next close
        self.roots: dict[Handle, Handle] = {}  # memo of ``cache_bound.root_of``


def begin_pass(region: Region, task: int) -> None:
    """Reset use counts for a new backward pass. See Note [Use counts and freeing]."""
    state = region.pass_state
    if state.task != -2:
        end_pass(region)
    state.task = task
    state.number += 1
    state.recomputed_ops = 0
    state.peak_cached_bytes = 0
    _recompute_changed_kept(region)
    state.closed_segments = 0
    bound = region.cache_limit != "unbounded"
    last: dict[Handle, int] = {}  # last consumer that will run, per recomputed value
    for node in reversed(region.nodes):
        needed = False
        for o in node.outputs:
            if o is not None and o.reason is None:
                o.pass_uses += o.saved_refs
                if o.pass_uses > 0:
                    t = live_forward(o)  # See Note [Live forward tensors].
                    if t is None:
                        needed = True
                    else:
                        o.cache = t
                        o.live = True
        if needed:
            for i in node.inputs:
                if i.reason is None:
                    i.pass_uses += 1
                    if bound and i not in last:
                        last[i] = node.index
    if bound:
        plan_bound(region, last)
    if state.segment_limit == 0 and not state.undecided:
        _mark_transient(region)
    if task != -1:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: end_pass(region))


# Note [Live forward tensors]
# A recomputed value whose forward tensor the program still holds (the handle's weak
# reference is alive) and that nothing has changed since autograd saved it is read as that
# tensor, as eager reads it, instead of being recomputed: when unpacked, and as an input of
# the values recomputed from it. Its memory is the program's anyway: recomputing it held a
# second copy (an RNN loop's output buffer, which the caller still holds in backward,
# peaked one buffer above eager), and needed the values it was computed from, which may
# have been written since (a region input written after the region, which eager never
# saved, raised the version error where eager runs, also when the held value was only an
# input of the value unpacked: ``h0 = inp * 2; h = tanh(h0 @ w) + h0`` with ``h0`` held).
# "Unchanged" is checked on the elements, not on the Python object:
#   1. the tensor's version is the handle's (an in-place write bumps it), and no write of
#      the region went over the value through an alias with a counter of its own
#      (``superseded``), and
#   2. it still has the storage autograd saved (``Handle.storage``, a weak reference, so
#      an address cannot be taken over by another storage while the handle exists), at the
#      same offset, with the same sizes, strides and dtype. Assigning ``y.data = z`` swaps
#      the storage of the same object and keeps its version; eager's saved output keeps the
#      old storage, so the value is then recomputed.
# Only values autograd saved have a storage to compare: a held value that no op saved is
# recomputed as before. At the start of a pass (``begin_pass``), each recomputed value
# with pending uses that is live becomes its cache for the pass (``Handle.live``): its
# producer then runs only for other outputs, so the values it was computed from take no
# use for it. A live cache is not counted in ``cached_bytes``, never transient, never part
# of a bounded segment, and a recorded write is never replayed on it (``run_node`` copies).


def live_forward(h: Handle) -> torch.Tensor | None:
    """The forward tensor of ``h``, if still held and unchanged. See Note [Live forward
    tensors]."""
    t = h.ref() if h.ref is not None else None
    if (
        t is None
        or not h.storage
        or h.superseded
        or h.version == -1
        or version_of(t) != h.version
        or t.untyped_storage()._cdata != h.storage
        or t.storage_offset() != h.storage_offset
        or t.shape != h.shape
        or t.stride() != h.stride
        or t.dtype != h.dtype
    ):
        return None
    return t


# Note [Kept values changed after the region]
# The region keeps values autograd never saved (by policy, by tag, a slice of a tagged
# tensor, the engine's own keeps). Writing such a tensor in place after the region is legal
# in eager, where nothing refers to the old value; the region, though, may need it to
# recompute other values. At the start of each backward pass, a kept op node output whose
# version changed and that no saved tensor refers to is recomputed from now on (dropped, as
# if the policy had said so), when its producer's inputs are still available: kept and
# unchanged, or themselves recomputable. A changed value that cannot be recomputed (a
# region input, a snapshot, an input already released) still raises the version error
# when used.
def _recompute_changed_kept(region: Region) -> None:
    """See Note [Kept values changed after the region]."""
    if not any(o is not None and _changed(o) for node in region.nodes for o in node.outputs):
        return
    unavailable: set[Handle] = set()
    for h in region.inputs:
        if _changed(h) or (h.value is None and _forward_tensor(h) is None):
            unavailable.add(h)
    nodes = region.nodes
    for node in nodes:
        inputs_ok = not any(i in unavailable for i in node.inputs)
        for o in node.outputs:
            if o is None:
                continue
            if o.reason is None:
                if not inputs_ok:
                    unavailable.add(o)
            elif _changed(o):
                if not inputs_ok or o.saved_refs > 0:
                    unavailable.add(o)
                    continue
                unhold(region, o)
                _hold_inputs(region, node)
            elif o.value is None and _forward_tensor(o) is None:
                unavailable.add(o)


def _forward_tensor(h: Handle) -> torch.Tensor | None:
    """The forward tensor of a released kept value, if it still holds that value."""
    t = h.ref() if h.ref is not None else None
    if t is None or h.version == -1 or version_of(t) != h.version:
        return None
    return t


def _hold_inputs(region: Region, node: OpNode) -> None:
    """Hold again the released kept values that recomputing ``node`` reads."""
    stack = list(node.inputs)
    seen: set[Handle] = set()
    while stack:
        h = stack.pop()
        if h in seen:
            continue
        seen.add(h)
        if h.reason is None:
            stack.extend(region.nodes[h.node_index].inputs)
        elif h.value is None:
            t = _forward_tensor(h)
            if t is not None:
                h.value = detached(region, t)
                h.copied = False


def _changed(h: Handle) -> bool:
    """Whether a kept value's tensor was written since the region kept it."""
    v = h.value
    return (
        v is not None
        and h.offload_device is None
        and h.version != -1
        and version_of(v) != h.version
    )


# Values below this size stay cached: an extra run costs ~10 us of Python per use, more than
# recomputing or holding a small tensor is worth. See Note [Transient values].
TRANSIENT_MIN_BYTES = 64 * 1024


def _mark_transient(region: Region) -> None:
    """Mark the pass's transient values. See Note [Transient values]."""
    for node in region.nodes:
        info = node.info
        if not info.is_pointwise or info.writes or info.is_random:
            continue
        outs = node.outputs
        if len(outs) != 1:
            continue
        h = outs[0]
        if (
            h is None
            or h.reason is not None
            or h.live
            or h.pass_uses < 2
            or h.is_view
            or h.has_views
            or h.nbytes < TRANSIENT_MIN_BYTES
        ):
            continue
        nbytes = 0
        for i in node.inputs:
            if i.reason is None and not _aliases_kept(region, i):
                if i.transient or i.is_view or i.pass_uses < 2:
                    break
                nbytes += i.nbytes
        else:
            if nbytes <= h.nbytes:
                h.transient = True
                node.transient = True
                extra = h.pass_uses - 1
                for i in node.inputs:
                    if i.reason is None:
                        i.pass_uses += extra


def _aliases_kept(region: Region, h: Handle) -> bool:
    """Whether ``h`` is a view of a kept value (through views only): holding it is free."""
    while h.is_view and h.reason is None:
        node = region.nodes[h.node_index]
        if not node.inputs:
            return False
        h = node.inputs[0]
    return h.reason is not None


def decide(region: Region, h: Handle) -> None:
    """Take the automatic bound's decision if realizing ``h`` caches anything; an unbounded
    pass marks its transient values then. See Note [Bounded recompute cache], rule 1."""
    if decide_bound(region, h) is False:
        _mark_transient(region)


def end_pass(region: Region) -> None:
    """Free everything the pass left cached and forget its use counts."""
    state = region.pass_state
    state.task = -2
    state.cached_bytes = 0
    bounded = state.segment_limit > 0
    state.segment_limit = 0
    state.cuts = []
    state.undecided = False
    state.profile = None
    state.segment = []
    state.active = {}
    state.need = {}
    state.checkpoints = set()
    state.pinned = []
    for node in region.nodes:
        if node.transient:
            node.transient = False
        if bounded:
            node.owed = False
        for o in node.outputs:
            if o is not None:
                o.pass_uses = 0
                o.cache = None
                o.live = False
                o.transient = False
                o.waiting_readers = 0
