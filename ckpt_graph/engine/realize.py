"""Realize: recompute handles on demand in backward, cache them, free them.

The pieces: ``pass_core`` (the realize/run/use loop, shared with the liveness simulator;
this module's :class:`Runner` is the engine's executor for it), ``passes`` (use counts per
backward pass, the engine's hooks, end-of-pass cleanup, kept values freed as autograd frees
saved tensors), ``replay`` (running a recorded op again: replay context, RNG replay) and
``cache_bound`` (bounded cache). Here too: a saved tensor read twice in one pass
(``realize_again``) and the version checks of kept and saved values.

# Note [Realize order]
# ``realize`` (``pass_core.Pass.realize``) walks the producers of a handle with an explicit
# stack (no Python recursion, so a 20,000-op chain works): a node is expanded once, its
# recomputed inputs that are not cached are pushed, and it runs after them. A node runs at most
# once per pass, except the producer of a transient value, which runs whenever the value is
# needed and not cached (see Note [Transient values]). A bounded pass realizes differently
# (collect, then run in forward order) and runs a node again when an output it needs was
# dropped (see Note [Bounded recompute cache]).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine import graph
from ckpt_graph.engine.debug import check_kept, check_replay
from ckpt_graph.engine.graph import INPUT, Handle, arg_at, version_of
from ckpt_graph.engine.op_info import UNANNOTATED_ALIASES
from ckpt_graph.engine.pass_graph import collect
from ckpt_graph.engine.passes import begin_pass, end_pass, live_forward
from ckpt_graph.engine.replay import (
    enter_replay,
    exact_copy,
    exit_replay,
    fresh_alias,
    note_recompute_failure,
    replay_op,
)

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["realize", "realize_again", "run_node", "unpack_value"]


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
        begin_pass(region, task, Runner(region))
    try:
        live = live_forward(h)  # See Note [Live forward tensors].
        if packed is not None and packed.read == state.number:
            # See Note [Reading a saved tensor again].
            held = live if live is not None else h.cache
            value = held if held is not None else realize_again(region, h)
        else:
            value = live if live is not None else realize(region, h)
            core = state.core
            assert core is not None
            core.use(h.number)
            if packed is not None:
                packed.read = state.number
    finally:
        if one_shot:
            end_pass(region)
    return value


def realize(region: Region, h: Handle) -> torch.Tensor:
    """Recompute ``h`` from the nearest kept values. See Note [Realize order]."""
    if h.cache is not None:
        return h.cache
    state = region.pass_state
    core = state.core
    assert core is not None
    replay = enter_replay(region)  # set up by hand: it runs once per unpack that recomputes
    try:
        core.realize(h.number)
    finally:
        exit_replay(region, replay)
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


class Runner:
    """The engine's executor of a pass (``pass_core.Executor``): runs recorded ops on
    realized inputs and holds the recomputed tensors in ``Handle.cache``.

    It refers to its region weakly: the region's pass state refers to the pass, which
    refers to its executor, and a pass whose backward failed is never ended (no end-of-pass
    callback), so a strong reference would be a cycle holding the region's cached values
    until a gc pass. What it reads per op (the op nodes, the values by number, the byte
    counts) it holds directly: none of them refers back to the pass.
    """

    __slots__ = ("bytes", "handles", "made", "nodes", "region")

    def __init__(self, region: Region) -> None:
        self.region = weakref.ref(region)
        state = region.pass_state
        self.nodes = region.nodes
        self.handles = state.handles
        self.bytes = state.cache_bytes
        self.made: tuple[Any, ...] = ()  # outputs of the op node just run

    def run(self, j: int) -> None:
        """Run op node ``j`` (see ``run_node``)."""
        region = self.region()
        assert region is not None  # a region runs its own passes
        self.made = run_node(region, self.nodes[j])

    def hold(self, o: int) -> None:
        h = self.handles[o]
        h.cache = self.made[h.output_index]
        if not h.is_view:  # a view's bytes belong to its base
            counts = self.bytes
            counts.now += h.nbytes
            if counts.now > counts.peak:
                counts.peak = counts.now

    def discard(self, o: int) -> None:
        pass  # dropped with ``made`` when the node is done

    def done(self, j: int) -> None:
        self.made = ()

    def free(self, v: int) -> None:
        h = self.handles[v]
        h.cache = None
        if not h.is_view and not h.live:
            self.bytes.now -= h.nbytes


def run_node(region: Region, node: OpNode) -> tuple[Any, ...]:
    """Run one recorded op on realized inputs; return its outputs.

    A recorded write runs on a copy of its input unless no other pending use needs that
    value (see Note [Mutation and views]).
    """
    state = region.pass_state
    core = state.core
    assert core is not None
    uses = core.uses
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
            and uses[h.number] <= 1
            and not h.live  # the program's tensor: see Note [Live forward tensors]
            # an unsafe_chunk output aliases the value it was cut from, which may be kept
            and region.nodes[h.node_index].op not in UNANNOTATED_ALIASES
        )
        if info.is_inplace_view:
            # See Note [Mutation and views], rule 7: the replay must not bump the version
            # counter of the value it reads (a kept value is checked against its version).
            v = v if alone else fresh_alias(v)
        elif not alone:
            v = exact_copy(v)
        if isinstance(w, int):
            args[w] = v
        else:
            kwargs[w] = v
    try:
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(f"ckpt_graph::recompute::{info.name}"):
                out = replay_op(node, args, kwargs)
        else:
            out = replay_op(node, args, kwargs)
    except Exception as e:  # See Note [Errors raised by a recomputed op].
        note_recompute_failure(e, node)
        raise
    node.pass_id = state.number
    node.realized += 1
    state.recomputed_ops += 1
    outs: tuple[Any, ...] = tuple(out) if node.out_is_tuple else (out,)
    if node.checksums is not None:
        check_replay(node, outs)
    return outs


# ----------------------------------------------------------------- second reads
# Note [Reading a saved tensor again]
# Autograd unpacks a saved tensor at every read: a custom ``autograd.Function`` whose
# backward reads ``ctx.saved_tensors`` twice, or a hook reading ``grad_fn._saved_self``
# before the node runs, unpack the same packed object twice in one pass. Its use was taken
# at the first read (see Note [Use counts and freeing]), so the value may be freed already
# and its producer has run in this pass. A packed object therefore remembers the pass of
# its last read (``Packed.read``); a further read in that pass takes no use and returns the
# cached value, or recomputes it with ``realize_again``: from kept and cached values (the
# pass's walk back, ``pass_graph.collect``, run in forward order), into
# a local table, without touching use counts, caches or the pass state, writes replayed on
# copies. The result belongs to the caller only, so nothing stays alive once it drops it;
# a second read costs a recomputation instead of holding every value read until the end
# of the pass.


def realize_again(region: Region, h: Handle) -> torch.Tensor:
    """Recompute ``h`` once more, outside the pass bookkeeping.

    See Note [Reading a saved tensor again].
    """
    nodes = region.nodes
    state = region.pass_state
    core = state.core
    assert core is not None
    # The op nodes from ``h`` back to kept and cached values, once each, in forward order.
    order, _ = collect(core.g, (h.number,), core.kept, core.cached)
    # id(handle) -> value of this call. No closures over it: a nested function that
    # calls itself is a reference cycle, which would keep the values until a gc pass.
    local: dict[int, torch.Tensor] = {}
    replay = enter_replay(region)
    try:
        for index in order:
            node = nodes[index]
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
            try:
                out = replay_op(node, args, kwargs)
            except Exception as e:  # See Note [Errors raised by a recomputed op].
                note_recompute_failure(e, node)
                raise
            for o, v in zip(node.outputs, out if node.out_is_tuple else (out,), strict=True):
                if o is not None:
                    local[id(o)] = v
    finally:
        exit_replay(region, replay)
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


# ----------------------------------------------------------------- version checks


def _where(h: Handle, region: Region) -> str:
    """Which value of the region ``h`` is, for error messages."""
    if h.node_index >= 0:
        return f"output {h.output_index} of {region.nodes[h.node_index].info.name} (op #{h.node_index})"
    if h.reason == graph.MUTATED_ALIAS:
        return (
            f"value #{h.input_index} the region took as it was after an in-place op on an alias "
            "(a snapshot)"
        )
    return f"input #{h.input_index} of the region"


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


# Note [Version checks through a copied base]
# A saved view whose tensor is gone is checked through its base (Note [Mutation and
# views], rule 6): the base's forward tensor if it is alive, else its kept value, which
# then stands for the forward tensor only if it shares its version counter (an alias made
# by ``detached``). A kept value that a write of the region would have changed is
# replaced by an exact copy before the write (rule 4, ``hold_copy``); the copy carries the
# version the value had *before* that write and never moves again. The result of an
# in-place op names the written argument as its base, so the kept ``empty_like`` below
# ``inv[perm] = arange(n)`` (MoE routing) was copied at version 0 while the saved index
# ``inv`` is at version 1, and comparing the two reported a write that never happened.
# A copied value (``Handle.copied``) is therefore not read for the view's version: writes
# of the region over the base after the view was made are still counted by ``writes``,
# and a later write outside the region through a view of the base keeps the base's
# forward tensor alive (its ``_base``), whose counter is then read. A write through a
# ``detach`` alias, which shares the counter but not the tensor, goes unseen once the
# forward tensor is gone, as for any recomputed value (a known gap: the strict xfail in
# tests/engine/test_version_copied_base.py).
def _check_version(region: Region, h: Handle) -> None:
    """Raise autograd's version-counter error if the forward tensor of ``h`` changed."""
    t = h.value if h.value is not None and h.offload_device is None else None
    if t is None and not h.unlinked:  # See Note [A handle is a weak reference].
        t = h()
    if t is None and h.base is not None:
        # See Note [Mutation and views], rule 6: the view's tensor is gone (a temporary
        # view autograd saved), but it shared its base's version counter.
        b = h.base
        # The forward tensor first: the base's value may be a copy taken before a write
        # (``hold_copy``), whose version never moves, and a recorded write over the base
        # was then blamed on `.data`.
        bt = b.ref() if b.ref is not None else None
        if bt is None and b.value is not None and b.offload_device is None and not b.copied:
            bt = b.value  # See Note [Version checks through a copied base].
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
    if h.offload_device is not None:  # See Note [Offload on CUDA].
        return region.offloader().to_device(h, v)
    if region.debug:
        check_kept(region, h, v)  # See Note [Kept value checks].
    return v
