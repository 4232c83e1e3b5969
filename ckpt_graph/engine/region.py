"""The region: the recorded graph of one checkpointed forward, and what backward needs.

A region is opened by the outermost ``save_recompute_policy`` block of a thread (see
``api.py``) and closed when that block exits; inner blocks push their policy onto it
(``policy_stack``). While open, its :class:`~ckpt_graph.engine.record.Recorder` records
every aten op and its saved-tensor hooks pack handles instead of tensors (``hooks.py``).
This module holds the region's lifecycle (``open_region`` / ``close_region``), its map
from tensors to handles (``handle_of``) and tags; the region composes the owners of its
state (``policy_stack.py``, ``saved_log.py``, ``recording_state.py``, ``modules.py``, and
the backward pass state of ``passes.py``). Recording is in ``record.py``, backward in
``realize.py``.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphError, CkptGraphTypeError
from ckpt_graph.engine import graph
from ckpt_graph.engine import modules as _modules
from ckpt_graph.engine.cache_bound import parse_cache_limit
from ckpt_graph.engine.debug import kept_checksums
from ckpt_graph.engine.decisions import PolicyContext, PolicyFn
from ckpt_graph.engine.decisions import to_decision as _to_decision
from ckpt_graph.engine.graph import Handle, OpNode, version_of
from ckpt_graph.engine.holding import detached, free_kept, hold
from ckpt_graph.engine.hooks import pack_hook_for, unpack_hook_for_autograd
from ckpt_graph.engine.kept_lifetime import (
    count_readers,
    freed_inputs,
    mark_recompute_inputs,
    need,
    unneed,
)
from ckpt_graph.engine.mutation.storage_history import rebase
from ckpt_graph.engine.offload import Offloader
from ckpt_graph.engine.outputs import KEPT_ON_HOST as _KEPT_ON_HOST
from ckpt_graph.engine.passes import PassState, count_live_uses, free_use
from ckpt_graph.engine.policy_stack import PolicyStack
from ckpt_graph.engine.record import Recorder
from ckpt_graph.engine.recording_state import RecordingState
from ckpt_graph.engine.replay import REPLAY_GLOBALS, replay_globals
from ckpt_graph.engine.saved_log import SavedLog

__all__ = [
    "Region",
    "changed_globals",
    "close_region",
    "current_region",
    "nested_block_hooks",
    "open_region",
]

_tls = threading.local()
_free_weak_ref = torch.UntypedStorage._free_weak_ref


def current_region() -> Region | None:
    """The region open in this thread, or ``None``."""
    return getattr(_tls, "region", None)


class Region:
    """The recorded graph of one checkpointed forward, and what backward needs of it.

    Attributes:
        nodes: the recorded op nodes, in forward order.
        inputs: handles of region inputs and of values taken as they were (always kept).
        saved: every tensor autograd saved in the region, in order, as ``(number of op
            nodes recorded before the save, handle)``; backward unpacks roughly in reverse.
        kept_bytes: bytes of the values kept by policy, tags or the engine (inputs excluded,
            but the copies of inputs and views taken before an in-place op counted).
        tagged: handles of the values ``tag_with_policy`` decided for (kept or recomputed).
        debug: whether recomputed values are checked against the forward, and kept values
            against their value at region exit (checksums; see Note [Kept value checks]).
        cache_limit: bound on the recomputed values a backward pass caches: bytes, ``None``
            (automatic) or ``"unbounded"`` (see Note [Bounded recompute cache]).
        opened_by: which integration opened the region (``"ckpt_graph.wrap: layers.3
            (Block)"``), or ``""`` for a plain ``save_recompute_policy`` block (see Note
            [Integrations say when they are active]).
        is_open: whether the outermost block is running (read-only).
        released: whether the region exited and autograd let go of every saved tensor of
            it, so that it holds no tensor anymore (read-only; see Note [Packed lifetime]).
        policy_stack: the policies of the open blocks and what they decide alike
            (:class:`~ckpt_graph.engine.policy_stack.PolicyStack`). This attribute and the
            ones below are engine state: the engine's modules read and change them, through
            the owners' public attributes; policies and users should not.
        saved_log: the tensors autograd saved and the packs it still holds
            (:class:`~ckpt_graph.engine.saved_log.SavedLog`).
        recording: what the recorder and the mutation rules track while the region
            records (:class:`~ckpt_graph.engine.recording_state.RecordingState`).
        module_stack: the modules whose forward is running, for op nodes' module paths
            (:class:`~ckpt_graph.engine.modules.ModuleStack`).
        forward_globals: the settings of Note [Replay globals] when the region opened,
            which recomputation runs under (``None`` before it opened).
        kept_sums: with ``debug``, the checksum of each kept value at region exit (see
            Note [Kept value checks]).
        pass_state: the state of the current (or last) backward pass, owned by
            ``engine/passes.py`` (``PassState``: pass number, ops recomputed, cached bytes,
            the bounded cache's plan); read it, never write it.

    Invariants:
        Nothing outside refers to a region except the packed saved tensors autograd holds
        and the user's own ``with ... as region`` variable; when the last packed saved
        tensor is released (backward without ``retain_graph``, or the graph is dropped),
        the region releases every tensor it holds (see Note [Packed lifetime]).

    Example:
        >>> with ckpt_graph.save_recompute_policy("recompute_all") as region:
        ...     y = model(x)
        >>> len(region.nodes) > 0
        True
    """

    def __init__(self, debug: bool = False, cache_limit: int | str | None = None) -> None:
        self.nodes: list[OpNode] = []
        self.inputs: list[Handle] = []
        self.saved_log = SavedLog()
        self.kept_bytes = 0
        self.debug = debug
        self.cache_limit = parse_cache_limit(cache_limit)
        self.policy_stack = PolicyStack()
        self.recording = RecordingState()
        self._open = False
        self._closed = False
        self.module_stack = _modules.ModuleStack()
        self._exits = ExitStack()  # while open: what closing undoes
        self._hook_fns: tuple[Any, Any] | None = None  # while open: refers to the region
        self.pass_state = PassState()
        self.kept_sums: dict[Handle, tuple[float, float, float]] = {}
        self.forward_globals: tuple[Any, ...] | None = None
        self.tagged: set[Handle] = set()  # values tag_with_policy decided for
        self.opened_by = ""  # See Note [Integrations say when they are active].
        self._offloader: Offloader | None = None  # made at the first offloaded value

    # ----------------------------------------------------------------- held values
    # (the lifecycle, ``open_region`` and ``close_region``, is below the class)
    def offloader(self) -> Offloader:
        """The copies of the values kept in host memory. See Note [Offload on CUDA]."""
        if self._offloader is None:
            self._offloader = Offloader()
        return self._offloader

    def _release(self) -> None:
        """Drop every tensor value the region holds (metadata stays for introspection), and
        the weak references to saved storages (see Note [Live forward tensors])."""
        if self._offloader is not None:
            self._offloader.clear()
        for h in self.inputs:
            h.value = None
            h.cache = None
            if h.storage:
                _free_weak_ref(h.storage)
                h.storage = 0
        for node in self.nodes:
            node.rng = None
            for o in node.outputs:
                if o is not None:
                    o.value = None
                    o.cache = None
                    if o.storage:
                        _free_weak_ref(o.storage)
                        o.storage = 0

    @property
    def saved(self) -> list[tuple[int, Handle]]:
        """Every tensor autograd saved in the region, in order: ``(number of op nodes
        recorded before the save, handle)``. See Note [Saved tensor records]."""
        return self.saved_log.pairs()

    # ----------------------------------------------------------------- handles
    def settle(self) -> None:
        """Read the versions of the last op's in-place and view outputs.

        Autograd bumps the version counter of a written tensor, and makes a view share its
        base's counter, only after the recorder returns; nothing can run in between but
        autograd's own bookkeeping, so the versions are read when the region next sees any
        tensor (next op, saved tensor, tag, exit). See Note [Mutation and views], rule 5.
        """
        unsettled = self.recording.unsettled
        for h in unsettled:
            t = None if h.unlinked else h()
            if t is not None:
                h.version = version_of(t)
                if h.value is not None and h.offload_device is None:
                    # A view got its base's version counter only now: alias it again.
                    h.value = detached(self, t)
                    h.copied = False
        unsettled.clear()

    def lookup(self, t: torch.Tensor) -> Handle | None:
        """The handle of the value ``t`` held when last seen in the region, or ``None``."""
        h = self.recording.ids.get(id(t))
        if h is None or h() is not t or h.unlinked:
            return None
        return h

    def handle_of(self, t: torch.Tensor) -> Handle:
        """The handle of the value ``t`` holds now; a new kept input handle if unseen."""
        ids = self.recording.ids
        old = ids.get(id(t))
        if old is not None and old() is t and not old.unlinked:
            try:  # inlined version_of(): this runs for every tensor argument
                version = t._version
            except RuntimeError:
                version = 0
            if old.version == version and not old.superseded:
                return old
            # Changed through another alias: a view sharing its version counter, or one
            # with a counter of its own (`.data`), which leaves the version as it was.
            if self.recording.on:
                rebased = rebase(self, t, old)
                if rebased is not None:
                    ids[id(t)] = rebased
                    return rebased
            reason = graph.MUTATED_ALIAS
        else:
            reason = graph.INPUT
        values = self.pass_state.handles  # See Note [Values numbered as recorded].
        h = Handle(t, -1, -1, len(values), len(self.inputs))
        values.append(h)
        self.inputs.append(h)
        ids[id(t)] = h
        hold(self, h, t, reason)
        return h

    # ----------------------------------------------------------------- policies
    @property
    def policies(self) -> tuple[PolicyFn, ...]:
        """The policy stack, outermost first."""
        return tuple(self.policy_stack.policies)

    def tag(self, t: torch.Tensor, policy: CheckpointPolicy | bool) -> None:
        """Override the decision for the value ``t`` holds. See ``tag_with_policy``."""
        from ckpt_graph.engine.api import tag_with_policy  # late: api imports this module

        decision = _to_decision(policy, tag_with_policy, "tag_with_policy")
        if decision is None:
            raise CkptGraphTypeError(
                "ckpt_graph: tag_with_policy needs a CheckpointPolicy or a bool, got None"
            )
        h = self.handle_of(t)
        if h.node_index < 0 or (h.reason is not None and h.reason.by_engine):
            return  # region inputs and engine-kept values are always kept
        # Per value, not per op node: a tag on one output of a multi-output op (``split``)
        # says nothing about its siblings, which keep the policies' decision.
        self.tagged.add(h)
        # See Note [Kept values live no longer than in eager], rules 1, 2 and 6.
        count_readers(self)
        if decision in _KEPT_ON_HOST:
            if not h.kept:
                needed = h.saved_refs > 0 or h.recompute_readers > 0
                hold(self, h, t, graph.TAG, _KEPT_ON_HOST[decision])
                if needed:  # its producer need not run for it any more
                    unneed(self, h)
            else:
                h.reason = graph.TAG
        elif h.kept:
            # Kept values its recomputation reads may be freed: recompute them too, or keep it.
            freed = freed_inputs(self, self.nodes[h.node_index])
            if freed is None:
                h.reason = graph.INPUTS_FREED
                return
            for v in freed:
                free_kept(self, v)
                mark_recompute_inputs(self.nodes[v.node_index].inputs)
            # Needed already: count its producer in its inputs while ``h`` is still kept, or
            # ``need`` would see ``h`` needed and take the producer as counted.
            if (h.saved_refs > 0 or h.recompute_readers > 0) and not need(self, h):
                raise CkptGraphError(  # freed_inputs found every value need() would miss
                    f"ckpt_graph: internal error: recomputing {h!r} after a tag reads a freed "
                    "kept value; please report this with the program that triggers it"
                )
            free_kept(self, h)
            mark_recompute_inputs(self.nodes[h.node_index].inputs)

    # ----------------------------------------------------------------- backward
    def pack_released(self, h: Handle) -> None:
        """Autograd let go of a packed saved tensor of ``h``. See Note [Packed lifetime]."""
        log = self.saved_log
        log.live_packs -= 1
        if self._closed:
            if log.live_packs == 0:
                self._release()
            else:
                free_use(self, h)

    # ----------------------------------------------------------------- introspection
    @property
    def is_open(self) -> bool:
        """Whether the region's outermost block is running (ops are recorded in it)."""
        return self._open

    @property
    def released(self) -> bool:
        """Whether the region has exited and autograd let go of every saved tensor of it:
        it holds no tensor anymore, only metadata (see Note [Packed lifetime])."""
        return self._closed and self.saved_log.live_packs == 0

    # See ckpt_graph/analysis/export.py.
    @property
    def graph(self) -> Any:
        """The recorded graph as records of op nodes (see ``analysis.graph``)."""
        from ckpt_graph import analysis

        return analysis.graph(self)

    def to_networkx(self) -> Any:
        """The recorded graph as a ``networkx.DiGraph`` (see ``analysis.to_networkx``)."""
        from ckpt_graph import analysis

        return analysis.to_networkx(self)

    def to_dot(self) -> str:
        """The recorded graph as DOT text (see ``analysis.to_dot``)."""
        from ckpt_graph import analysis

        return analysis.to_dot(self)

    def summary(self) -> Any:
        """What is kept, what is recomputed and what it costs (see ``analysis.summary``)."""
        from ckpt_graph import analysis

        return analysis.summary(self)

    def explain(self, tensor: torch.Tensor) -> Any:
        """Why ``tensor``'s value is kept or recomputed (see ``analysis.explain``)."""
        from ckpt_graph import analysis

        return analysis.explain(self, tensor)

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"Region({len(self.nodes)} ops, {self.kept_bytes} kept bytes, {state})"


# ----------------------------------------------------------------- lifecycle
def open_region(region: Region) -> None:
    """Open ``region`` in this thread: install its hooks and recorder. Called by the
    outermost ``save_recompute_policy`` block (``api.py``)."""
    if torch.is_inference_mode_enabled():
        raise CkptGraphError(
            "ckpt_graph: save_recompute_policy cannot run under torch.inference_mode(): "
            "inference mode saves nothing for backward; leave the region out, or run it "
            "under torch.no_grad() instead"
        )
    region.recording.task = torch._C._current_graph_task_id()
    region.forward_globals = replay_globals()
    region.policy_stack.ctx = PolicyContext(region)
    region._hook_fns = (pack_hook_for(region), unpack_hook_for_autograd())
    with ExitStack() as exits:  # undone in reverse order, also if a step raises
        _tls.region = region
        exits.callback(setattr, _tls, "region", None)
        _modules.install_hooks(current_region)
        exits.callback(_modules.uninstall_hooks)
        exits.enter_context(torch.autograd.graph.saved_tensors_hooks(*region._hook_fns))
        exits.enter_context(Recorder(region))
        region._exits = exits.pop_all()
    region._open = True
    region.recording.on = True


def nested_block_hooks(region: Region) -> Any:
    """Saved-tensor hooks a nested block must push again, or ``None``.

    See Note [Foreign saved-tensor hooks].
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    fns = region._hook_fns
    if not region._open or fns is None or (top is not None and top[0] is fns[0]):
        return None
    return torch.autograd.graph.saved_tensors_hooks(*fns)


def close_region(region: Region) -> None:
    """Close ``region``: undo what ``open_region`` installed, and keep of the recording only
    what backward needs. See Note [Packed lifetime]."""
    region.recording.on = False
    region._open = False
    region._closed = True
    region._exits.close()
    region._hook_fns = None
    region.settle()
    region.recording.finish()
    region.saved_log.strides.clear()
    region.policy_stack.ctx = None
    region.module_stack.clear()
    if region.saved_log.live_packs == 0:
        region._release()
    else:
        count_live_uses(region)
        if region.debug:
            region.kept_sums = kept_checksums(region)  # See Note [Kept value checks].


def changed_globals(region: Region) -> list[str]:
    """Settings of Note [Replay globals] changed since the region opened."""
    if region.forward_globals is None:
        return []
    now = replay_globals()
    return [REPLAY_GLOBALS[i][0] for i in range(len(now)) if now[i] != region.forward_globals[i]]
