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
#      (``Handle.saved_refs``) or by recomputing an op node that takes it as input for a
#      saved tensor that needs a recomputed output of that node, directly or through other
#      recomputed values. While the region records, ``Handle.recompute_readers`` counts
#      such op nodes among ``h``'s readers: an op node with a recomputed output counts in
#      its inputs from the moment one of those outputs is *needed* (it has a saved tensor,
#      or a needed op node reads it) until none is (``need`` and ``unneed``, called when a
#      recomputed value gets its first saved tensor and loses its last one, and by the tag
#      that makes a needed kept value recomputed: ``Region.tag`` calls ``need`` while the
#      value is still kept, so that only the producer's other outputs can say it counts
#      already; called after, the tagged value said so itself, the producer's kept inputs
#      went uncounted and were freed when the program dropped them, and backward found
#      them released). A recomputed
#      op node whose outputs nothing saves (MobileNetV2's ReLU6 and residual adds under a
#      plan that keeps every saved value) is never counted: its kept inputs go once the
#      program dropped them and the values recomputed from them (rule 2). Before, any such
#      op node held its kept inputs to the region's exit (MobileNetV2 under
#      ``memory_budget(1.0)``: 1.01x no checkpointing's peak, recomputing nothing).
#   2. New readers come only through the forward tensor: an op that takes it, or a save of
#      it. Once the program dropped that tensor (its last Python reference and every view
#      of it, which refers to it as ``_base``), nothing new reads ``h`` directly. A
#      recomputed value computed from ``h`` may still be saved later: the program holds
#      ``y = r + view(h)`` after dropping ``h`` and a LayerNorm saves ``y`` next (a
#      residual stream under ``save_matmuls``). So ``h`` also stays while the program holds
#      a tensor of a value recomputed from it, through recomputed values only
#      (``_live_descendant``, scanned when its tensor goes; a weak reference to that tensor
#      looks again when it goes), and no longer: MobileNetV2's residual sums, which nothing
#      saves, let the kept block outputs go when the program drops the stage's last sum.
#      Freeing it earlier made the engine keep ``y`` instead of the plan's ``h`` (the plan
#      and its simulation then disagreed). Such a held ``y`` only needs ``h`` if something
#      saves it (or a value recomputed from it) later, and then the pack hook has ``y``'s
#      tensor: it can keep ``y`` itself, what eager saves. So ``y`` holds ``h`` only while
#      that is worth it (``_worth_holding``): every kept value ``y``'s recomputation reads
#      is ``intact`` (else ``need`` fails and a save keeps ``y`` anyway), and those that
#      only such a recomputation can read (tensor gone, no saved tensor or needed
#      recomputation) total no more bytes than keeping ``y`` (its base's, for a view)
#      would hold; when ``h`` goes, so do the others held for a live value not worth them
#      (``_free``). A plan keeps values only for a later save of ``y`` only if they total
#      no more than ``y`` (keeping ``y`` would cost fewer bytes and no recompute), so plans
#      are still followed (test_budget: the kept ops and recomputations are the plan's). A
#      chain of residual sums that nothing saves (``h = h + f(h)``, ``f``'s kept output
#      read only by the sum) reads a second such value one layer on, and lets them go as
#      eager does (8 layers under ``save_ops(mm, constant_pad_nd)``: 311,368 -> 213,056
#      bytes, no checkpointing's peak). A kept value overwritten in place without a copy
#      (rule 4) can still be read that way: ``need`` walks the recomputed values that a
#      save newly needs, and if one of the kept values they read is not ``intact``, it
#      changes nothing and the pack hook keeps the saved value itself, the tensor autograd
#      saves (reason ``SAVED_AFTER_INPUTS_FREED``): no more than eager holds for it.
#      ``rebase`` (Note [Mutation and views], rule 3) views the last write to a storage
#      without its tensor: that value stays while a tensor written there is alive
#      (``_rebase_may_read``; its memory is that tensor's anyway), and ``rebase`` takes a
#      snapshot of the live alias instead if it was freed. A tag that asks to recompute a
#      value whose recomputation reads freed kept values makes those recomputed too
#      (``freed_inputs``); if one cannot be recomputed (an engine keep, a region input),
#      the tagged value stays kept (reason ``INPUTS_FREED``).
#   3. So while the region records, each kept op output is *watched*: a weak reference to
#      its forward tensor whose callback frees the value (``Handle.value = None``, the
#      reason stays, as in Note [Releasing kept values]) when rules 1 and 2 find no reader. A
#      saved tensor freed during the forward (a graph dropped inside the region) frees its
#      value likewise once the tensor is gone and nothing else reads it (``Packed.__del__``
#      through ``drop_if_unread``), and the last saved tensor of a recomputed value lets go
#      of the op nodes only it needed (``unneed``), which frees the kept values they read
#      whose tensors are gone.
#   4. Before an in-place op writes over a kept value, the same test decides whether the
#      old value needs a copy (Note [Mutation and views], rule 4): a value that no saved
#      tensor and no needed recomputation reads is overwritten as is, even when kept op
#      outputs were computed from it (those ops never run again), or recomputed ones no
#      saved tensor needs yet (rule 2 keeps them if one is saved later). A silent write
#      (BatchNorm's running statistics, Note [Silent writes]) needs a copy for every
#      recomputed op node that read the value before (``Handle.recompute_input``, which is
#      never cleared): nothing marks such a value as changed, so rule 2 could not see it.
#   5. At the region's exit the watch ends; ``count_live_uses`` (Note [Releasing kept
#      values]) frees the kept values that nothing reads from then on, and autograd's
#      releases free the rest (``pass_graph.free_use`` follows the same chains as rule 1:
#      a kept value goes after the last saved tensor whose recomputation reads it).
#   6. The counts matter only once a value they protect can go: a kept op output (rule 3)
#      or a kept value an in-place op writes over (rule 4), or a tag reads them. Until then
#      (``RecordingState.counting`` off: a region that recomputes everything, or keeps only
#      its inputs so far) the pack hook calls no ``need`` and a freed saved tensor no
#      ``unneed``; the first kept op output (``watch``), in-place op or tag calls
#      ``count_readers``, which replays ``need`` for the values saved tensors refer to now,
#      in the order of their first saves, each looking unsaved until its turn, so the counts
#      are those the pack hook would have made. Nothing was freed or overwritten before, so
#      every walk succeeds. On the 1,500-op chain of ``bench_overhead_instructions.py``
#      under ``recompute_all`` this saves the walk at each of its 500 first saves.
# So a region holds, during its forward, what eager holds (the program's tensors and the
# saved ones), plus the aliases' metadata, the kept values saved tensors need through
# recomputed ones, and those the program's tensors were recomputed from (no more bytes than
# those tensors, rule 2); in backward it frees kept values as autograd frees saved tensors.
# ``kept_bytes`` still counts what the policies decided to keep (budgets compare plans by
# it), not what is held now; a value kept by rule 2 adds its bytes.
# Known limitations: a kept value stays while the program holds a value recomputed from
# it that is worth holding it for (rule 2), also when nothing will save that value: no
# more bytes than that value's for each such value the program holds (one layer of a
# residual chain). A plan that keeps values for several later saves, worth it only
# together, is not followed: each saved value is kept itself. Values kept in host memory
# (offload on CUDA) are not watched: their copies are freed at the exit.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ckpt_graph._errors import CkptGraphError

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.mutation.storage_history import StorageHistory
    from ckpt_graph.engine.region import Region

