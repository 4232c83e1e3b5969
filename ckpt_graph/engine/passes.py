"""Backward passes of a region: begin (use counts, plan), the engine's hooks, end; kept
values freed as autograd frees the saved tensors that need them.

A pass runs as a ``pass_core.Pass`` over the region's numbered graph (:func:`pass_graph`),
the rules the liveness simulator runs too (Note [One pass core]); this module adds what only
the engine has: live forward tensors, kept values changed after the region, the autograd
callback that ends a partial backward.

# Note [Use counts and freeing]
# Each backward pass of a region starts at the first unpack whose autograd graph task id
# differs from the last one seen. It computes, for every recomputed handle, its use count
# for the pass (``Pass.uses``): the saved tensors still alive that refer to it, plus
# every op node that will have to run and takes it as input. Op nodes are recorded in
# forward order, which is a topological order, so one sweep from the last node back
# decides which nodes will run (some recomputed output is pending) and adds their inputs.
# When a node runs, its outputs with a pending use are cached and the others dropped at
# once; each of its inputs loses one use. An unpack takes one use of its handle. A cached
# value is freed (``Handle.cache = None``) the moment its use count reaches zero. The pass ends
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
# ``uses[h] - 1`` extra uses, running the producer frees nothing, and every use of
# ``h`` served takes one use of each input. So the inputs stay cached exactly as long as
# ``h`` could be needed again, whatever the number of actual runs. The cached value of ``h``
# is dropped as soon as no op node waiting to run needs it: ``realize`` *pins* a transient
# input when it expands a node and unpins it after the node ran
# (``Pass.waiting``), and ops in one realize share one run. Memory never grows: at
# any time the producer's recomputed inputs held for ``h`` (no more bytes than ``h``, and
# cached for other users anyway) replace ``h`` itself; the cost is one cheap pointwise op
# per extra use. In the residual example, the value between attention and MLP (``x + attn``)
# becomes transient and half of the residual stream is no longer cached.
"""

from __future__ import annotations

import threading
import warnings
from itertools import compress
from typing import TYPE_CHECKING

import torch

from ckpt_graph.engine import cache_bound
from ckpt_graph.engine.graph import version_of
from ckpt_graph.engine.holding import detached, free_kept
from ckpt_graph.engine.pass_core import Executor, Pass
from ckpt_graph.engine.pass_graph import NodeRows, PassGraph, count_uses, is_dead, last_readers
from ckpt_graph.engine.pass_graph import free_use as _free_use

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.region import Region

__all__ = [
    "ONE_ROWS",
    "TRANSIENT_MIN_BYTES",
    "CacheBytes",
    "PassState",
    "begin_pass",
    "count_live_uses",
    "end_pass",
    "free_use",
    "live_forward",
    "number_nodes",
    "one_row",
    "pass_graph",
]


class CacheBytes:
    """Bytes of the recomputed values a pass caches: ``now`` and the ``peak`` of the pass.

    Its own object, shared by ``PassState`` and the pass's executor (``realize.Runner``),
    which counts them without a reference back to the pass state (the state refers to the
    pass, the pass to its executor).
    """

    __slots__ = ("now", "peak")

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0


