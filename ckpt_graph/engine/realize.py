"""Realize: recompute handles on demand in backward, cache them, free them.

# Note [Use counts and freeing]
# Each backward pass of a region starts at the first unpack whose autograd graph task id
# differs from the last one seen. It computes, for every recomputed handle, its use count
# for the pass (``Handle.pending``): the saved tensors still alive that refer to it, plus
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
# ``h.pending - 1`` extra uses, running the producer releases nothing, and every use of
# ``h`` served releases one use of each input. So the inputs stay cached exactly as long as
# ``h`` could be needed again, whatever the number of actual runs. The cached value of
# ``h`` is dropped as soon as no op node waiting to run needs it: ``realize`` *pins* a
# transient input when it expands a node and unpins it after the node ran, and ops in one
# realize share one run. Memory never grows: at any time the producer's recomputed inputs
# held for ``h`` (no more bytes than ``h``, and cached for other users anyway) replace ``h``
# itself; the cost is one cheap pointwise op per extra use. In the residual example, the
# value between attention and MLP (``x + attn``) becomes transient and half of the residual
# stream is no longer cached.
#
# Note [Realize order]
# ``realize`` walks the producers of a handle with an explicit stack (no Python recursion,
# so a 20,000-op chain works): a node is expanded once, its recomputed inputs that are not
# cached are pushed, and it runs after them. A node runs at most once per pass, except the
# producer of a transient value, which runs whenever the value is needed and not cached
# (see Note [Transient values]). A bounded pass realizes differently (collect, then run in
# forward order) and runs a node again when an output it needs was dropped (see Note
# [Bounded recompute cache]).
#
# Note [RNG replay]
# Random ops (``torch.Tag.nondeterministic_seeded``) record the state of their generator
# just before they ran in forward: the explicit ``generator=`` argument's, or else the
# default generator of their device. Replaying sets that state, runs the op and restores
# the state the generator had, so recomputed values equal the forward's and the user's
# random stream ends where it would have without checkpointing. A state equal to the one
# the previous random op captured (the op drew nothing: SDPA without dropout) is shared, not
# copied; a CPU generator state is 5 KiB. On a device whose default generator the engine
# cannot address (``mutation.capture_rng`` returns ``None``), the outputs of a random op are
# kept for the engine reason ``RANDOM_WITHOUT_REPLAY``, which no policy or tag overrides.
#
# Note [Releasing kept values]
# A kept value is needed as long as a saved tensor refers to it, or a saved tensor of a
# recomputed value whose recomputation would read it. When the region exits, every handle
# gets ``live`` = its live saved tensors + the op nodes that take it as input and could
# still have to run (one sweep from the last node back, as for the pass use counts). Kept
# values with no live use are released at once. Afterwards, each saved tensor autograd
# releases (after its backward node ran, or when the graph is dropped) takes one live use
# of its handle; a recomputed handle that drops to zero makes its producer dead once all
# its recomputed outputs are, which takes a use of each of the producer's inputs, and so
# on; a kept handle that drops to zero is released. So a kept block input is freed right
# after the last backward node that could need it, as autograd frees a saved tensor.
#
# Replay context (``_enter_replay``, for ``realize`` and ``realize_again``): no grad
# (unpacked values must be plain tensors; autograd re-attaches them to the original graph,
# which also makes ``create_graph=True`` work), autocast off (the recorded ops already carry
# the casts autocast made), nothing recorded, the forward's settings (Note [Replay globals]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine import graph
from ckpt_graph.engine.cache_bound import (
    close_segment,
    frontier_bytes,
    join_segment,
    plan_realize,
    segment_limit,
)
from ckpt_graph.engine.debug import check_kept, check_replay
from ckpt_graph.engine.graph import INPUT, UNANNOTATED_ALIASES, Handle, arg_at, version_of
from ckpt_graph.engine.holding import detached, unhold

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["PassState", "exact_copy", "realize", "unpack_value"]


_current_task = torch._C._current_graph_task_id


class PassState:
    """Per-region state of the current backward pass."""

    __slots__ = (
        "active",
        "cached_bytes",
        "checkpoints",
        "closed_segments",
        "closing",
        "frontier_bytes",
        "need",
        "number",
        "peak_cached_bytes",
        "recomputed_ops",
        "segment",
        "segment_bytes",
        "segment_limit",
        "segment_roots",
        "task",
    )

    def __init__(self) -> None:
        self.task = -2
        self.number = 0
        self.recomputed_ops = 0
        self.cached_bytes = 0
        self.peak_cached_bytes = 0
        # See Note [Bounded recompute cache]; segment_limit 0: the pass caches without bound.
        self.segment_limit = 0
        self.segment: list[Handle] = []
        self.segment_bytes = 0
        self.segment_roots: set[Handle] = set()  # storages the open segment's views hold
        self.frontier_bytes = 0  # mean frontier of the pass
        self.closing = False  # whether the running realize may close segments
        self.closed_segments = 0  # in the current or last pass
        self.active: dict[Handle, None] = {}  # values of this realize that `need` > 0
        self.need: dict[Handle, int] = {}  # per value, collected ops of the realize to read it
        self.checkpoints: set[Handle] = set()


def exact_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same sizes, strides and storage offset, in new storage."""
    with torch.no_grad():
        if (
            t.is_contiguous()
            and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        ):
            return t.clone()
        storage = t.untyped_storage().clone()
        return torch.empty((0,), dtype=t.dtype, device=t.device).set_(
            storage, t.storage_offset(), t.size(), t.stride()
        )