__all__ = [
    "count_readers",
    "drop_if_unread",
    "freed_inputs",
    "intact",
    "mark_recompute_inputs",
    "may_read",
    "need",
    "unneed",
    "watch",
]


class _KeptRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a kept value's forward tensor that knows the value's handle, the
    region's write histories (``RecordingState.storages``) and op nodes.

    Only the region's recording state refers to it (``RecordingState.watched``), so it adds
    no reference cycle and stops watching when the region closes. ``later`` holds the
    reference to a tensor of a value recomputed from the kept one, still alive when the
    kept value's tensor went (rule 2), and so on.
    """

    __slots__ = ("handle", "later", "nodes", "storages")
    handle: Handle
    later: _KeptRef
    nodes: list[OpNode]
    storages: dict[int, StorageHistory]


def may_read(h: Handle) -> bool:
    """Whether the region may read ``h``'s kept value again, by what refers to it now.

    See Note [Kept values live no longer than in eager], rule 1.
    """
    return h.saved_refs > 0 or h.recompute_readers > 0


def intact(h: Handle) -> bool:
    """Whether the kept value of ``h`` still holds what the op computed: not freed, and not
    changed in place without a copy (a write through another alias supersedes it).

    See Note [Kept values live no longer than in eager], rule 2.
    """
    return h.value is not None and (h.copied or not h.superseded)


def _needed(h: Handle) -> bool:
    """Whether a saved tensor needs the recomputed value ``h``, directly or through other
    recomputed values. See Note [Kept values live no longer than in eager], rule 1."""
    return h.saved_refs > 0 or h.recompute_readers > 0


def _live(node: OpNode) -> bool:
    """Whether some recomputed output of ``node`` is needed: it counts in its inputs'
    ``recompute_readers``."""
    for o in node.outputs:
        if o is not None and o.reason is None and (o.saved_refs > 0 or o.recompute_readers > 0):
            return True
    return False


def need(region: Region, h: Handle) -> bool:
    """A saved tensor is about to need the recomputed value ``h``, which nothing needed (or
    a tag is about to make the needed kept value ``h`` recomputed: ``h`` is still kept):
    count the op nodes its recomputation newly runs in their inputs' ``recompute_readers``.

    Returns:
        ``False``, changing nothing, when one of the kept values those op nodes read is not
        ``intact``: the caller keeps ``h`` instead. See Note [Kept values live no longer
        than in eager], rule 2.
    """
    p = h.node_index
    if p < 0:
        return False
    nodes = region.nodes
    node = nodes[p]
    # An op node whose only output is a value nothing needs is not live (``_live``): the
    # common case (the pack hook asks for ``h`` only then), decided without the call.
    # Likewise for the producers below, reached through such a value.
    if (len(node.outputs) > 1 or h.saved_refs > 0 or h.recompute_readers > 0) and _live(node):
        return True  # an output is needed already
    # A walk over the op nodes nothing needed yet; those already needed read only intact
    # values (rule 1 keeps them), so it stops there. ``newly`` grows while it is iterated.
    # Each input is counted as it is visited (undone if the walk fails), so a value reached
    # again looks needed and its producer is not walked twice; op nodes with several
    # outputs, reached through any of them, are remembered in ``seen``.
    newly = [node]
    seen = {p} if len(node.outputs) > 1 else None
    for node in newly:
        for i in node.inputs:
            if i.reason is not None:
                if i.value is None or (i.superseded and not i.copied):  # not ``intact``
                    _uncount(newly, node, i)
                    return False
            elif i.saved_refs == 0 and i.recompute_readers == 0:
                q = i.node_index
                if q < 0:
                    _uncount(newly, node, i)
                    return False
                producer = nodes[q]
                if len(producer.outputs) == 1:
                    newly.append(producer)
                elif seen is None:
                    seen = {q}
                    if not _live(producer):
                        newly.append(producer)
                elif q not in seen:
                    seen.add(q)
                    if not _live(producer):
                        newly.append(producer)
            i.recompute_readers += 1
    return True


def _uncount(newly: list[OpNode], node: OpNode, stop: Handle) -> None:
    """Undo ``need``'s counts, made in walk order, up to input ``stop`` of ``node``."""
    for n in newly:
        for i in n.inputs:
            if n is node and i is stop:
                return
            i.recompute_readers -= 1


