"""The public entry points: ``save_recompute_policy``, ``checkpoint``, ``tag_with_policy``.

Example:
    >>> import ckpt_graph
    >>> with ckpt_graph.save_recompute_policy("recompute_all") as region:
    ...     loss = model(x).sum()
    >>> loss.backward()
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphError, CkptGraphTypeError
from ckpt_graph.engine.cache_bound import parse_cache_limit
from ckpt_graph.engine.decisions import normalize_policy
from ckpt_graph.engine.lowering import checkpoint_lowered, runs_eagerly
from ckpt_graph.engine.region import (
    Region,
    changed_globals,
    close_region,
    current_region,
    nested_block_hooks,
    open_region,
)
from ckpt_graph.engine.torch_sac import policy_from_context_fn

__all__ = ["checkpoint", "save_recompute_policy", "tag_with_policy"]

T = TypeVar("T")


# Note [Foreign saved-tensor hooks]
# A block nested in an open region only pushes its policy: the region's saved-tensor hooks
# are already installed. Other code may have pushed hooks of its own on top of them since
# (``torch.utils.checkpoint`` around the nested block, ``save_on_cpu``); those would take
# the tensors saved inside the nested block. For torch's checkpoint that is wrong: in its
# recompute (during backward, no region open) the same block opens a region of its own,
# which takes the saves, and torch finds fewer saved tensors than in forward. So a nested
# block whose region's hooks are not on top pushes them again for its extent: its saves go
# to the region, as they would without the foreign hooks, in forward and in recompute alike.


class save_recompute_policy:
    """Run a region of forward code with graph-based activation checkpointing.

    Inside the block every aten op is recorded; tensors autograd saves for backward are
    kept or recomputed in backward as the policy decides. Blocks nest: an inner block
    pushes its policy onto the region of the outermost one, and ``as region`` gives that
    same region at any depth. See Note [Policy stack resolution].

    Args:
        policy: a name, ``"recompute_all"`` (default), ``"must_save_all"`` or
            ``"save_matmuls"`` (see Note [Policy names]), or a callable
            ``policy(ctx, out, op, *args, **kwargs) -> CheckpointPolicy | bool | None``.
        debug: check each recomputed value against the forward's and name the first op
            that diverged, and each kept value (parameters included) against its value at
            region exit, which catches writes through ``.data`` (see Note [Kept value
            checks]). Only honoured by the block that opens the region.
        cache_limit: how many bytes of recomputed values backward may hold cached at once
            (set by the block that opens the region; a nested block may only repeat it).
            ``None`` (default) bounds automatically: when backward's first realize that
            caches anything would cache much of the forward (one region over a whole
            model), values are cached in segments between cuts planned for the least cache
            and recomputed again from the checkpoints at the cuts, at most two forwards of
            recompute in all (Chen et al. 2016). An int or a string
            such as ``"256MiB"`` or ``"1.5GB"`` sets the bound in bytes (a warning says
            when it is below what two forwards can reach); ``"unbounded"`` caches every
            recomputed value until its last use. See Note [Bounded recompute cache].

    Raises:
        CkptGraphError: for a ``cache_limit`` that is not a positive size, ``None`` or
            ``"unbounded"``, or a nested block that asks for another ``cache_limit`` than
            its region's.

    Example:
        >>> with ckpt_graph.save_recompute_policy("recompute_all"):
        ...     loss = model(x).sum()
        >>> loss.backward()  # activations are recomputed on demand
    """

    def __init__(
        self,
        policy: Any = "recompute_all",
        *,
        debug: bool = False,
        cache_limit: int | str | None = None,
    ) -> None:
        self._policy = normalize_policy(policy)
        self._debug = debug
        self._cache_limit = parse_cache_limit(cache_limit)
        self._region: Region | None = None
        self._opened = False
        self._exits = ExitStack()  # what leaving the block undoes, in reverse order

    def __enter__(self) -> Region:
        if self._region is not None:
            raise CkptGraphError(
                "ckpt_graph: a save_recompute_policy block cannot be entered twice"
            )
        region = current_region()
        with ExitStack() as exits:  # unwound if a step raises: nothing stays pushed
            if region is None:
                region = Region(debug=self._debug, cache_limit=self._cache_limit)
                open_region(region)
                self._opened = True
                exits.callback(close_region, region)
            else:
                if self._cache_limit is not None and self._cache_limit != region.cache_limit:
                    raise CkptGraphError(
                        f"ckpt_graph: a nested save_recompute_policy block asks for "
                        f"cache_limit={self._cache_limit!r}, but its region (opened by the "
                        f"outermost block) has cache_limit={region.cache_limit!r}; pass "
                        "cache_limit to the outermost block only"
                    )
                hooks = nested_block_hooks(region)  # See Note [Foreign saved-tensor hooks].
                if hooks is not None:
                    exits.enter_context(hooks)
            self._region = region
            region.policy_stack.push(region, self._policy)
            exits.callback(region.policy_stack.pop, region)
            self._exits = exits.pop_all()
        return region

    def __exit__(self, *exc: object) -> None:
        region = self._region
        assert region is not None
        changed = changed_globals(region) if self._opened else []
        self._exits.close()  # pop the policy, then the hooks, then close an opened region
        if changed and exc[0] is None:
            raise CkptGraphError(
                f"ckpt_graph: {', '.join(changed)} changed inside the region: its ops ran under "
                "two settings, and recompute can only use one (see Note [Replay globals]); "
                "change the setting before the `with save_recompute_policy(...)` block or after it"
            )


# Note [checkpoint as a drop-in for torch's]
# ``checkpoint`` takes the keyword arguments of ``torch.utils.checkpoint.checkpoint`` so that a
# call written for torch runs unchanged; they are never passed on to the user's function.
#   1. ``use_reentrant``, ``preserve_rng_state`` and ``early_stop`` select variants of torch's
#      replay. A region has one mechanism, which gives the gradients of a run without
#      checkpointing for every value of them: random ops are always replayed with the state
#      they drew from (See Note [RNG replay] in replay.py), and only what backward needs runs.
#      They are accepted and have no effect.
#   2. ``context_fn`` is torch's selective checkpointing: the pair of dispatch modes that
#      ``create_selective_checkpoint_contexts(policy_fn)`` returns. Its ``policy_fn`` is
#      pushed, adapted by ``policies.from_torch_sac``, as an inner policy of the region: the
#      same nesting as torch's SAC inside its checkpoint. Any other context pair cannot be
#      translated (the region records aten ops itself; torch's modes would run inside it) and
#      raises, naming the fix.
#   3. Under torch.compile the call is lowered to torch's checkpoint with a selective-
#      checkpoint policy that asks ``policy`` (and ``context_fn``'s ``policy_fn`` as the inner
#      one): See Note [Regions under torch.compile] in lowering.py.
#   4. ``determinism_check`` is ``"default"`` or ``"none"`` as in torch: the recompute replays
#      the recorded aten calls, so the metadata torch compares cannot differ. ``debug=True``
#      asks for more: each recomputed value is compared with the forward's
#      (``save_recompute_policy(debug=True)``).
# torch reads ``preserve_rng_state`` from ``**kwargs``; here it is a named keyword.


def checkpoint(
    fn: Callable[..., T],
    *args: Any,
    policy: Any = "recompute_all",
    use_reentrant: bool | None = None,
    context_fn: Callable[[], Any] | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> T:
    """Return ``fn(*args, **kwargs)`` computed inside a region with ``policy``.

    A drop-in for ``torch.utils.checkpoint.checkpoint``: its keyword arguments are accepted
    and translated, not passed to ``fn``. See Note [checkpoint as a drop-in for torch's].

    Args:
        fn: the function to run.
        *args: its positional arguments.
        policy: the region policy, as for :class:`save_recompute_policy`.
        use_reentrant: accepted for torch compatibility; no effect.
        context_fn: torch's ``functools.partial(create_selective_checkpoint_contexts,
            policy_fn)``: ``policy_fn`` becomes an inner policy of the region.
        determinism_check: ``"default"`` or ``"none"``, as in torch.
        debug: check each recomputed value against the forward's and name the first op that
            diverged.
        early_stop: accepted for torch compatibility; no effect.
        preserve_rng_state: accepted for torch compatibility; random ops are always replayed
            exactly.
        **kwargs: keyword arguments of ``fn``.

    Raises:
        CkptGraphError: ``context_fn`` does not come from
            ``create_selective_checkpoint_contexts``, or ``determinism_check`` is unknown.

    Example:
        >>> h = ckpt_graph.checkpoint(block, h)  # one region per block
        >>> h = ckpt_graph.checkpoint(block, h, use_reentrant=False)  # torch's call, unchanged
    """
    del (
        use_reentrant,
        early_stop,
        preserve_rng_state,
    )  # See Note [checkpoint as a drop-in for torch's]
    if determinism_check not in ("default", "none"):
        raise CkptGraphError(
            f"ckpt_graph: checkpoint(determinism_check={determinism_check!r}) is not a known "
            "value; pass 'default' or 'none' as for torch.utils.checkpoint, or debug=True to "
            "compare every recomputed value with the forward's"
        )
    if torch.compiler.is_compiling():  # See Note [Regions under torch.compile]
        if not runs_eagerly(policy):
            root = type(fn) if isinstance(fn, torch.nn.Module) else None
            return checkpoint_lowered(  # type: ignore[no-any-return]
                fn, args, kwargs, policy, inner=context_fn, root_cls=root, root_called=True
            )
        warnings.warn(
            f"ckpt_graph: checkpoint(policy={policy!r}) runs eagerly under torch.compile: the "
            "policy needs the region at run time (on_region_enter), so it cannot be lowered to "
            "torch's selective checkpointing; dynamo breaks the graph around the region",
            UserWarning,
            stacklevel=2,
        )
    inner = policy_from_context_fn(context_fn)
    with save_recompute_policy(policy, debug=debug):
        if inner is None:
            return fn(*args, **kwargs)
        with save_recompute_policy(inner):
            return fn(*args, **kwargs)


def tag_with_policy(tensor: torch.Tensor, policy: CheckpointPolicy | bool) -> torch.Tensor:
    """Decide for one value: keep it (``True``/``*_SAVE``) or recompute it.

    The tag overrides every op-level answer for the value ``tensor`` holds now (a view
    tags the view's value). A region input is always kept. Returns ``tensor``.

    Raises:
        CkptGraphTypeError: ``tensor`` is not a tensor, or ``policy`` neither a
            ``CheckpointPolicy`` nor a bool (also a ``TypeError``).
        CkptGraphError: outside a ``save_recompute_policy`` block.

    Example:
        >>> with ckpt_graph.save_recompute_policy("recompute_all"):
        ...     h = block(x)
        ...     ckpt_graph.tag_with_policy(h, True)  # keep the block output
    """
    if not isinstance(tensor, torch.Tensor):
        raise CkptGraphTypeError(
            f"ckpt_graph: tag_with_policy(tensor, policy) needs a torch.Tensor as `tensor`, got "
            f"{type(tensor).__name__}; pass the tensor whose value to keep or recompute"
        )
    if not isinstance(policy, (bool, CheckpointPolicy)):
        raise CkptGraphTypeError(
            "ckpt_graph: tag_with_policy(tensor, policy) needs a CheckpointPolicy or a bool as "
            f"`policy`, got {type(policy).__name__}"
        )
    region = current_region()
    if region is None or not region.recording.on:
        raise CkptGraphError(
            "ckpt_graph: tag_with_policy called outside a region; call it inside a "
            "`with ckpt_graph.save_recompute_policy(...)` block, on a tensor computed there"
        )
    region.settle()
    region.tag(tensor, policy)
    return tensor