class PassState:
    """Per-region state of the current (or last) backward pass; ``Region.pass_state``.

    Attributes:
        task: the autograd graph task of the pass (-2 between passes).
        number: passes begun so far.
        recomputed_ops: op node runs in the current or last pass.
        cached_bytes: bytes of the recomputed values cached now (views and live forward
            tensors not counted; read-only, counted in ``cache_bytes``).
        peak_cached_bytes: the most ``cached_bytes`` reached in the current or last pass.
        cache_bytes: the two counts above (:class:`CacheBytes`).
        core: the running pass (``pass_core.Pass``), ``None`` between passes.
        graph: the region's graph numbered for the pass rules (``pass_graph``).
        handles: the region's values by number (``Handle.number``), in the order they were
            made (see Note [Values numbered as recorded]).
        node_inputs: per op node numbered so far (``number_nodes``), the numbers of its
            distinct input values.
        node_outputs: likewise, the numbers of its tensor outputs.
        kept: from region exit on, per value, whether it is kept now (a changed kept value
            becomes recomputed at a pass's start: Note [Kept values changed after the
            region]).
        live_uses: from region exit on, across passes, per value: the saved tensors and op
            nodes that may still run that need it; a kept value is freed at zero (see Note
            [Releasing kept values]).
        may_run: from region exit on, per op node: some recomputed output still has live
            uses, so it may have to run again; once false it never runs again and its
            generator state is freed when its kept outputs have no live use either.
    """

    __slots__ = (
        "_last_closed",
        "cache_bytes",
        "core",
        "graph",
        "handles",
        "kept",
        "live_uses",
        "may_run",
        "node_inputs",
        "node_outputs",
        "number",
        "numbered",
        "recomputed_ops",
        "task",
    )

    def __init__(self) -> None:
        self.task = -2
        self.number = 0
        self.recomputed_ops = 0
        self.cache_bytes = CacheBytes()
        self.core: Pass | None = None
        self.graph: PassGraph | None = None
        self.handles: list[Handle] = []  # See Note [Values numbered as recorded].
        self.node_inputs: list[tuple[int, ...]] = []
        self.node_outputs: list[tuple[int, ...]] = []
        self.kept: list[bool] = []
        self.live_uses: list[int] = []  # See Note [Releasing kept values].
        self.may_run: list[bool] = []
        self.numbered = (-1, -1)  # op nodes and values when ``graph`` was built
        self._last_closed = 0  # segments the last bounded pass closed

    @property
    def cached_bytes(self) -> int:
        """Bytes of the recomputed values cached now (``CacheBytes.now``)."""
        return self.cache_bytes.now

    @property
    def peak_cached_bytes(self) -> int:
        """The most ``cached_bytes`` reached in the current or last pass."""
        return self.cache_bytes.peak

    @property
    def closed_segments(self) -> int:
        """Segments of the bounded cache closed in the current or last pass (See Note
        [Bounded recompute cache])."""
        core = self.core
        if core is not None and core.bound is not None:
            return core.bound.closed_segments
        return self._last_closed


# Note [Values numbered as recorded]
# The pass rules work on integers (Note [One pass core]). A handle gets its number when it
# is made (``Handle.number``, its position in ``PassState.handles``): region inputs as the
# region first sees them, op node outputs as the op node is recorded, so the numbers follow
# the forward. The op node rows of the pass graph (per op node, the numbers of its distinct
# inputs and of its outputs) are not appended while recording: ``number_nodes`` makes the
# rows of the op nodes recorded since it last ran in one sweep over them, at region exit or
# when a pass or the planner first asks. Values are never renumbered and no rule changes an
# op node's ``inputs`` or ``outputs`` once it is recorded, so rows made before stay valid.
# Region exit's sweep of live uses reads only these rows (``pass_graph.NodeRows``); the
# per-value lists (producer, bytes, views) and the op nodes' transient flags are made by
# ``pass_graph`` when a pass, a freed saved tensor's release or the planner first needs
# them, and memoized while the region records nothing new. The rows cost no object per op
# where they can be shared: the one-value row ``(v,)``, an op node's only output or only
# input, is the same tuple in every region (``one_row``: a table grown on demand up to
# ``ONE_ROWS_MAX`` numbers, about 5 MB at most, beyond which rows are made per op), so only
# ops with two or more inputs or outputs make a row of their own: per-op tuples count
# towards the garbage collector's passes (Note [Objects made per op]).


ONE_ROWS: list[tuple[int]] = []  # ONE_ROWS[v] == (v,); grown only by ``one_row``
_ONE_ROWS_LOCK = threading.Lock()
ONE_ROWS_MAX = 1 << 16


def one_row(v: int) -> tuple[int]:
    """The row ``(v,)``, the same tuple in every region for ``0 <= v < ONE_ROWS_MAX``.

    See Note [Values numbered as recorded].

    Example:
        >>> one_row(3), one_row(3) is one_row(3)
        ((3,), True)
    """
    if 0 <= v < len(ONE_ROWS):
        return ONE_ROWS[v]
    if not 0 <= v < ONE_ROWS_MAX:
        return (v,)
    with _ONE_ROWS_LOCK:  # threads extend it one at a time; readers see whole rows
        n = len(ONE_ROWS)
        if v >= n:
            ONE_ROWS.extend([(i,) for i in range(n, min(max(2 * n, v + 1, 256), ONE_ROWS_MAX))])
    return ONE_ROWS[v]


