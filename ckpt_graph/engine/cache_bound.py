"""The bounded recompute cache: the decision to bound, segments, checkpoints and owed runs.

``realize`` runs a bounded pass with these pieces; ``save_recompute_policy(cache_limit=...)``
is validated by :func:`parse_cache_limit`.

# Note [Bounded recompute cache]
# Caching every recomputed value until its last use (Note [Use counts and freeing]) makes
# one region over a whole model hold as much as no checkpointing: with nothing kept but its
# inputs, the first unpack of backward realizes a value near the end of the forward, and
# every value before it stays cached until its own backward step. A pass therefore bounds
# what realize holds, with Chen et al.'s (2016) segments applied online:
# 1. Whether and where to bound. ``begin_pass`` profiles the storages of the recomputed
#    values the pass needs (``segment_plan.SegmentProfile``): T, the bytes of those autograd
#    saved, and where segments can be cut (Note [Planned segment cuts]). Automatically
#    (``cache_limit=None``) the decision waits for the pass's first realize that would leave
#    values cached for later unpacks or ops: the realizes before it (the transposed weight
#    of the last linear layer, a view of a kept value, comes first in most models) cache
#    nothing, and guessing which saved tensor is unpacked first (the last one saved, once)
#    left one region over most models unbounded. That realize is collected (rule 2) and
#    the bytes it would cache counted exactly, by storage; the cuts are planned then, for
#    the least peak P of the cache (with the gradients alive at that unpack, see
#    ``step_gradient_bytes``). The pass is bounded when that realize would cache at least
#    2 P and at least ``BOUND_MIN_BYTES``; below, bounding saves less than half, or a few
#    bytes, and costs a recompute, so a small region (one block of ``wrap``) or a policy that
#    keeps enough (``save_matmuls``) caches as before, transient values included (marked
#    then, as an unbounded pass marks them at its start). An explicit ``cache_limit`` L bounds whenever T > L, with cuts planned at the
#    pass's start for a peak of L; when two forwards cannot meet L, a warning names the
#    least peak they can, which is used instead. ``cache_limit="unbounded"`` caches every
#    value until its last use.
# 2. A bounded realize first collects the op nodes to run (from its target back to kept or
#    cached values) and counts, per value, the collected ops that read it (``need``); then it
#    runs them in forward order. A value that no remaining op of the realize reads, but a
#    later unpack or op will (``pass_uses > 0``), joins the open *segment*. When the realize
#    passes a planned cut, the segment is closed: every value of this realize that a
#    remaining op still reads (the frontier: with the kept values it suffices for every
#    later op) becomes a *checkpoint*, cached until its use count reaches zero, and the
#    values of the segment are dropped. Checkpoints hold one use more until the next close
#    (or the realize's end): the ops of the segment after them read them, and when that
#    segment is dropped in turn its producers are owed runs that read them again (freed at
#    once, they were made again from the cut before, and so on back: ops of a BERT ran
#    seven times). A realize closes nothing when the values it leaves cached fit in P (it
#    runs a closed segment again), nor after its last op: the open segment stays cached,
#    backward uses it next.
# 3. Dropping a value with pending uses means its producer will run again: the producer is
#    *owed* a run and each of its recomputed inputs gets one more use; an input that is not
#    cached owes a run of its own producer, and so on (a node is owed at most one run;
#    running clears it). Use counts thus still count exactly the future unpacks and runs,
#    and a checkpoint is freed once the last segment that reads it ran again.
# 4. A later unpack of a dropped value realizes it from the checkpoints. Backward runs in
#    reverse, so the first unpack in a segment asks for its latest value and runs the
#    segment again, whose values fit in P and stay cached until used. Each op therefore
#    runs at most twice: in the first realize, and when its segment runs again. Ops off the
#    path to the first target run when needed, from whatever is cached: they can add runs,
#    and cache at most what their own realize needs.
# 5. Exactness and termination: a dropped value is recomputed by the same op from the same
#    values (kept, cached, or recomputed by the same rule), random ops with their recorded
#    generator state (Note [RNG replay]), in-place ops on a copy unless no other pending use
#    (owed runs included) needs their input. An unpack runs each node of its collected set
#    once, so every pass ends.
# Transient values (Note [Transient values]) are not marked in a bounded pass: segments
# already bound the residual stream, and a transient producer would run once per use.
"""

from __future__ import annotations

import bisect
import warnings
from typing import TYPE_CHECKING

from ckpt_graph._errors import CkptGraphError
from ckpt_graph._sizes import parse_size
from ckpt_graph.engine.segment_plan import SegmentProfile

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.passes import PassState
    from ckpt_graph.engine.region import Region

__all__ = [
    "BOUND_MIN_BYTES",
    "close_segment",
    "closes_between",
    "collect_realize",
    "decide_bound",
    "join_segment",
    "owe",
    "parse_cache_limit",
    "plan_bound",
    "plan_realize",
    "root_of",
    "unpin",
]


