"""The public entry points: ``save_recompute_policy``, ``checkpoint``, ``tag_with_policy``.

Example:
    >>> import ckpt_graph
    >>> with ckpt_graph.save_recompute_policy("recompute_all") as region:
    ...     loss = model(x).sum()
    >>> loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ._errors import CkptGraphError
from .cache_bound import parse_cache_limit
from .policies._core import normalize_policy
from .region import Region, current_region

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
        policy: ``"recompute_all"`` (default), ``"must_save_all"``, or a callable
            ``policy(ctx, out, op, *args, **kwargs) -> CheckpointPolicy | bool | None``.
        debug: check each recomputed value against the forward's and name the first op
            that diverged (only honoured by the block that opens the region).
        cache_limit: how many bytes of recomputed values backward may hold cached at once
            (set by the block that opens the region; a nested block may only repeat it).
            ``None`` (default) bounds automatically: when one realize would cache much of
            the forward (one region over a whole model), values are cached in segments of
            about ``sqrt(bytes x frontier)`` and recomputed again from sparse checkpoints,
            at most two forwards of recompute in all (Chen et al. 2016). An int or a string
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
        self._hooks: Any = None

    def __enter__(self) -> Region:
        if self._region is not None:
            raise RuntimeError("ckpt_graph: a save_recompute_policy block cannot be entered twice")
        region = current_region()
        if region is None:
            region = Region(debug=self._debug, cache_limit=self._cache_limit)
            region._open_region()
            self._opened = True
        else:
            if self._cache_limit is not None and self._cache_limit != region.cache_limit:
                raise CkptGraphError(
                    f"ckpt_graph: a nested save_recompute_policy block asks for cache_limit="
                    f"{self._cache_limit!r}, but its region (opened by the outermost block) "
                    f"has cache_limit={region.cache_limit!r}; pass cache_limit to the "
                    "outermost block only"
                )
            # See Note [Foreign saved-tensor hooks].
            self._hooks = region._hooks_for_nested_block()
            if self._hooks is not None:
                self._hooks.__enter__()
        self._region = region
        try:
            region._push(self._policy)
        except BaseException:
            self._leave(region)
            raise
        return region

    def __exit__(self, *exc: object) -> None:
        region = self._region
        assert region is not None
        try:
            region._pop()
        finally:
            self._leave(region)

    def _leave(self, region: Region) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        if self._opened:
            region._close_region()


def checkpoint(fn: Callable[..., T], *args: Any, policy: Any = "recompute_all", **kwargs: Any) -> T:
    """Return ``fn(*args, **kwargs)`` computed inside a region with ``policy``.

    Example:
        >>> h = ckpt_graph.checkpoint(block, h)  # one region per block
    """
    with save_recompute_policy(policy):
        return fn(*args, **kwargs)


def tag_with_policy(tensor: torch.Tensor, policy: CheckpointPolicy | bool) -> torch.Tensor:
    """Decide for one value: keep it (``True``/``*_SAVE``) or recompute it.

    The tag overrides every op-level answer for the value ``tensor`` holds now (a view
    tags the view's value). A region input is always kept. Returns ``tensor``.

    Raises:
        CkptGraphError: outside a ``save_recompute_policy`` block.

    Example:
        >>> with ckpt_graph.save_recompute_policy("recompute_all"):
        ...     h = block(x)
        ...     ckpt_graph.tag_with_policy(h, True)  # keep the block output
    """
    region = current_region()
    if region is None or not region._recording:
        raise CkptGraphError(
            "ckpt_graph: tag_with_policy called outside a region; call it inside a "
            "`with ckpt_graph.save_recompute_policy(...)` block, on a tensor computed there"
        )
    region._settle()
    region.tag(tensor, policy)
    return tensor