def unneed(region: Region, h: Handle) -> None:
    """No saved tensor needs ``h`` any more (its last one was freed, or it is kept now):
    its producer leaves its inputs' ``recompute_readers`` unless another of its recomputed
    outputs is needed, and so on up; kept values nothing reads then are freed if the
    program dropped them. See Note [Kept values live no longer than in eager], rule 3."""
    nodes = region.nodes
    stack = [h]
    while stack:
        v = stack.pop()
        if v.node_index < 0:
            continue
        node = nodes[v.node_index]
        if _live(node):
            continue
        for i in node.inputs:
            i.recompute_readers -= 1
            if i.recompute_readers == 0 and i.saved_refs == 0:
                if i.reason is None:
                    stack.append(i)
                else:
                    drop_if_unread(region, i)


def count_readers(region: Region) -> None:
    """Start keeping ``Handle.recompute_readers`` up to date, if not yet: count what the
    region's saved tensors need now, as ``need`` would have at each first save. See Note
    [Kept values live no longer than in eager], rule 6."""
    recording = region.recording
    if recording.counting:
        return
    recording.counting = True
    # Replayed in the order of first saves, each value looking unsaved until its turn (as
    # when the pack hook called ``need``); no garbage collection meanwhile, whose freeing
    # of a saved tensor (``Packed.__del__``) would count against a hidden ``saved_refs``.
    pending = [h for h in dict.fromkeys(region.saved_log.handles) if h.reason is None]
    refs = [h.saved_refs for h in pending]
    collecting = gc.isenabled()
    gc.disable()
    try:
        for h in pending:
            h.saved_refs = 0
        for h, n in zip(pending, refs, strict=True):
            if n > 0 and h.recompute_readers == 0 and not need(region, h):
                raise CkptGraphError(  # nothing was freed or overwritten before this call
                    f"ckpt_graph: internal error: counting the readers of {h!r} found a "
                    "freed kept value; please report this with the program that triggers it"
                )
            h.saved_refs = n
    finally:
        for h, n in zip(pending, refs, strict=True):
            h.saved_refs = n
        if collecting:
            gc.enable()