def parse_cache_limit(limit: object) -> int | str | None:
    """Validate a ``cache_limit``: bytes, ``None`` (automatic) or ``"unbounded"``.

    See Note [Bounded recompute cache].

    Returns:
        A positive number of bytes, ``None`` or ``"unbounded"``.

    Raises:
        CkptGraphError: for anything else (0, negative, bool, unknown unit).

    Example:
        >>> parse_cache_limit("256MiB"), parse_cache_limit(None), parse_cache_limit(4096)
        (268435456, None, 4096)
    """
    hint = (
        'pass a positive number of bytes (4096, "256MiB", "1.5GB"), None for the automatic '
        'bound, or "unbounded" to cache every recomputed value until its last use'
    )
    if limit is None or limit == "unbounded":
        return limit  # type: ignore[return-value]
    if isinstance(limit, int) and not isinstance(limit, bool):
        if limit > 0:
            return limit
        raise CkptGraphError(f"ckpt_graph: cache_limit={limit!r} is not a valid bound; {hint}")
    if isinstance(limit, str):
        size = parse_size(limit)
        if size is not None and size > 0:
            return size
    raise CkptGraphError(f"ckpt_graph: cache_limit={limit!r} is not a valid bound; {hint}")


# A pass whose first caching realize would cache less stays unbounded: running its ops again
# costs ~10 us of Python each, more than holding a few small values is worth (the same
# trade as ``passes.TRANSIENT_MIN_BYTES``). See Note [Bounded recompute cache], rule 1.
BOUND_MIN_BYTES = 64 * 1024


def plan_bound(region: Region, last: dict[Handle, int]) -> None:
    """Plan the pass's bound from its use counts; ``last`` maps each recomputed value to its
    last consumer op that will run. Sets ``PassState.segment_limit`` and ``cuts`` for an
    explicit ``cache_limit``, or the plan an automatic bound decides on (``decide_bound``).
    See Note [Bounded recompute cache], rule 1.
    """
    state = region.pass_state
    state.roots = {}  # kept values are settled for the pass: see ``root_of``
    storages: dict[Handle, list[int]] = {}  # per storage (its root value): producer, end, saved
    for node in region.nodes:
        for o in node.outputs:
            if o is not None and o.reason is None and o.pass_uses > 0 and not o.live:
                root = root_of(region, o)
                if root.reason is not None or root.live:
                    continue  # a view of a kept or live value holds nothing
                entry = storages.get(root)
                if entry is None:
                    entry = storages[root] = [root.node_index, root.node_index, 0]
                entry[1] = max(entry[1], last.get(o, node.index))
                if o.saved_refs:
                    entry[2] = 1
    spans = [(p, e, r.nbytes, saved == 1) for r, (p, e, saved) in storages.items()]
    profile = SegmentProfile(len(region.nodes), spans)
    limit = region.cache_limit
    if limit is None:
        state.undecided = profile.saved_bytes > 0
        state.profile = profile
        return
    assert isinstance(limit, int)
    total = profile.saved_bytes
    if total <= limit:
        return
    plan = profile.plan(limit)
    if not plan.feasible:
        warnings.warn(
            f"ckpt_graph: cache_limit={limit:,} bytes is below the {plan.peak:,} bytes that "
            f"this region's recomputed values ({total:,} bytes) need with at most "
            f"two forwards of recompute; caching up to about {plan.peak:,} bytes instead. Keep "
            "more values (a policy or tag_with_policy), or raise cache_limit to silence this "
            "warning.",
            UserWarning,
            stacklevel=5,
        )
    state.segment_limit = max(plan.peak, 1)
    state.cuts = list(plan.cuts)
    state.profile = profile


def decide_bound(region: Region, h: Handle) -> bool | None:
    """Decide an automatic bound at the pass's first realize that caches anything: whether
    the pass is bounded, or ``None`` when realizing ``h`` caches nothing for later (the
    decision waits). See Note [Bounded recompute cache], rule 1."""
    state = region.pass_state
    profile = state.profile
    assert profile is not None
    _, _, held = collect_realize(region, h)
    if held == 0:
        return None
    state.undecided = False
    if held < BOUND_MIN_BYTES:
        state.profile = None
        return False
    plan = profile.plan(extra=step_gradient_bytes(region, h))
    if not plan.cuts or held < 2 * plan.peak:
        state.profile = None
        return False
    state.segment_limit = max(plan.peak, 1)
    state.cuts = list(plan.cuts)
    return True