def _where(h: Handle, region: Region) -> str:
    """Which value of the region ``h`` is, for error messages."""
    if h.node_index >= 0:
        return f"output {h.index} of {region.nodes[h.node_index].info.name} (op #{h.node_index})"
    if h.reason == graph.MUTATED_ALIAS:
        return (
            f"value #{h.index} the region took as it was after an in-place op on an alias "
            "(a snapshot)"
        )
    return f"input #{h.index} of the region"


def _version_error(h: Handle, region: Region, current: int) -> CkptGraphError:
    where = _where(h, region)
    return CkptGraphError(
        "ckpt_graph: one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{h.dtype} {list(h.shape)}], which is {where}, is at version "
        f"{current}; expected version {h.version} instead. Hint: do not modify a tensor in place "
        "after it was used in a checkpointed region, or clone it before modifying it."
    )


def _untracked_write_error(h: Handle, region: Region) -> CkptGraphError:
    return CkptGraphError(
        f"ckpt_graph: {_where(h, region)} [{h.dtype} {list(h.shape)}] was written in place "
        "through an alias "
        "with a version counter of its own (such as `.data`) after autograd saved it: eager "
        "autograd would silently use the new values, the region can only give the old ones. "
        "Write to the tensor itself rather than its `.data` (eager then reports the "
        "conflict), or do the write outside the region."
    )


def _check_version(region: Region, h: Handle) -> None:
    """Raise autograd's version-counter error if the forward tensor of ``h`` changed."""
    t = h.value if h.value is not None and h.offload_device is None else None
    if t is None and h.ref is not None:
        t = h.ref()
    if t is None and h.base is not None:
        # See Note [Mutation and views], rule 6: the view's tensor is gone (a temporary
        # view autograd saved), but it shared its base's version counter.
        b = h.base
        bt = b.value if b.value is not None and b.offload_device is None else None
        if bt is None and b.ref is not None:
            bt = b.ref()
        if b.writes > h.base_writes:  # written after the view was made
            if bt is not None and version_of(bt) == b.version:
                raise _untracked_write_error(h, region)
            raise _version_error(h, region, version_of(bt) if bt is not None else h.version + 1)
        t = bt
    if t is not None and h.version != -1 and version_of(t) != h.version:
        raise _version_error(h, region, version_of(t))


