"""An op node's outputs: their handles (fresh values, views, new versions of written
arguments) and what the region keeps of them (``decide``).

The last two steps of Note [One recording path] (``record.py``).
"""

from __future__ import annotations

import traceback
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph.engine import graph
from ckpt_graph.engine.debug import checksums
from ckpt_graph.engine.graph import Handle, OpNode
from ckpt_graph.engine.holding import hold, hold_new_version
from ckpt_graph.engine.mutation.storage_history import after_write
from ckpt_graph.engine.mutation.writes import mark_written
from ckpt_graph.engine.op_info import OpInfo

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["KEPT_ON_HOST", "decide", "record_node"]

_Tensor = torch.Tensor

# Decisions that keep a value (the keys), and whether each keeps it in host memory.
KEPT_ON_HOST = {
    CheckpointPolicy.MUST_SAVE: False,
    CheckpointPolicy.PREFER_SAVE: False,
    CheckpointPolicy.MUST_CPU_OFFLOAD: True,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: True,
}
_KEEP_IDS = frozenset(id(d) for d in KEPT_ON_HOST)  # for every op: Enum.__hash__ is Python code
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
_new_handle = weakref.ref.__new__
_new_object = object.__new__
_POLICY = graph.POLICY


def record_node(
    region: Region,
    op: Any,
    info: OpInfo,
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
    inputs: tuple[Handle, ...],
    out: Any,
    rng: tuple[torch.Generator, torch.Tensor] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> OpNode:
    """Append the op node of one call, with a handle per tensor output, numbered (see Note
    [Values numbered as recorded])."""
    nodes = region.nodes
    index = len(nodes)
    # A constant policy stack decides every op alike; ``decide`` asks callable ones.
    stack = region.policy_stack
    decision = stack.constant
    if decision is _RECOMPUTE or decision is _MUST_RECOMPUTE:  # ``decide`` may not run
        for h in inputs:  # See Note [Kept values live no longer than in eager], rule 1.
            h.forward_uses += 1
            h.recompute_input = True
    else:
        for h in inputs:
            h.forward_uses += 1
    previous: Handle | None = None
    if info.writes:
        previous = mark_written(region, info, h_args, h_kwargs, args, kwargs)
    recording = region.recording
    values = region.pass_state.handles  # See Note [Values numbered as recorded].
    if isinstance(out, _Tensor):
        v = len(values)
        h = _new_handle(Handle, out)  # See Note [Objects made per op], rule 4.
        h.node_index = index
        h.number = v
        h.output_index = 0
        h.input_index = -1
        try:  # version_of(), inlined
            h.version = out._version
        except RuntimeError:
            h.version = 0
        h.unlinked = False
        h.shape = out.shape
        h.dtype = out.dtype
        h.nbytes = out.nbytes
        h.value = None
        h.reason = None
        h.copied = False
        h.offload_device = None
        h.stride = None
        h.device = None
        h.storage = 0
        h.storage_offset = 0
        h.is_view = False
        h.base = None
        h.base_writes = 0
        h.writes = 0
        h.has_views = False
        h.superseded = False
        h.forward_uses = 0
        h.recompute_input = False
        h.recompute_readers = 0
        h.saved_refs = 0
        h.cache = None
        h.live = False
        values.append(h)
        if info.aliases:
            _alias_output(region, info, h, inputs, previous)
        recording.ids[id(out)] = h
        outputs: tuple[Handle | None, ...] = (h,)
        shape = h.shape
        try:  # noqa: SIM105 (``suppress`` would make an object per output)
            h.shape = recording.shapes.setdefault(shape, shape)
        except TypeError:  # symbolic sizes are not hashable: no sharing
            pass
    else:
        outputs = _tuple_outputs(region, info, inputs, out, index, previous)
        v = -1
    if rng is not None:
        recording.random_nodes.append(index)
    modules = region.module_stack
    node = _new_object(OpNode)  # See Note [Objects made per op], rule 4.
    node.index = index
    node.op = op
    node.info = info
    node.args = h_args
    node.kwargs = h_kwargs
    node.inputs = inputs
    node.outputs = outputs
    node.decision = decision
    node.decided_by = stack.constant_by
    node.module_path = modules.current_path
    node.module_call = modules.current_call
    node.rng = rng
    node.out_is_tuple = v < 0
    node.flops = -1
    node.stack = None
    node.checksums = None
    node.realized = 0
    node.pass_id = -1
    if info.writes and recording.writing is not None:  # See Note [Mutation and views], rule 3.
        after_write(region, outputs[0] if len(outputs) == 1 else None)
    if region.debug:
        node.stack = "".join(traceback.format_stack(limit=14)[:-4])
        node.checksums = checksums(out if v < 0 else (out,))
    nodes.append(node)
    return node


def _tuple_outputs(
    region: Region,
    info: OpInfo,
    inputs: tuple[Handle, ...],
    out: tuple[Any, ...] | list[Any],
    index: int,
    previous: Handle | None,
) -> tuple[Handle | None, ...]:
    """The handles of an op that returned a tuple or list (``None`` for non-tensors)."""
    recording = region.recording
    values = region.pass_state.handles
    handles: list[Handle | None] = []
    for j, o in enumerate(out):
        if not isinstance(o, _Tensor):
            handles.append(None)
            continue
        h = Handle(o, index, j, len(values))
        values.append(h)
        if info.aliases:  # a list return: every element
            _alias_output(region, info, h, inputs, previous)
        recording.ids[id(o)] = h
        handles.append(h)
        shape = h.shape
        try:  # noqa: SIM105
            h.shape = recording.shapes.setdefault(shape, shape)
        except TypeError:
            pass
    return tuple(handles)


def _alias_output(
    region: Region, info: OpInfo, h: Handle, inputs: tuple[Handle, ...], previous: Handle | None
) -> None:
    """Set up the output handle of an in-place or view op. See Note [Mutation and views]."""
    h.version = -1  # rule 5: autograd sets the version after the recorder returns
    region.recording.unsettled.append(h)
    if info.returns_written:
        if previous is not None:  # rule 6
            h.is_view, h.has_views = previous.is_view, previous.has_views
            h.base = previous.base
            if h.base is not None:
                h.base_writes = h.base.writes
    elif inputs:
        h.is_view = True
        b = inputs[0]
        b.has_views = True
        h.base = b.base or b
        h.base_writes = h.base.writes
    else:
        h.is_view = True


def decide(
    region: Region,
    node: OpNode,
    out: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    overwritten: Handle | None,
) -> None:
    """Settle what the region keeps of one op node's outputs.

    The node carries its stack's constant decision already (``record_node``); a callable
    stack (decision ``None``) is asked here. See Note [Policy stack resolution].
    """
    decision = node.decision
    if decision is None:
        stack = region.policy_stack
        ctx = stack.ctx
        assert ctx is not None
        region.recording.on = False  # a policy's own tensor ops are not part of the region
        try:
            decision, node.decided_by = ctx.ask(
                stack.policies, stack.names, node.index, node.op, node.info, out, args, kwargs
            )
        finally:
            region.recording.on = True
        node.decision = decision
    keep = id(decision) in _KEEP_IDS
    reason = _POLICY  # a global, not ``graph.POLICY``: read for every decided op
    if node.info.is_random and node.rng is None and overwritten is None:
        # No generator replay for this device (see Note [RNG replay]): recomputing would
        # draw other values, so the engine keeps them, whatever the policy or a tag says.
        keep = True
        reason = graph.RANDOM_WITHOUT_REPLAY
    elif not keep and overwritten is None:
        # ``mark_recompute_inputs``, inlined: it runs for every recomputed op of a policy
        # function. See Note [Kept values live no longer than in eager], rule 4.
        for i in node.inputs:
            i.recompute_input = True
        return
    for o, h in zip(out if node.out_is_tuple else (out,), node.outputs, strict=True):
        if h is None:
            continue
        if overwritten is not None:
            hold_new_version(region, overwritten, h, o)
        elif keep:
            hold(region, h, o, reason, KEPT_ON_HOST.get(decision, False))