def step_gradient_bytes(region: Region, h: Handle) -> int:
    """Bytes of the gradients alive while backward unpacks ``h`` the first time, as the
    region's graph bounds them: the outputs of the last op reading ``h`` (its step) and the
    values made before that op and read after it. See Note [Planned segment cuts], rule 2.
    """
    nodes = region.nodes
    step = h.node_index
    last: dict[Handle, int] = {}
    for node in nodes[h.node_index + 1 :]:
        for i in node.inputs:
            if i.node_index >= 0:
                last[i] = node.index
                if i is h:
                    step = node.index
    total = 0
    for o in nodes[step].outputs:
        if o is not None and not o.is_view:
            total += o.nbytes
    for v, end in last.items():
        if v.node_index < step < end and not v.is_view:
            total += v.nbytes
    return total


def root_of(region: Region, h: Handle) -> Handle:
    """The value whose storage ``h`` uses (``h`` itself unless a view), through views.

    Memoized for the pass (``PassState.roots``, reset by ``segment_limit`` at its start,
    when kept values no longer change): views of the last write's result (a buffer filled
    step by step) form a chain as long as the writes before them, and walking it for each
    value made a pass quadratic in the number of writes.
    """
    roots = region.pass_state.roots
    walked: list[Handle] = []
    while h.is_view and h.reason is None:
        root = roots.get(h)
        if root is not None:
            h = root
            break
        inputs = region.nodes[h.node_index].inputs
        if not inputs:
            break
        walked.append(h)
        h = inputs[0]
    for v in walked:
        roots[v] = h
    return h


def join_segment(state: PassState, h: Handle) -> None:
    """``h`` is cached for later users only: add it to the open segment. See Note [Bounded
    recompute cache], rule 2."""
    state.segment.append(h)


def close_segment(region: Region, state: PassState) -> None:
    """Keep the frontier cached as checkpoints, drop the open segment's values. The new
    checkpoints are pinned (one use more) until the next close: the segment after them may
    be dropped, and its producers then read them again. See Note [Bounded recompute
    cache], rule 2."""
    state.checkpoints.update(state.active)
    state.closed_segments += 1
    for d in state.segment:
        if d.cache is not None:
            d.cache = None
            if not d.is_view:
                state.cached_bytes -= d.nbytes
            owe(region, region.nodes[d.node_index])
    state.segment = []
    for a in state.active:
        a.pass_uses += 1
    unpin(state)
    state.pinned = list(state.active)


def unpin(state: PassState) -> None:
    """Release the pins of the last cut's checkpoints; free those with no use left."""
    for a in state.pinned:
        a.pass_uses -= 1
        if a.pass_uses == 0 and a.cache is not None:
            a.cache = None
            if not a.is_view:
                state.cached_bytes -= a.nbytes
    state.pinned = []


def closes_between(state: PassState, after: int, before: int) -> bool:
    """Whether a planned cut lies at op ``after`` or between it and op ``before``."""
    cuts = state.cuts
    k = bisect.bisect_left(cuts, after)
    return k < len(cuts) and cuts[k] < before


def owe(region: Region, node: OpNode) -> None:
    """A cached output of ``node`` was dropped: ``node`` will run again. See Note [Bounded
    recompute cache], rule 3."""
    nodes = region.nodes
    stack = [node]
    while stack:
        n = stack.pop()
        if n.owed:
            continue
        n.owed = True
        for i in n.inputs:
            if i.reason is None:
                i.pass_uses += 1
                if i.cache is None:
                    stack.append(nodes[i.node_index])


def collect_realize(region: Region, h: Handle) -> tuple[list[int], dict[Handle, int], int]:
    """What a realize of ``h`` runs, from its target back to kept or cached values: the op
    nodes in forward order, per value the collected ops that read it (``need``, the target
    once for its unpack), and the bytes of the storages it leaves cached for later users."""
    nodes = region.nodes
    need = {h: 1}
    todo: set[int] = set()
    stack = [h.node_index]
    while stack:
        index = stack.pop()
        if index in todo:
            continue
        todo.add(index)
        for i in nodes[index].inputs:
            if i.reason is None:
                need[i] = need.get(i, 0) + 1
                if i.cache is None:
                    stack.append(i.node_index)
    order = sorted(todo)
    held: set[Handle] = set()
    for index in order:
        for o in nodes[index].outputs:
            if o is not None and o.reason is None and o.pass_uses > need.get(o, 0):
                held.add(root_of(region, o))
    return order, need, sum(r.nbytes for r in held if r.reason is None and not r.live)


def plan_realize(region: Region, h: Handle) -> list[int]:
    """The op nodes a bounded realize of ``h`` runs, in forward order; sets up the pass
    state (``need``, the open segment, whether it may close). See Note [Bounded recompute
    cache], rule 2."""
    state = region.pass_state
    order, state.need, held = collect_realize(region, h)
    # When the values it leaves cached fit, the realize closes nothing: it is running a
    # closed segment again.
    state.segment = []
    state.closing = held > state.segment_limit
    profile = state.profile
    if state.closing and profile is not None:  # See Note [Planned segment cuts], rule 4.
        state.profile = None
        cut = profile.tail_cut(state.cuts, h.node_index)
        if cut is not None:
            bisect.insort(state.cuts, cut)
    return order
