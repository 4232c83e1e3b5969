"""Mutation bookkeeping of the recorder: in-place ops, views, kept values, generator states.

# Note [Mutation and views]
# Every tensor the region sees maps to the handle of the value it holds *now*
# (``Region.handle_of``): an identity map ``id(tensor) -> Handle`` whose entries are
# validated by a weak reference (ids are reused) and by the tensor's version counter.
#   1. An op whose schema writes an argument (``alias_info.is_write``, plus the few ops in
#      ``graph._UNANNOTATED_WRITES`` such as CPU ``native_batch_norm``) creates a new
#      version: the returned tensor maps to the new op node's output handle, and the old
#      handle is marked ``superseded`` so that a saved tensor of the old value raises
#      autograd's version-counter error when unpacked, as eager does.
#   2. Written arguments that the op does not return (running statistics) are dropped
#      from the map: their next use takes the tensor as it is (a kept snapshot).
#   3. A tensor whose version changed through another alias (``x[0:2].mul_(3)`` changes
#      ``x``) no longer matches its handle; its next use takes it as a kept snapshot
#      (reason ``MUTATED_ALIAS``). Correct, and rare in models; deriving the new value by
#      replaying view ops on the new base would avoid keeping it. The same holds for a
#      write through an alias with a version counter of its own (``x.data.mul_(3)``, seen
#      as a ``detach`` view): the version stays, but the handle is superseded. A saved
#      tensor of the old value then cannot be served as eager would (eager reads the new
#      values, unchecked), and unpacking it raises an error naming ``.data``.
#   4. Kept values are shared with the forward tensors. Before an op writes a storage,
#      every kept value in that storage that some op node or saved tensor already used is
#      replaced by an exact copy (same storage offset and strides), because the write would
#      change it under them. A kept value the op overwrites with nobody else needing it is
#      not copied; its new version is kept instead (``INPLACE_ON_KEPT``), which costs no
#      memory since it is the same tensor.
#   5. The version of an in-place op's output (bumped) and of a view op's output (shared
#      with its base) is only set by autograd after this mode returns: those handles start
#      at -1 and read the tensor's version when the region next sees anything
#      (``Region._settle``), before any other op can change it.
# Replaying a recorded write in backward follows the same rule from the other side: it runs
# on the cached value itself only when that value is recomputed, not a view, has no views
# and this op is its last pending user (dropout's ``empty_like -> bernoulli_ -> div_``);
# otherwise on an exact copy (see ``realize.run_node``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph.engine.graph import SILENT_WRITE, Handle, OpInfo, arg_at
from ckpt_graph.engine.realize import exact_copy

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["before_write", "capture_rng", "index_storage", "mark_written", "supersede_view_bases"]


def index_storage(region: Region, h: Handle) -> None:
    """Add a kept value to the region's storage index (see ``before_write``)."""
    assert region._by_storage is not None
    if h.value is not None and h.offload_device is None:
        key = h.value.untyped_storage().data_ptr()
        if key:
            region._by_storage.setdefault(key, []).append(h)


def before_write(
    region: Region,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
) -> Handle | None:
    """Copy kept values an in-place op is about to change. See Note [Mutation and views].

    Returns:
        The written argument's kept handle if it is overwritten without a copy (its
        new version must then be kept), else ``None``.
    """
    if region._by_storage is None:
        region._by_storage = {}
        for h in region.inputs:
            index_storage(region, h)
        for node in region.nodes:
            for o in node.outputs:
                if o is not None and o.value is not None:
                    index_storage(region, o)
    overwritten: Handle | None = None
    for w in info.writes:
        t = arg_at(args, kwargs, w)
        written = arg_at(h_args, h_kwargs, w)
        if not isinstance(t, torch.Tensor) or not isinstance(written, Handle):
            continue
        if not info.silent_writes:
            supersede_view_bases(region, written)
        key = t.untyped_storage().data_ptr()
        entries = region._by_storage.pop(key, None)
        if not entries:
            continue
        for k in entries:
            if k.value is None:
                continue
            if k is written and k.reason is SILENT_WRITE:
                continue  # saved tensors read the new value: see Note [Silent writes]
            if k is not written and not info.silent_writes:
                k.superseded = True  # an alias: it shares the version counter
            if k is written and k.uses == 0 and info.returns_written:
                overwritten = k  # rule 4: its new version keeps the tensor
                continue
            if k.uses == 0 and (k is not written or info.returns_written):
                continue  # nobody needs the old value (this op does if it has other outputs)
            k.value = exact_copy(k.value)
            if k.node_index < 0 or k.is_view:
                # New memory the region holds: a region input or a view was not counted.
                region.kept_bytes += k.value.untyped_storage().nbytes()
            k.version = k.value._version
            k.ref = None
            index_storage(region, k)
    return overwritten


def supersede_view_bases(region: Region, h: Handle) -> None:
    """A write through a view changes the values of the view's bases too."""
    while h.is_view and h.node_index >= 0:
        inputs = region.nodes[h.node_index].inputs
        if not inputs:
            break
        h = inputs[0]
        h.superseded = True


def mark_written(
    region: Region,
    info: OpInfo,
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Handle | None:
    """Supersede the old versions of written arguments; return the first one's handle."""
    first: Handle | None = None
    for w in info.writes:
        written = arg_at(h_args, h_kwargs, w)
        if not isinstance(written, Handle):
            continue
        written.superseded = not info.silent_writes
        if first is None:
            first = written
        if not info.returns_written:
            t = arg_at(args, kwargs, w)
            region._ids.pop(id(t), None)
    return first


def capture_rng(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Generator, torch.Tensor] | None:
    """Generator state just before a random op runs. See Note [RNG replay]."""
    gen = kwargs.get("generator")
    if gen is None:
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "cpu":
            gen = torch.default_generator
        elif device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            gen = torch.cuda.default_generators[idx]
        else:
            return None  # no replay known for this device: outputs are kept
    state = gen.get_state()
    # See Note [RNG replay]: consecutive random ops that left the generator as it was (SDPA
    # without dropout, dropout(p=0)) share one state tensor instead of holding a copy each.
    last_gen, last_state = _LAST_RNG
    if last_gen is not None and last_gen() is gen:
        last = last_state()
        if last is not None and _same(last, state):
            return gen, last
    _LAST_RNG[:] = [weakref.ref(gen), weakref.ref(state)]
    return gen, state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Below every dispatch mode: the caller's own modes (an op counter, a profiler) must not
    # see the engine's bookkeeping as ops of the program.
    with torch._C._DisableTorchDispatch():
        return torch.equal(a, b)


# The generator and the state tensor of the last capture, weakly held (a region owns them).
_LAST_RNG: list[Any] = [None, None]