def _kept_value(region: Region, h: Handle) -> torch.Tensor:
    v = h.value
    if v is None:
        raise CkptGraphError(
            f"ckpt_graph: the kept value {h!r} was already released; run backward once per "
            "forward, or pass retain_graph=True to the first backward"
        )
    _check_version(region, h)
    if h.offload_device is not None:
        return v.to(h.offload_device, non_blocking=True)
    if region.debug:
        check_kept(region, h, v)  # See Note [Kept value checks].
    return v


def unpack_value(region: Region, h: Handle, packed: Any = None) -> torch.Tensor:
    """The value of a saved tensor, for autograd's unpack.

    Args:
        region: the region that packed it.
        h: its handle.
        packed: the ``hooks.Packed`` object unpacked, if any; it records the pass of its
            last read, so that a second read in one pass takes no use (see Note [Reading a
            saved tensor again]).
    """
    if h.superseded:
        t = h.ref() if h.ref is not None else None
        if t is not None and version_of(t) == h.version:  # see Note [Mutation and views]
            raise _untracked_write_error(h, region)
        raise _version_error(h, region, t._version if t is not None else h.version + 1)
    if h.reason is not None:
        value = _kept_value(region, h)
        if h.reason is INPUT and h.ref is not None:
            # See Note [Region inputs keep their identity].
            t = h.ref()
            if t is not None:
                return t
        return value
    _check_version(region, h)
    task = _current_task()
    state = region._pass
    one_shot = task == -1
    if one_shot or task != state.task:
        begin_pass(region, task)
    try:
        if packed is not None and packed.read == state.number:
            # See Note [Reading a saved tensor again].
            value = h.cache if h.cache is not None else realize_again(region, h)
        else:
            value = realize(region, h)
            _release_use(region, state, h)
            if packed is not None:
                packed.read = state.number
    finally:
        if one_shot:
            end_pass(region)
    return value


def _release_use(region: Region, state: PassState, h: Handle) -> None:
    """One pending user of ``h`` is served; free its cache after the last one.

    A transient value is dropped as soon as no waiting op node needs it, and each of its
    uses is also one use of its producer's recomputed inputs (see Note [Transient values]).
    """
    h.pending -= 1
    if h.transient:
        for i in region.nodes[h.node_index].inputs:
            if i.reason is None:
                _release_use(region, state, i)
        if h.pins > 0 and h.pending > 0:
            return
    elif h.pending > 0:
        return
    if h.cache is not None:
        h.cache = None
        if not h.is_view:  # a view's bytes belong to its base
            state.cached_bytes -= h.nbytes


def _unpin(state: PassState, node: OpNode) -> None:
    """``node`` ran (or was skipped): its transient inputs are no longer needed for it."""
    for i in node.inputs:
        if i.transient:
            i.pins -= 1
            if i.pins == 0 and i.cache is not None:
                i.cache = None
                state.cached_bytes -= i.nbytes


def count_live_uses(region: Region) -> None:
    """Set ``Handle.live`` at region exit; release unneeded kept values.

    See Note [Releasing kept values].
    """
    for node in reversed(region.nodes):
        needed = False
        for o in node.outputs:
            if o is not None:
                o.live += o.packs
                if o.reason is None and o.live > 0:
                    needed = True
        node.live = needed
        if needed:
            for i in node.inputs:
                i.live += 1
    for h in region.inputs:
        h.live += h.packs
    for h in region.inputs:
        if h.live == 0:
            h.value = None
    for node in region.nodes:
        for o in node.outputs:
            if o is not None and o.reason is not None and o.live == 0:
                o.value = None


def lose_use(region: Region, h: Handle) -> None:
    """A saved tensor of ``h`` was released. See Note [Releasing kept values]."""
    nodes = region.nodes
    stack = [h]
    while stack:
        h = stack.pop()
        h.live -= 1
        if h.live > 0:
            continue
        if h.reason is not None:
            h.value = None
            continue
        if h.node_index < 0:
            continue
        node = nodes[h.node_index]
        if not node.live or any(
            o is not None and o.reason is None and o.live > 0 for o in node.outputs
        ):
            continue
        node.live = False
        stack.extend(node.inputs)


