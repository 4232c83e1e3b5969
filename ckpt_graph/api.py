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

    Example:
        >>> with ckpt_graph.save_recompute_policy("recompute_all"):
        ...     loss = model(x).sum()
        >>> loss.backward()  # activations are recomputed on demand
    """

    def __init__(self, policy: Any = "recompute_all", *, debug: bool = False) -> None:
        self._policy = normalize_policy(policy)
        self._debug = debug
        self._region: Region | None = None
        self._opened = False
        self._hooks: Any = None

    def __enter__(self) -> Region:
        if self._region is not None:
            raise RuntimeError("ckpt_graph: a save_recompute_policy block cannot be entered twice")
        region = current_region()
        if region is None:
            region = Region(debug=self._debug)
            region._open_region()
            self._opened = True
        else:
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
        changed = region._changed_globals() if self._opened else []
        try:
            region._pop()
        finally:
            self._leave(region)
        if changed and exc[0] is None:
            raise CkptGraphError(
                f"ckpt_graph: {', '.join(changed)} changed inside the region: its ops ran under "
                "two settings, and recompute can only use one (see Note [Replay globals]); "
                "change the setting before the `with save_recompute_policy(...)` block or after it"
            )

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