def number_nodes(state: PassState, nodes: list[OpNode]) -> None:
    """Append the pass graph rows of the op nodes recorded since the last call, whose
    inputs and outputs are numbered. See Note [Values numbered as recorded]."""
    start = len(state.node_inputs)
    if start == len(nodes):
        return
    new = nodes[start:] if start else nodes
    if len(state.handles) <= ONE_ROWS_MAX:
        one = ONE_ROWS
        if len(one) < len(state.handles):
            one_row(len(state.handles) - 1)  # grows the table to every number
        # One-value rows from the table, two-value rows made, longer rows from a list.
        state.node_inputs += [
            one[i[0].number]
            if len(i := n.inputs) == 1
            else (i[0].number, i[1].number)
            if len(i) == 2
            else tuple([h.number for h in i])
            for n in new
        ]
        state.node_outputs += [
            tuple([h.number for h in n.outputs if h is not None])
            if n.out_is_tuple
            else one[n.outputs[0].number]  # type: ignore[union-attr]  # one tensor: one handle
            for n in new
        ]
    else:  # beyond the table: every row made
        state.node_inputs += [tuple([h.number for h in n.inputs]) for n in new]
        state.node_outputs += [tuple([h.number for h in n.outputs if h is not None]) for n in new]


def pass_graph(region: Region) -> tuple[PassGraph, list[Handle]]:
    """The region's graph numbered for the pass rules, and its values by number; memoized
    while the region records nothing new. See Note [Values numbered as recorded]."""
    state = region.pass_state
    handles = state.handles
    nodes = region.nodes
    g = state.graph
    if g is not None and state.numbered == (len(nodes), len(handles)):
        return g, handles
    number_nodes(state, nodes)
    g = PassGraph(
        inputs=list(state.node_inputs),
        outputs=list(state.node_outputs),
        producer=[h.node_index for h in handles],
        nbytes=[h.nbytes for h in handles],
        view=[h.is_view for h in handles],
        has_views=[h.has_views for h in handles],
        transient_ok=[
            n.info.may_be_transient if len(o := n.outputs) == 1 and o[0] is not None else False
            for n in nodes
        ],
    )
    state.graph = g
    state.numbered = (len(nodes), len(handles))
    return g, handles


def begin_pass(region: Region, task: int, executor: Executor) -> None:
    """Count the use counts of a new backward pass and plan it (bounded cache, transient
    values). See Note [Use counts and freeing] and Note [One pass core]."""
    state = region.pass_state
    if state.task != -2:
        end_pass(region)
    state.task = task
    state.number += 1
    state.recomputed_ops = 0
    state.cache_bytes.peak = 0
    state._last_closed = 0
    _recompute_changed_kept(region)
    g, handles = pass_graph(region)
    kept = [h.reason is not None for h in handles]
    uses = [0 if h.reason is not None else h.saved_refs for h in handles]  # as ``kept``
    cached = [False] * len(handles)
    live = [False] * len(handles)

    def taken(v: int) -> bool:  # See Note [Live forward tensors].
        h = handles[v]
        t = live_forward(h)
        if t is None:
            return False
        h.cache = t
        h.live = live[v] = cached[v] = True
        return True

    runs = count_uses(g, kept, uses, taken=taken)
    core = state.core = Pass(
        g,
        kept,
        uses,
        cached,
        executor,
        live=live,
        transient_min_bytes=TRANSIENT_MIN_BYTES,
        bound_min_bytes=cache_bound.BOUND_MIN_BYTES,
    )
    limit = region.cache_limit
    bounded = limit != "unbounded"
    plan = core.start(
        limit if isinstance(limit, int) else None,
        bounded,
        last_readers(g, kept, runs) if bounded else (),
        [h.saved_refs > 0 for h in handles],
    )
    if plan is not None and not plan.feasible:
        total = core.bound.profile.saved_bytes if core.bound and core.bound.profile else 0
        warnings.warn(
            f"ckpt_graph: cache_limit={limit:,} bytes is below the {plan.peak:,} bytes that "
            f"this region's recomputed values ({total:,} bytes) need with at most "
            f"two forwards of recompute; caching up to about {plan.peak:,} bytes instead. Keep "
            "more values (a policy or tag_with_policy), or raise cache_limit to silence this "
            "warning.",
            UserWarning,
            stacklevel=4,
        )
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
    t = None if h.unlinked else h()  # See Note [A handle is a weak reference].
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
                free_kept(region, o)
                kept = region.pass_state.kept
                if o.number < len(kept):  # counted at region exit: now recomputed
                    kept[o.number] = False
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