def begin_pass(region: Region, task: int) -> None:
    """Reset use counts for a new backward pass. See Note [Use counts and freeing]."""
    state = region._pass
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
                o.pending += o.packs
                if o.pending > 0:
                    needed = True
        if needed:
            for i in node.inputs:
                if i.reason is None:
                    i.pending += 1
                    if bound and i not in last:
                        last[i] = node.index
    state.segment_limit = segment_limit(region, last) if bound else 0
    if state.segment_limit == 0:
        _mark_transient(region)
    if task != -1:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: end_pass(region))


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
                if not inputs_ok or o.packs > 0:
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
        if not info.is_pointwise or info.writes or node.rng is not None:
            continue
        outs = node.outputs
        if len(outs) != 1:
            continue
        h = outs[0]
        if (
            h is None
            or h.reason is not None
            or h.pending < 2
            or h.is_view
            or h.has_views
            or h.nbytes < TRANSIENT_MIN_BYTES
        ):
            continue
        nbytes = 0
        for i in node.inputs:
            if i.reason is None and not _aliases_kept(region, i):
                if i.transient or i.is_view or i.pending < 2:
                    break
                nbytes += i.nbytes
        else:
            if nbytes <= h.nbytes:
                h.transient = True
                node.transient = True
                extra = h.pending - 1
                for i in node.inputs:
                    if i.reason is None:
                        i.pending += extra


def _aliases_kept(region: Region, h: Handle) -> bool:
    """Whether ``h`` is a view of a kept value (through views only): holding it is free."""
    while h.is_view and h.reason is None:
        node = region.nodes[h.node_index]
        if not node.inputs:
            return False
        h = node.inputs[0]
    return h.reason is not None


def end_pass(region: Region) -> None:
    """Free everything the pass left cached and forget its use counts."""
    state = region._pass
    state.task = -2
    state.cached_bytes = 0
    bounded = state.segment_limit > 0
    state.segment_limit = 0
    state.segment = []
    state.segment_bytes = 0
    state.segment_roots = set()
    state.active = {}
    state.need = {}
    state.checkpoints = set()
    for node in region.nodes:
        if node.transient:
            node.transient = False
        if bounded:
            node.owed = False
        for o in node.outputs:
            if o is not None:
                o.pending = 0
                o.cache = None
                o.transient = False
                o.pins = 0


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


_set_grad_enabled = torch._C._set_grad_enabled
_is_any_autocast_enabled = torch._C._is_any_autocast_enabled

