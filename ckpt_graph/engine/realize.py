"""Realize: recompute handles on demand in backward, cache them, free them.

The pieces: ``passes`` (use counts per backward pass, transient values, end-of-pass
cleanup), ``replay`` (running a recorded op again: replay context, RNG replay),
``second_read`` (a saved tensor read twice in one pass), ``release`` (kept values freed as
autograd frees saved tensors), ``version_check`` and ``cache_bound`` (bounded cache).

# Note [Realize order]
# ``realize`` walks the producers of a handle with an explicit stack (no Python recursion,
# so a 20,000-op chain works): a node is expanded once, its recomputed inputs that are not
# cached are pushed, and it runs after them. A node runs at most once per pass, except the
# producer of a transient value, which runs whenever the value is needed and not cached
# (see Note [Transient values]). A bounded pass realizes differently (collect, then run in
# forward order) and runs a node again when an output it needs was dropped (see Note
# [Bounded recompute cache]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine.cache_bound import (
    close_segment,
    closes_between,
    join_segment,
    plan_realize,
    unpin,
)
from ckpt_graph.engine.debug import check_replay
from ckpt_graph.engine.graph import INPUT, Handle, arg_at, version_of
from ckpt_graph.engine.op_info import UNANNOTATED_ALIASES
from ckpt_graph.engine.passes import PassState, begin_pass, decide, end_pass, live_forward
from ckpt_graph.engine.replay import (
    _call,
    _enter_replay,
    _exit_replay,
    _fresh_alias,
    exact_copy,
    note_recompute_failure,
)
from ckpt_graph.engine.second_read import realize_again
from ckpt_graph.engine.version_check import (
    _check_version,
    _kept_value,
    _untracked_write_error,
    _version_error,
)

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["realize", "run_node", "unpack_value"]


_current_task = torch._C._current_graph_task_id


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
    state = region.pass_state
    one_shot = task == -1
    if one_shot or task != state.task:
        begin_pass(region, task)
    try:
        live = live_forward(h)  # See Note [Live forward tensors].
        if packed is not None and packed.read == state.number:
            # See Note [Reading a saved tensor again].
            held = live if live is not None else h.cache
            value = held if held is not None else realize_again(region, h)
        else:
            value = live if live is not None else realize(region, h)
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
    h.pass_uses -= 1
    if h.transient:
        for i in region.nodes[h.node_index].inputs:
            if i.reason is None:
                _release_use(region, state, i)
        if h.waiting_readers > 0 and h.pass_uses > 0:
            return
    elif h.pass_uses > 0:
        return
    if h.cache is not None:
        h.cache = None
        if not h.is_view and not h.live:  # a view's bytes belong to its base
            state.cached_bytes -= h.nbytes


def _unpin(state: PassState, node: OpNode) -> None:
    """``node`` ran (or was skipped): its transient inputs are no longer needed for it."""
    for i in node.inputs:
        if i.transient:
            i.waiting_readers -= 1
            if i.waiting_readers == 0 and i.cache is not None:
                i.cache = None
                state.cached_bytes -= i.nbytes


def realize(region: Region, h: Handle) -> torch.Tensor:
    """Recompute ``h`` from the nearest kept values. See Note [Realize order]."""
    if h.cache is not None:
        return h.cache
    nodes = region.nodes
    state = region.pass_state
    number = state.number
    if state.undecided:  # See Note [Bounded recompute cache], rule 1.
        decide(region, h)
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
                        i.waiting_readers += 1
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


def _realize_bounded(region: Region, h: Handle) -> None:
    """Realize ``h`` with a bounded cache. See Note [Bounded recompute cache], rule 2."""
    nodes = region.nodes
    state = region.pass_state
    order = plan_realize(region, h)
    try:
        for k, index in enumerate(order):
            run_node(region, nodes[index])
            # the last segment stays cached: backward is at it
            if state.closing and k + 1 < len(order) and closes_between(state, index, order[k + 1]):
                close_segment(region, state)
    finally:
        unpin(state)
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
            and h.pass_uses <= 1
            and not h.live  # the program's tensor: see Note [Live forward tensors]
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
    except Exception as e:  # See Note [Errors raised by a recomputed op].
        note_recompute_failure(e, node)
        raise
    state = region.pass_state
    node.pass_id = state.number
    node.realized += 1
    state.recomputed_ops += 1
    outs = out if node.out_is_tuple else (out,)
    if node.checksums is not None:
        check_replay(node, outs)
    node.owed = False
    bounded = state.segment_limit > 0
    for o, v in zip(node.outputs, outs, strict=True):
        if o is not None and o.reason is None and o.pass_uses > 0 and o.cache is None:
            o.cache = v
            if not o.is_view:
                state.cached_bytes += o.nbytes
            if bounded:  # See Note [Bounded recompute cache], rule 2.
                if o in state.need:
                    state.active[o] = None
                else:
                    join_segment(state, o)
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
                        join_segment(state, i)
