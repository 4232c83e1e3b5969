"""The region: the recorded graph of one checkpointed forward, and what backward needs.

A region is opened by the outermost ``save_recompute_policy`` block of a thread (see
``api.py``) and closed when that block exits; inner blocks push their policy onto it
(``_push`` / ``_pop``). While open, its :class:`~ckpt_graph.engine.record.Recorder` records
every aten op and its saved-tensor hooks pack handles instead of tensors (``hooks.py``).
This module holds the region's state and lifecycle, its map from tensors to handles
(``handle_of``) and tags; recording is in ``record.py``, backward in ``realize.py``.
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
from ckpt_graph.engine.decisions import POLICY_NAMES, PolicyContext, PolicyFn, policy_name, resolve
from ckpt_graph.engine.decisions import to_decision as _to_decision
from ckpt_graph.engine.graph import Handle, OpNode, version_of
from ckpt_graph.engine.holding import detached, hold, unhold
from ckpt_graph.engine.hooks import pack_hook_for, unpack_hook_for_autograd
from ckpt_graph.engine.offload import Offloader
from ckpt_graph.engine.outputs import KEPT_ON_HOST as _KEPT_ON_HOST
from ckpt_graph.engine.passes import PassState, count_live_uses, free_use
from ckpt_graph.engine.record import Recorder
from ckpt_graph.engine.replay import REPLAY_GLOBALS, replay_globals
from ckpt_graph.engine.storage_history import StorageHistory, rebase

__all__ = ["Region", "current_region"]

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
        self._saved: list[tuple[int, Handle]] = []  # See Note [Saved tensor records].
        self._saved_at: list[int] = []
        self._saved_handles: list[Handle] = []
        self.kept_bytes = 0
        self.debug = debug
        self.cache_limit = parse_cache_limit(cache_limit)
        self._policies: list[PolicyFn] = []
        self._policy_names: list[str] = []  # parallel to ``_policies``, for ``decided_by``
        # dispatch keys seen by ``holding.detached`` and the ones it derives from them
        self._alias_keys: tuple[Any, Any, Any] | None = None
        self._constant: CheckpointPolicy | None = None
        self._constant_by = ""  # the name that decided ``_constant``
        self._ids: dict[int, Handle] = {}
        self._shapes: dict[torch.Size, torch.Size] = {}  # See Note [One recording path].
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # likewise, saved tensors
        self._by_storage: dict[int, list[Handle]] | None = None
        self._storages: dict[int, StorageHistory] = {}  # See Note [Mutation and views].
        self._writing: StorageHistory | None = None
        self._unsettled: list[Handle] = []
        self._recording = False
        self._open = False
        self._closed = False
        self._task = -1
        self._live_packs = 0
        self._ctx: PolicyContext | None = None
        self._modules = _modules.ModuleStack()
        self._exits = ExitStack()  # while open: what closing undoes
        self._hook_fns: tuple[Any, Any] | None = None  # while open: refers to the region
        self.pass_state = PassState()
        self._kept_sums: dict[Handle, tuple[float, float, float]] = {}  # when debug
        self._globals: tuple[Any, ...] | None = None  # See Note [Replay globals].
        self.tagged: set[Handle] = set()  # values tag_with_policy decided for
        self.opened_by = ""  # See Note [Integrations say when they are active].
        self._offloader: Offloader | None = None  # made at the first offloaded value

    # ----------------------------------------------------------------- lifecycle
    def _open_region(self) -> None:
        if torch.is_inference_mode_enabled():
            raise CkptGraphError(
                "ckpt_graph: save_recompute_policy cannot run under torch.inference_mode(): "
                "inference mode saves nothing for backward; leave the region out, or run it "
                "under torch.no_grad() instead"
            )
        self._task = torch._C._current_graph_task_id()
        self._globals = replay_globals()
        self._ctx = PolicyContext(self)
        self._hook_fns = (pack_hook_for(self), unpack_hook_for_autograd())
        with ExitStack() as exits:  # undone in reverse order, also if a step raises
            _tls.region = self
            exits.callback(setattr, _tls, "region", None)
            _modules.install_hooks(current_region)
            exits.callback(_modules.uninstall_hooks)
            exits.enter_context(torch.autograd.graph.saved_tensors_hooks(*self._hook_fns))
            exits.enter_context(Recorder(self))
            self._exits = exits.pop_all()
        self._open = True
        self._recording = True

    def _hooks_for_nested_block(self) -> Any:
        """Saved-tensor hooks a nested block must push again, or ``None``.

        See Note [Foreign saved-tensor hooks].
        """
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        fns = self._hook_fns
        if not self._open or fns is None or (top is not None and top[0] is fns[0]):
            return None
        return torch.autograd.graph.saved_tensors_hooks(*fns)

    def _close_region(self) -> None:
        self._recording = False
        self._open = False
        self._closed = True
        self._exits.close()
        self._hook_fns = None
        self._settle()
        self._by_storage = None
        self._storages = {}
        self._shapes = {}
        self._strides = {}
        self._ctx = None
        self._modules.clear()
        if self._live_packs == 0:
            self._release()
        else:
            count_live_uses(self)
            if self.debug:
                self._kept_sums = kept_checksums(self)  # See Note [Kept value checks].

    def _changed_globals(self) -> list[str]:
        """Settings of Note [Replay globals] changed since the region opened."""
        if self._globals is None:
            return []
        now = replay_globals()
        return [REPLAY_GLOBALS[i][0] for i in range(len(now)) if now[i] != self._globals[i]]

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

    # Note [Saved tensor records]
    # The pack hook runs for every tensor autograd saves; it records the position and the
    # handle in two flat lists, and ``saved`` pairs them up when read (the budget policy
    # and introspection read it; plain recording never does). Appending to two lists
    # creates no object, where a tuple per save would be one more object for the garbage
    # collector to walk (see Note [One recording path]).
    @property
    def saved(self) -> list[tuple[int, Handle]]:
        """Every tensor autograd saved in the region, in order: ``(number of op nodes
        recorded before the save, handle)``. See Note [Saved tensor records]."""
        saved = self._saved
        n = len(saved)
        if n < len(self._saved_handles):
            saved.extend(zip(self._saved_at[n:], self._saved_handles[n:], strict=True))
        return saved

    # ----------------------------------------------------------------- handles
    def _settle(self) -> None:
        """Read the versions of the last op's in-place and view outputs.

        Autograd bumps the version counter of a written tensor, and makes a view share its
        base's counter, only after the recorder returns; nothing can run in between but
        autograd's own bookkeeping, so the versions are read when the region next sees any
        tensor (next op, saved tensor, tag, exit). See Note [Mutation and views], rule 5.
        """
        for h in self._unsettled:
            t = h.ref() if h.ref is not None else None
            if t is not None:
                h.version = version_of(t)
                if h.value is not None and h.offload_device is None:
                    # A view got its base's version counter only now: alias it again.
                    h.value = detached(self, t)
                    h.copied = False
        self._unsettled.clear()

    def lookup(self, t: torch.Tensor) -> Handle | None:
        """The handle of the value ``t`` held when last seen in the region, or ``None``."""
        h = self._ids.get(id(t))
        if h is None or h.ref is None or h.ref() is not t:
            return None
        return h

    def handle_of(self, t: torch.Tensor) -> Handle:
        """The handle of the value ``t`` holds now; a new kept input handle if unseen."""
        old = self._ids.get(id(t))
        if old is not None and old.ref is not None and old.ref() is t:
            try:  # inlined version_of(): this runs for every tensor argument
                version = t._version
            except RuntimeError:
                version = 0
            if old.version == version and not old.superseded:
                return old
            # Changed through another alias: a view sharing its version counter, or one
            # with a counter of its own (`.data`), which leaves the version as it was.
            if self._recording:
                rebased = rebase(self, t, old)
                if rebased is not None:
                    self._ids[id(t)] = rebased
                    return rebased
            reason = graph.MUTATED_ALIAS
        else:
            reason = graph.INPUT
        h = Handle(t, -1, -1, len(self.inputs))
        self.inputs.append(h)
        self._ids[id(t)] = h
        hold(self, h, t, reason)
        return h

    # ----------------------------------------------------------------- policies
    # Note [Failed policy push]
    # A policy's ``on_region_enter`` may raise (a bad argument, a budget that cannot be
    # planned). The block that pushed it then never runs, so nothing it pushed may stay: the
    # policy is taken off the stack again before the error propagates, and later ops of an
    # enclosing block are decided as if the failed block had never been entered.
    def _push(self, policy: PolicyFn) -> None:
        self._policies.append(policy)
        self._policy_names.append(policy_name(policy))
        self._update_constant()
        hook = getattr(policy, "on_region_enter", None)
        if hook is not None:
            try:
                hook(self)
            except BaseException:  # See Note [Failed policy push].
                self._policies.pop()
                self._policy_names.pop()
                self._update_constant()
                raise

    def _pop(self) -> None:
        policy = self._policies.pop()
        self._policy_names.pop()
        self._update_constant()
        hook = getattr(policy, "on_region_exit", None)
        if hook is not None:
            hook(self)

    def _update_constant(self) -> None:
        # A stack of string-named policies decides every op alike, without calling anything
        # (the op node is made with the decision; see ``record_node``).
        consts = [p for p in self._policies if p in POLICY_NAMES.values()]
        self._constant = None
        self._constant_by = ""
        if self._policies and len(consts) == len(self._policies):
            self._constant, self._constant_by = resolve(
                self._policies, PolicyContext(self), None, None, (), {}, self._policy_names
            )

    @property
    def policies(self) -> tuple[PolicyFn, ...]:
        """The policy stack, outermost first."""
        return tuple(self._policies)

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
        if decision in _KEPT_ON_HOST:
            if not h.kept:
                hold(self, h, t, graph.TAG, _KEPT_ON_HOST[decision])
            else:
                h.reason = graph.TAG
        elif h.kept:
            unhold(self, h)

    # ----------------------------------------------------------------- backward
    def _pack_released(self, h: Handle) -> None:
        self._live_packs -= 1
        if self._closed:
            if self._live_packs == 0:
                self._release()
            else:
                free_use(self, h)

    # ----------------------------------------------------------------- introspection
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
