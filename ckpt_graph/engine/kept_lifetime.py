"""Kept values the region can no longer read: freed when eager would free them.

# Note [Kept values live no longer than in eager]
# A policy (or a tag, or the engine) decides to keep an op output when the op runs, before
# anything saves it. Autograd may never save it: BatchNorm's output feeding a ReLU that is
# not in place (the norm saves its input, the ReLU its own output), GELU's temporaries, a
# value only summed. Eager frees such a value as soon as the program drops its tensor; a
# region that held it until its exit peaked above no checkpointing while keeping *every*
# value (1.30x on transformers' ResNet, where each block holds its norms' outputs through
# the rest of the forward). So a kept value never outlives what reads it:
#   1. The region reads a kept value ``h`` again only through a saved tensor of it
#      (``Handle.saved_refs``) or by recomputing an op node that takes it as input and has a
#      recomputed output (``Handle.recompute_input``, set when such an op node is decided:
#      ``mark_recompute_inputs``; conservatively for the whole node, and whether or not the
#      recomputed output will ever be needed).
#   2. New readers come only through the forward tensor: an op that takes it, or a save of
#      it. Once the program dropped that tensor (its last Python reference and every view
#      of it, which refers to it as ``_base``), nothing new reads ``h``, with two
#      exceptions. ``rebase`` (Note [Mutation and views], rule 3) views the last write to a
#      storage without its tensor: that value stays while a tensor written there is alive
#      (``_rebase_may_read``; its memory is that tensor's anyway), and ``rebase`` takes a
#      snapshot of the live alias instead if it was freed. A tag that asks to recompute a
#      value whose recomputation reads freed kept values makes those recomputed too
#      (``freed_inputs``); if one cannot be recomputed (an engine keep, a region input),
#      the tagged value stays kept (reason ``INPUTS_FREED``).
#   3. So while the region records, each kept op output is *watched*: a weak reference to
#      its forward tensor whose callback frees the value (``Handle.value = None``, the
#      reason stays, as in Note [Releasing kept values]) when rule 1 finds no reader. A
#      saved tensor freed during the forward (a graph dropped inside the region) frees its
#      value likewise once the tensor is gone and nothing else reads it (``Packed.__del__``).
#   4. Before an in-place op writes over a kept value, the same test decides whether the
#      old value needs a copy (Note [Mutation and views], rule 4): a value that no saved
#      tensor and no recomputation reads is overwritten as is, even when kept op outputs
#      were computed from it (those ops never run again). A silent write (BatchNorm's
#      running statistics, Note [Silent writes]) needs a copy only for recomputations:
#      saved tensors of the argument read the new value, as eager's do.
#   5. At the region's exit the watch ends; ``count_live_uses`` (Note [Releasing kept
#      values]) frees the kept values that nothing reads from then on, and autograd's
#      releases free the rest.
# So a region that keeps every value holds, during its forward, what eager holds (the
# program's tensors and the saved ones), plus the aliases' metadata; in backward it frees
# kept values as autograd frees saved tensors. ``kept_bytes`` still counts what the policies
# decided to keep (budgets compare plans by it), not what is held now.
# Known limitations: rule 1 is conservative for values read by recomputed op nodes whose
# outputs nothing will need; those stay until the region's exit, as before. Values kept in
# host memory (offload on CUDA) are not watched: their copies are freed at the exit.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.mutation.storage_history import StorageHistory
    from ckpt_graph.engine.region import Region

__all__ = [
    "drop_if_unread",
    "freed_inputs",
    "mark_recompute_inputs",
    "may_read",
    "watch",
]


class _KeptRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a kept value's forward tensor that knows the value's handle and
    the region's write histories (``RecordingState.storages``).

    Only the region's recording state refers to it (``RecordingState.watched``), so it adds
    no reference cycle and stops watching when the region closes.
    """

    __slots__ = ("handle", "storages")
    handle: Handle
    storages: dict[int, StorageHistory]


def may_read(h: Handle) -> bool:
    """Whether the region may read ``h``'s kept value again, by what refers to it now.

    See Note [Kept values live no longer than in eager], rule 1.
    """
    return h.saved_refs > 0 or h.recompute_input


def watch(region: Region, h: Handle, t: torch.Tensor) -> None:
    """Free the kept value of ``h`` when the program drops ``t``, its forward tensor, if
    nothing reads it then. See Note [Kept values live no longer than in eager], rule 3."""
    recording = region.recording
    r = _KeptRef(t, _forward_tensor_dropped)
    r.handle = h
    r.storages = recording.storages
    recording.watched.append(r)


def _forward_tensor_dropped(r: weakref.ref[torch.Tensor]) -> None:
    h: Handle = r.handle  # type: ignore[attr-defined]
    if not may_read(h) and h.offload_device is None and not _rebase_may_read(r.storages, h):  # type: ignore[attr-defined]
        h.value = None


def _rebase_may_read(storages: dict[int, StorageHistory], h: Handle) -> bool:
    """Whether ``rebase`` may still view ``h``: it is the last write to a storage and a
    tensor written there is alive. See Note [Kept values live no longer than in eager],
    rule 2."""
    v = h.value
    if not storages or v is None:
        return False
    # A weakref callback runs wherever the program drops a tensor, e.g. under a torch
    # function mode that logs calls (DebugMode renders every storage it sees, element by
    # element): ask for the storage below torch function.
    with torch._C.DisableTorchFunction():
        key = v.untyped_storage().data_ptr()
    history = storages.get(key)
    if history is None or history.head is not h:
        return False
    return any(root.ref is not None and root.ref() is not None for root in history.roots)


def drop_if_unread(region: Region, h: Handle) -> None:
    """Free the kept value of an op output whose last saved tensor autograd released during
    the forward, if its tensor is gone and nothing else reads it. See Note [Kept values
    live no longer than in eager], rule 3."""
    if (
        h.value is not None
        and h.node_index >= 0
        and h.offload_device is None
        and not may_read(h)
        and (h.ref is None or h.ref() is None)
        and not _rebase_may_read(region.recording.storages, h)
    ):
        h.value = None


def freed_inputs(region: Region, node: OpNode) -> list[Handle] | None:
    """The kept values that recomputing ``node`` would read and that were freed, with those
    their producers would read, in turn; ``None`` when one of them cannot be recomputed (a
    region input, a value the engine keeps for correctness, a host copy).

    A tag that asks to recompute an op output makes these recomputed values first. See
    Note [Kept values live no longer than in eager], rule 2.
    """
    freed: list[Handle] = []
    seen: set[int] = set()
    stack = [node]
    while stack:
        for i in stack.pop().inputs:
            if i.reason is None or i.value is not None or id(i) in seen:
                continue
            if i.node_index < 0 or i.reason.by_engine or i.offload_device is not None:
                return None
            seen.add(id(i))
            freed.append(i)
            stack.append(region.nodes[i.node_index])
    return freed


def mark_recompute_inputs(inputs: Iterable[Handle]) -> None:
    """The inputs of an op node with a recomputed output: recomputing may read them.

    See Note [Kept values live no longer than in eager], rule 1.
    """
    for h in inputs:
        h.recompute_input = True