def watch(region: Region, h: Handle, t: torch.Tensor) -> None:
    """Free the kept value of ``h`` when the program drops ``t``, its forward tensor, if
    nothing reads it then. See Note [Kept values live no longer than in eager], rule 3."""
    recording = region.recording
    if not recording.counting:
        count_readers(region)
    r = _KeptRef(t, _forward_tensor_dropped)
    r.handle = h
    r.storages = recording.storages
    r.nodes = region.nodes
    recording.watched.append(r)


def _forward_tensor_dropped(r: weakref.ref[torch.Tensor]) -> None:
    h: Handle = r.handle  # type: ignore[attr-defined]
    if not may_read(h) and h.offload_device is None and not _rebase_may_read(r.storages, h):  # type: ignore[attr-defined]
        unheld: list[Handle] = []
        later = _watch_descendant(h, r.nodes, r.storages, unheld)  # type: ignore[attr-defined]
        if later is None:
            _free(h, unheld, r.nodes, r.storages)  # type: ignore[attr-defined]
        else:
            r.later = later  # type: ignore[attr-defined]


def _free(
    h: Handle, unheld: list[Handle], nodes: list[OpNode], storages: dict[int, StorageHistory]
) -> None:
    """Free the kept value of ``h``, then those ``unheld``: held for live values that were
    not worth holding ``h`` for (``_worth_holding``), and that no other live value holds
    now. See Note [Kept values live no longer than in eager], rule 2."""
    h.value = None
    for i in unheld:
        if (
            i.value is not None
            and i.offload_device is None
            and not may_read(i)
            and (i.ref is None or i.ref() is None)
            and not _rebase_may_read(storages, i)
            and _live_descendant(i, nodes, None) is None
        ):
            i.value = None


def _watch_descendant(
    h: Handle,
    nodes: list[OpNode],
    storages: dict[int, StorageHistory],
    unheld: list[Handle],
) -> _KeptRef | None:
    """A weak reference that looks at ``h`` again when it goes, to a tensor the program
    holds of a value recomputed from ``h``, if there is one (``unheld``: see
    ``_live_descendant``). See Note [Kept values live no longer than in eager], rule 2."""
    t = _live_descendant(h, nodes, unheld)
    if t is None:
        return None
    r = _KeptRef(t, _descendant_dropped)
    r.handle = h
    r.storages = storages
    r.nodes = nodes
    return r


def _live_descendant(
    h: Handle, nodes: list[OpNode], unheld: list[Handle] | None
) -> torch.Tensor | None:
    """A tensor the program still holds of a value recomputed from ``h`` (through recomputed
    values only) that is worth holding ``h`` for (``_worth_holding``), or ``None``; the kept
    values held for the live values that were not go to ``unheld``.

    Op nodes recorded after ``h``'s producer, scanned when its tensor goes and again when
    that descendant goes: a kept value whose tensor lives long (a skip connection) costs a
    scan of the nodes since.
    """
    if not h.recompute_input:
        return None
    sources = {h.number}
    for node in itertools.islice(nodes, h.node_index + 1, None):
        for i in node.inputs:
            if i.number in sources:
                break
        else:
            continue
        for o in node.outputs:
            if o is not None and o.reason is None:
                t = o.ref() if o.ref is not None else None
                if t is not None and _worth_holding(o, nodes, unheld):
                    return t
                sources.add(o.number)
    return None