def end_pass(region: Region) -> None:
    """Free everything the pass left cached and forget its use counts."""
    state = region.pass_state
    state.task = -2
    state.cache_bytes.now = 0
    core = state.core
    if core is not None and core.bound is not None:
        state._last_closed = core.bound.closed_segments
    state.core = None
    for node in region.nodes:
        for o in node.outputs:
            if o is not None:
                o.cache = None
                o.live = False


# ----------------------------------------------------------------- live uses
# Note [Releasing kept values]
# A kept value is needed as long as a saved tensor refers to it, or a saved tensor of a
# recomputed value whose recomputation would read it. When the region exits, every handle
# gets ``live_uses`` = its live saved tensors + the op nodes that take it as input and could
# still have to run (one sweep from the last node back, the pass's ``count_uses``). Kept
# values with no live use are freed at once. Afterwards, each saved tensor autograd
# frees (after its backward node ran, or when the graph is dropped) takes one live use of
# its handle (``pass_graph.free_use``, which the simulator runs too); a recomputed handle
# that drops to zero makes its producer dead (``PassState.may_run`` false) once all its
# recomputed outputs are, which takes a use of each of the producer's inputs, and so on; a
# kept handle that drops to zero is freed. So a
# kept block input is freed right after the last backward node that could need it, as
# autograd frees a saved tensor. An op node that is dead and whose kept outputs have no live
# use either never runs again: its generator state (Note [RNG replay]) is dropped (a CPU
# state is 5 KiB per random op).


def count_live_uses(region: Region) -> None:
    """Count the live uses at region exit (``PassState.live_uses``, ``may_run``); free
    unneeded kept values and the generator states of op nodes that never run.

    The sweep is the pass's (``pass_graph.count_uses``, Note [One pass core]), counting
    kept inputs too. It reads the op node rows only: the per-value facts of the pass graph
    wait for ``pass_graph``, at the first pass or freed saved tensor that needs them (Note
    [Values numbered as recorded]). See Note [Releasing kept values].
    """
    state = region.pass_state
    handles = state.handles
    number_nodes(state, region.nodes)
    g = NodeRows(state.node_inputs, state.node_outputs)
    kept = [h.reason is not None for h in handles]
    live_uses = [h.saved_refs for h in handles]
    state.may_run = count_uses(g, kept, live_uses, all_inputs=True)
    state.live_uses = live_uses
    state.kept = kept
    nodes = region.nodes
    for j in region.recording.random_nodes:  # the op nodes with a generator state
        node = nodes[j]
        if node.rng is not None and is_dead(g, live_uses, state.may_run, j):
            node.rng = None
    for v in compress(range(len(kept)), kept):
        if live_uses[v] == 0:
            handles[v].value = None


def free_use(region: Region, h: Handle) -> None:
    """A saved tensor of ``h`` was freed: take one live use (``pass_graph.free_use``). See
    Note [Releasing kept values]."""
    state = region.pass_state
    live_uses, v = state.live_uses, h.number
    if live_uses[v] > 1:  # ``free_use``'s first step when it frees nothing: the common case
        live_uses[v] -= 1
        return
    g, handles = pass_graph(region)

    def free_kept(v: int) -> None:
        handles[v].value = None

    dead = None
    if region.recording.random_nodes:  # only op nodes with a generator state free anything
        nodes = region.nodes

        def dead(j: int) -> None:
            node = nodes[j]
            if node.rng is not None and is_dead(g, state.live_uses, state.may_run, j):
                node.rng = None

    _free_use(g, state.kept, live_uses, state.may_run, v, free_kept, dead)