# Note [Replay globals]
# Besides arguments, an op's result can depend on process-wide settings: the number of
# intra-op threads (a CPU reduction sums in chunks per thread: ``x.sum()`` of 10^6 values
# differs in the last bits between 1 and 2 threads), ``torch.use_deterministic_algorithms``
# (kernel choice, and NaN-filled ``empty``), ``torch.set_float32_matmul_precision``
# (reduced-precision matmul kernels) and whether oneDNN is enabled. A backward may run
# under other settings than its forward (a data loader thread changing the thread count,
# a test toggling determinism), so the region reads them when it opens (``Region._globals``)
# and recompute runs under those (``_replay_globals``): each differing one is set for the
# duration of a ``realize`` and restored after. Changing one inside an open region would
# leave ops of one region with two settings: closing the region then raises (see
# ``Region._close_region``). Others are handled elsewhere: factory ops record the dtype,
# layout and device they produced (Note [Factory ops] in record.py); recompute runs with
# autocast off and no grad, whatever the backward has (the recorded ops carry autocast's
# casts, and grad mode does not change values).
REPLAY_GLOBALS: tuple[tuple[str, Any, Any], ...] = (
    (
        "torch.use_deterministic_algorithms",
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
    ),
    (
        "torch.set_float32_matmul_precision",
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    ("torch.backends.mkldnn.enabled", torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled),
    ("torch.set_num_threads", torch.get_num_threads, torch.set_num_threads),
)


def replay_globals() -> tuple[Any, ...]:
    """The current values of the settings in ``REPLAY_GLOBALS``."""
    return tuple(get() for _, get, _ in REPLAY_GLOBALS)


@contextlib.contextmanager
def _replay_globals(region: Region) -> Iterator[None]:
    """Run under the settings the region's forward had. See Note [Replay globals]."""
    want = region._globals
    now = replay_globals()
    if want is None or now == want:
        yield
        return
    changed = [(i, now[i]) for i in range(len(now)) if now[i] != want[i]]
    for i, _ in changed:
        REPLAY_GLOBALS[i][2](want[i])
    try:
        yield
    finally:
        for i, v in changed:
            REPLAY_GLOBALS[i][2](v)


_Replay = tuple[bool, bool, Any, Any]


def _enter_replay(region: Region) -> _Replay:
    """Enter the replay context (see Note [Realize order]): nothing recorded, no grad, no
    autocast, the forward's settings. Returns what :func:`_exit_replay` restores.

    Plain functions rather than a context manager: this runs once per unpack that
    recomputes, where a generator-based manager costs measurable time.
    """
    recording = region._recording  # False inside a policy's call, even in an open region
    region._recording = False
    grad_was = torch.is_grad_enabled()
    _set_grad_enabled(False)
    autocast = _autocast_off() if _is_any_autocast_enabled() else None
    if autocast is not None:
        autocast.__enter__()
    settings = _replay_globals(region)
    settings.__enter__()
    return recording, grad_was, autocast, settings


def _exit_replay(region: Region, replay: _Replay) -> None:
    """Leave the replay context entered by :func:`_enter_replay`."""
    recording, grad_was, autocast, settings = replay
    settings.__exit__(None, None, None)
    if autocast is not None:
        autocast.__exit__(None, None, None)
    _set_grad_enabled(grad_was)
    region._recording = recording


def realize(region: Region, h: Handle) -> torch.Tensor:
    """Recompute ``h`` from the nearest kept values. See Note [Realize order]."""
    if h.cache is not None:
        return h.cache
    nodes = region.nodes
    state = region._pass
    number = state.number
    replay = _enter_replay(region)  # set up by hand: it runs once per unpack that recomputes
    try:
        if state.segment_limit > 0:
            _realize_bounded(region, h)
            return _realized(h)
        stack: list[tuple[int, bool]] = [(h.node_index, False)]
        while stack:
            index, expanded = stack.pop()
            node = nodes[index]
            if node.transient:  # runs whenever its value is not cached
                if node.outputs[0].cache is not None:  # type: ignore[union-attr]
                    continue
            elif node.pass_id == number:
                if expanded:
                    _unpin(state, node)
                continue
            if expanded:
                run_node(region, node)
                _unpin(state, node)
                continue
            stack.append((index, True))
            for i in node.inputs:
                if i.reason is None:
                    if i.transient:
                        i.pins += 1
                    if i.cache is None:
                        stack.append((i.node_index, False))
    finally:
        _exit_replay(region, replay)
    return _realized(h)


def _realized(h: Handle) -> torch.Tensor:
    if h.cache is None:
        raise CkptGraphError(
            f"ckpt_graph: internal error: {h!r} was not realized; please report this with the "
            "model that triggers it"
        )
    return h.cache


# Note [Region inputs keep their identity]
# A saved tensor that was a region input (a parameter, a mask, the block's input) and is
# unchanged is unpacked as the original tensor object while it is alive, not as the alias
# the region keeps (``holding.detached``), so ``ctx.saved_tensors[i] is w`` holds as in eager
# for tensors that do not require grad. The version check comes first (``_kept_value``).
# Known limitation: autograd re-wraps whatever an unpack hook returns for a tensor that
# requires grad (``SavedVariable::unpack`` with hooks), so such a tensor (a parameter) comes
# back as a new object sharing its storage, without its Python attributes
# (Megatron's ``weight.main_grad``); ``torch.utils.checkpoint`` without reentrant has the
# same limit. Keep such attributes on ``ctx`` (``ctx.weight = weight``) instead.


# Note [Reading a saved tensor again]
# Autograd unpacks a saved tensor at every read: a custom ``autograd.Function`` whose
# backward reads ``ctx.saved_tensors`` twice, or a hook reading ``grad_fn._saved_self``
# before the node runs, unpack the same packed object twice in one pass. Its use was taken
# at the first read (see Note [Use counts and freeing]), so the value may be freed already
# and its producer has run in this pass. A packed object therefore remembers the pass of
# its last read (``Packed.read``); a further read in that pass takes no use and returns the
# cached value, or recomputes it with ``realize_again``: from kept and cached values, into
# a local table, without touching use counts, caches or the pass state, writes replayed on
# copies. The result belongs to the caller only, so nothing stays alive once it drops it;
# a second read costs a recomputation instead of holding every value read until the end
# of the pass.


def realize_again(region: Region, h: Handle) -> torch.Tensor:
    """Recompute ``h`` once more, outside the pass bookkeeping.

    See Note [Reading a saved tensor again].
    """
    nodes = region.nodes
    # id(handle) -> value of this call. No closures over it: a nested function that
    # calls itself is a reference cycle, which would keep the values until a gc pass.
    local: dict[int, torch.Tensor] = {}
    replay = _enter_replay(region)
    try:
        stack: list[tuple[int, bool]] = [(h.node_index, False)]
        while stack:
            index, expanded = stack.pop()
            node = nodes[index]
            if not expanded:
                if all(o is None or id(o) in local for o in node.outputs):
                    continue
                stack.append((index, True))
                for i in node.inputs:
                    if i.reason is None and i.cache is None and id(i) not in local:
                        stack.append((i.node_index, False))
                continue
            if any(o is not None and id(o) in local for o in node.outputs):
                continue  # ran already (pushed twice before it ran)
            args = [_local_value(region, local, a) for a in node.args]
            kwargs = {k: _local_value(region, local, v) for k, v in node.kwargs.items()}
            for w in node.info.writes:  # never write a value someone else holds
                v = arg_at(args, kwargs, w)
                if isinstance(v, torch.Tensor):
                    v = (
                        v.as_strided(v.size(), v.stride(), v.storage_offset())
                        if node.info.is_inplace_view
                        else exact_copy(v)
                    )
                    if isinstance(w, int):
                        args[w] = v
                    else:
                        kwargs[w] = v
            out = _call(node, args, kwargs)
            for o, v in zip(node.outputs, out if node.out_is_tuple else (out,), strict=True):
                if o is not None:
                    local[id(o)] = v
    finally:
        _exit_replay(region, replay)
    return local[id(h)]


def _local_value(region: Region, local: dict[int, torch.Tensor], a: Any) -> Any:
    """An argument's value for ``realize_again``: kept, cached, or computed by this call."""
    if type(a) is Handle:
        if a.reason is not None:
            return _kept_value(region, a)
        if a.cache is not None:
            return a.cache
        return local[id(a)]
    if type(a) is list:
        return [_local_value(region, local, e) for e in a]
    return a


def _realize_bounded(region: Region, h: Handle) -> None:
    """Realize ``h`` with a bounded cache. See Note [Bounded recompute cache], rule 2."""
    nodes = region.nodes
    state = region._pass
    order = plan_realize(region, h)
    try:
        for index in order:
            if index == order[-1]:
                state.closing = False  # the last segment stays cached: backward is at it
            run_node(region, nodes[index])
    finally:
        state.need = {}
        state.active = {}


def _value(region: Region, a: Any) -> Any:
    if type(a) is Handle:
        if a.reason is not None:
            return _kept_value(region, a)
        if a.cache is None:
            raise CkptGraphError(
                f"ckpt_graph: internal error: {a!r} is needed but not cached; please report this"
            )
        return a.cache
    if type(a) is list:
        return [_value(region, e) for e in a]
    return a


def _fresh_alias(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` (same storage and geometry) with a version counter of its own."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        alias = t.as_strided(t.size(), t.stride(), t.storage_offset())
    return alias


def run_node(region: Region, node: OpNode) -> None:
    """Run one recorded op on realized inputs; cache outputs that are still pending."""
    args = [_value(region, a) for a in node.args]
    kwargs = {k: _value(region, v) for k, v in node.kwargs.items()} if node.kwargs else {}
    info = node.info
    for w in info.writes:
        h = arg_at(node.args, node.kwargs, w)
        if type(h) is not Handle:
            continue
        v = arg_at(args, kwargs, w)
        alone = (
            h.reason is None
            and not h.is_view
            and not h.has_views
            and h.pending <= 1
            # an unsafe_chunk output aliases the value it was cut from, which may be kept
            and region.nodes[h.node_index].op not in UNANNOTATED_ALIASES
        )
        if info.is_inplace_view:
            # See Note [Mutation and views], rule 7: the replay must not bump the version
            # counter of the value it reads (a kept value is checked against its version).
            v = v if alone else _fresh_alias(v)
        elif not alone:
            v = exact_copy(v)
        if isinstance(w, int):
            args[w] = v
        else:
            kwargs[w] = v
    try:
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(f"ckpt_graph::recompute::{info.name}"):
                out = _call(node, args, kwargs)
        else:
            out = _call(node, args, kwargs)
    except Exception as e:
        where = f" in module {node.module_path!r}" if node.module_path else ""
        raise CkptGraphError(
            f"ckpt_graph: recomputing op #{node.index} {info.name} (position {node.index} of the "
            f"region's forward{where}) failed: {e}. Its inputs may have been modified in place "
            "after the forward; keep this op's output (tag_with_policy(t, True)) or avoid the "
            "modification."
        ) from e
    state = region._pass
    node.pass_id = state.number
    node.realized += 1
    state.recomputed_ops += 1
    outs = out if node.out_is_tuple else (out,)
    if node.checksums is not None:
        check_replay(node, outs)
    node.owed = False
    bounded = state.segment_limit > 0
    for o, v in zip(node.outputs, outs, strict=True):
        if o is not None and o.reason is None and o.pending > 0 and o.cache is None:
            o.cache = v
            if not o.is_view:
                state.cached_bytes += o.nbytes
            if bounded:  # See Note [Bounded recompute cache], rule 2.
                if o in state.need:
                    state.active[o] = None
                else:
                    join_segment(region, state, o)
    if state.cached_bytes > state.peak_cached_bytes:
        state.peak_cached_bytes = state.cached_bytes
    if node.transient:  # its inputs are released with its value's uses
        return
    for i in node.inputs:
        if i.reason is None:
            _release_use(region, state, i)
            if bounded:
                need = state.need
                left = need[i] - 1
                if left > 0:
                    need[i] = left
                    continue
                del need[i]
                if i in state.active:
                    del state.active[i]
                    if i.cache is not None and i not in state.checkpoints:
                        join_segment(region, state, i)
    if (
        bounded
        and state.closing
        and 2 * state.segment_bytes >= state.segment_limit
        and frontier_bytes(region, state) <= state.frontier_bytes
    ):  # a cheap place for checkpoints. See Note [Bounded recompute cache], rule 2.
        close_segment(region, state)


# Note [Ops that read grad mode]
# A few kernels decide from grad mode whether to return what their backward needs: on CPU
# ``mkldnn_rnn_layer`` (nn.LSTM) returns its workspace only with grad enabled. The forward
# ran them with grad enabled; recompute runs with grad disabled (see the replay context),
# so these ops run with grad enabled again, below autograd (no graph is built).
_GRAD_MODE_OPS = frozenset(
    op
    for name in ("mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn")
    if (op := getattr(getattr(torch.ops.aten, name, None), "default", None)) is not None
)


def _call(node: OpNode, args: list[Any], kwargs: dict[str, Any]) -> Any:
    if node.op in _GRAD_MODE_OPS:
        with torch._C._AutoDispatchBelowAutograd(), torch.enable_grad():
            return node.op(*args, **kwargs)
    if node.rng is None:
        return node.op(*args, **kwargs)
    gen, state = node.rng
    before = gen.get_state()
    gen.set_state(state)
    try:
        return node.op(*args, **kwargs)
    finally:
        gen.set_state(before)
