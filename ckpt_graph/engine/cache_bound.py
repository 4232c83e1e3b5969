"""The bounded recompute cache: segment size, segments, checkpoints and owed runs.

``realize`` runs a bounded pass with these pieces; ``save_recompute_policy(cache_limit=...)``
is validated by :func:`parse_cache_limit`.

# Note [Bounded recompute cache]
# Caching every recomputed value until its last use (Note [Use counts and freeing]) makes
# one region over a whole model hold as much as no checkpointing: with nothing kept but its
# inputs, the first unpack of backward realizes a value near the end of the forward, and
# every value before it stays cached until its own backward step. A pass therefore bounds
# what realize holds, with Chen et al.'s (2016) segments applied online:
# 1. Segment size. ``begin_pass`` measures the recomputed values the pass needs: T, the
#    bytes of the storages autograd saved, and F, their mean frontier (the bytes of
#    recomputed storages alive across a position of the forward, from the producer to the
#    last reader that will run, averaged over positions). Segments of K = sqrt(T * F) bytes
#    leave about T / K frontiers = K bytes of checkpoints plus one segment of K: about
#    2 sqrt(T F) in all, the least that one extra forward allows. Automatically
#    (``cache_limit=None``) a pass is bounded only when its first unpack (of the last saved
#    tensor) would realize and cache at least 4 K of saved values: below, bounding saves
#    less than half and costs a recompute, so a small region (one block of ``wrap``) or a
#    policy that keeps enough (``save_matmuls``) caches as before, transient values
#    included. An explicit ``cache_limit`` L gives K = L / 2 (half for the segment in
#    flight, half for checkpoints) and bounds whenever T > L; L < 2 sqrt(T F) cannot be met
#    with two forwards, so a warning names both and K = sqrt(T F) is used instead.
#    ``cache_limit="unbounded"`` caches every value until its last use.
# 2. A bounded realize first collects the op nodes to run (from its target back to kept or
#    cached values) and counts, per value, the collected ops that read it (``need``); then it
#    runs them in forward order. A value that no remaining op of the realize reads, but a
#    later unpack or op will (``pass_uses > 0``), joins the open *segment* (a view counts the
#    storage it holds). The segment is closed when it would exceed K bytes, or earlier at a
#    cheap place: once it holds K / 2 and the frontier is at most F. Closing makes every
#    value of this realize that a remaining op still reads (the frontier: with the kept
#    values it suffices for every later op) a *checkpoint*, cached until its use count
#    reaches zero, and drops the values of the segment. A realize closes nothing when the
#    values it leaves cached fit in K (it runs a closed segment again), nor after its last
#    op: the open segment stays cached, backward uses it next.
# 3. Dropping a value with pending uses means its producer will run again: the producer is
#    *owed* a run and each of its recomputed inputs gets one more use; an input that is not
#    cached owes a run of its own producer, and so on (a node is owed at most one run;
#    running clears it). Use counts thus still count exactly the future unpacks and runs,
#    and a checkpoint is freed once the last segment that reads it ran again.
# 4. A later unpack of a dropped value realizes it from the checkpoints. Backward runs in
#    reverse, so the first unpack in a segment asks for its latest value and runs the
#    segment again, whose values fit in K and stay cached until used. Each op therefore
#    runs at most twice: in the first realize, and when its segment runs again. Ops off the
#    path to the first target run when needed, from whatever is cached: they can add runs,
#    never cached bytes beyond K per realize.
# 5. Exactness and termination: a dropped value is recomputed by the same op from the same
#    values (kept, cached, or recomputed by the same rule), random ops with their recorded
#    generator state (Note [RNG replay]), in-place ops on a copy unless no other pending use
#    (owed runs included) needs their input. An unpack runs each node of its collected set
#    once, so every pass ends.
# Transient values (Note [Transient values]) are not marked in a bounded pass: segments
# already bound the residual stream, and a transient producer would run once per use.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

from ckpt_graph._errors import CkptGraphError
from ckpt_graph._sizes import parse_size

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.passes import PassState
    from ckpt_graph.engine.region import Region

__all__ = [
    "close_segment",
    "frontier_bytes",
    "join_segment",
    "owe",
    "parse_cache_limit",
    "plan_realize",
    "segment_limit",
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


def segment_limit(region: Region, last: dict[Handle, int]) -> int:
    """Bytes per segment of a bounded pass, 0 to cache without bound.

    ``last`` maps each recomputed value to its last consumer op that will run. See Note
    [Bounded recompute cache], rule 1.
    """
    region._pass.roots = {}  # kept values are settled for the pass: see ``root_of``
    end: dict[Handle, int] = {}  # per storage (its root value), the last op that reads it
    saved: set[Handle] = set()
    for node in region.nodes:
        for o in node.outputs:
            if o is not None and o.reason is None and o.pass_uses > 0 and not o.live:
                root = root_of(region, o)
                if root.reason is not None or root.live:
                    continue  # a view of a kept or live value holds nothing
                end[root] = max(end.get(root, 0), last.get(o, node.index))
                if o.saved_refs:
                    saved.add(root)
    total = sum(h.nbytes for h in saved)
    spans = sum(h.nbytes * (e - h.node_index) for h, e in end.items())
    frontier = spans // max(len(region.nodes), 1)
    region._pass.frontier_bytes = frontier
    k = math.isqrt(total * frontier)
    limit = region.cache_limit
    if limit is None:
        return k if k > 0 and _first_realize_bytes(region) >= 4 * k else 0
    assert isinstance(limit, int)
    if total <= limit:
        return 0
    if limit < 2 * k:
        warnings.warn(
            f"ckpt_graph: cache_limit={limit:,} bytes is below the {2 * k:,} bytes that this "
            f"region's recomputed values ({total:,} bytes) need with at most two forwards of "
            f"recompute; caching up to about {2 * k:,} bytes instead. Keep more values (a policy "
            "or tag_with_policy), or raise cache_limit to silence this warning.",
            UserWarning,
            stacklevel=4,
        )
        return max(k, 1)
    return limit // 2


def _first_realize_bytes(region: Region) -> int:
    """Bytes of saved values the first unpack of a pass would cache, unbounded: the values
    its realize recomputes that autograd saved, by storage. Backward starts with the last
    saved tensors of the forward."""
    nodes = region.nodes
    target = next((h for h in reversed(region._saved_handles) if h.reason is None), None)
    if target is None or target.node_index < 0 or target.live:
        return 0
    seen = {target.node_index}
    stack = [target.node_index]
    roots: set[Handle] = set()
    while stack:
        node = nodes[stack.pop()]
        for o in node.outputs:
            if o is not None and o.reason is None and o.saved_refs and not o.live:
                roots.add(root_of(region, o))
        for i in node.inputs:
            if i.reason is None and not i.live and i.node_index not in seen:
                seen.add(i.node_index)
                stack.append(i.node_index)
    return sum(r.nbytes for r in roots if r.reason is None and not r.live)


def root_of(region: Region, h: Handle) -> Handle:
    """The value whose storage ``h`` uses (``h`` itself unless a view), through views.

    Memoized for the pass (``PassState.roots``, reset by ``segment_limit`` at its start,
    when kept values no longer change): views of the last write's result (a buffer filled
    step by step) form a chain as long as the writes before them, and walking it for each
    value made a pass quadratic in the number of writes.
    """
    roots = region._pass.roots
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


def join_segment(region: Region, state: PassState, h: Handle) -> None:
    """``h`` is cached for later users only: add it to the open segment, closing it first
    if it would exceed the segment size. A view counts the bytes of the storage it holds
    unless that is kept, cached or already counted. See Note [Bounded recompute cache],
    rule 2."""
    nbytes = h.nbytes
    if h.is_view:
        root = root_of(region, h)
        if root.reason is not None or root.cache is not None or root in state.segment_roots:
            nbytes = 0
        else:
            state.segment_roots.add(root)
    if state.closing and state.segment and state.segment_bytes + nbytes > state.segment_limit:
        close_segment(region, state)
    state.segment.append(h)
    state.segment_bytes += nbytes


def close_segment(region: Region, state: PassState) -> None:
    """Keep the frontier cached as checkpoints, drop the open segment's values."""
    state.checkpoints.update(state.active)
    state.closed_segments += 1
    for d in state.segment:
        if d.cache is not None:
            d.cache = None
            if not d.is_view:
                state.cached_bytes -= d.nbytes
            owe(region, region.nodes[d.node_index])
    state.segment = []
    state.segment_bytes = 0
    state.segment_roots = set()


def frontier_bytes(region: Region, state: PassState) -> int:
    """Bytes of storage the values of this realize still to be read hold (the frontier)."""
    roots = {root_of(region, a) for a in state.active}
    return sum(r.nbytes for r in roots if r.reason is None and not r.live)


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


def plan_realize(region: Region, h: Handle) -> list[int]:
    """The op nodes a bounded realize of ``h`` runs, in forward order; sets up the pass
    state (``need``, the open segment, whether it may close). See Note [Bounded recompute
    cache], rule 2."""
    nodes = region.nodes
    state = region._pass
    need = state.need = {h: 1}  # the target stays cached until the unpack took it
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
    # Values this realize leaves cached for later users, counted by storage: when they fit
    # in a segment, the realize closes none (it is running a closed segment again).
    held: set[Handle] = set()
    for index in order:
        for o in nodes[index].outputs:
            if o is not None and o.reason is None and o.pass_uses > need.get(o, 0):
                held.add(root_of(region, o))
    held_bytes = sum(r.nbytes for r in held if r.reason is None and not r.live)
    state.segment = []
    state.segment_bytes = 0
    state.segment_roots = set()
    state.closing = held_bytes > state.segment_limit
    return order