def _worth_holding(y: Handle, nodes: list[OpNode], unheld: list[Handle] | None) -> bool:
    """Whether the kept values that recomputing the live value ``y`` would read, and that
    nothing but such a recomputation can read any more, are worth holding for ``y``: all
    ``intact`` (else a save of ``y`` keeps ``y`` itself anyway, ``need`` fails) and no more
    bytes than keeping ``y`` would hold. If not, the kept values it found held for ``y``
    go to ``unheld``. See Note [Kept values live no longer than in eager], rule 2.
    """
    base = y
    while base.base is not None:
        base = base.base
    budget = base.nbytes  # keeping a view keeps its base's storage
    held = 0
    found: list[Handle] = []
    seen: set[int] = set()
    stack = [y]
    while stack:
        v = stack.pop()
        if v.node_index < 0:
            continue
        for i in nodes[v.node_index].inputs:
            if i.number in seen:
                continue
            seen.add(i.number)
            if i.reason is None:
                if i.saved_refs == 0 and i.recompute_readers == 0:
                    stack.append(i)  # needed values read only intact ones (rule 1)
            elif i.value is None or (i.superseded and not i.copied):  # not ``intact``
                if unheld is not None:
                    unheld += found
                return False
            elif (
                i.node_index >= 0
                and i.offload_device is None
                and not may_read(i)
                and (i.ref is None or i.ref() is None)
            ):
                held += i.nbytes
                found.append(i)
                if held > budget:
                    if unheld is not None:
                        unheld += found
                    return False
    return True


def _descendant_dropped(r: weakref.ref[torch.Tensor]) -> None:
    """The program dropped a tensor of a value recomputed from a kept value whose own tensor
    went before: free the value if nothing else may read it now."""
    h: Handle = r.handle  # type: ignore[attr-defined]
    if h.value is None or may_read(h) or _rebase_may_read(r.storages, h):  # type: ignore[attr-defined]
        return
    unheld: list[Handle] = []
    later = _watch_descendant(h, r.nodes, r.storages, unheld)  # type: ignore[attr-defined]
    if later is None:
        _free(h, unheld, r.nodes, r.storages)  # type: ignore[attr-defined]
    else:
        r.later = later  # type: ignore[attr-defined]


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
    """Free the kept value of an op output that nothing reads any more (its last saved
    tensor or needed recomputation went during the forward), if its tensor is gone. See
    Note [Kept values live no longer than in eager], rule 3."""
    if (
        h.value is not None
        and h.node_index >= 0
        and h.offload_device is None
        and not may_read(h)
        and (h.ref is None or h.ref() is None)
    ):
        recording = region.recording
        if _rebase_may_read(recording.storages, h):
            return
        unheld: list[Handle] = []
        later = _watch_descendant(h, region.nodes, recording.storages, unheld)
        if later is None:
            _free(h, unheld, region.nodes, recording.storages)
        else:
            recording.watched.append(later)


def freed_inputs(region: Region, node: OpNode) -> list[Handle] | None:
    """The kept values that recomputing ``node`` would read and that are no longer
    ``intact``, with those their producers would read, in turn (through recomputed values
    that nothing needs yet: those needed read only intact values); ``None`` when one of
    them cannot be recomputed (a region input, a value the engine keeps for correctness, a
    host copy).

    A tag that asks to recompute an op output makes these recomputed values first. See
    Note [Kept values live no longer than in eager], rule 2.
    """
    freed: list[Handle] = []
    seen: set[int] = set()
    stack = [node]
    while stack:
        for i in stack.pop().inputs:
            if id(i) in seen:
                continue
            if i.reason is None:
                if _needed(i):
                    continue
                seen.add(id(i))
            else:
                if intact(i):
                    continue
                if i.node_index < 0 or i.reason.by_engine or i.offload_device is not None:
                    return None
                seen.add(id(i))
                freed.append(i)
            stack.append(region.nodes[i.node_index])
    return freed


def mark_recompute_inputs(inputs: Iterable[Handle]) -> None:
    """The inputs of an op node with a recomputed output: recomputing may read them (the
    flag a silent write asks, Note [Kept values live no longer than in eager], rule 4).
    """
    for h in inputs:
        h.recompute_input = True
