"""Holding values: the one place the region keeps a value for backward and frees it.

# Note [Holding values]
# The region holds a value in one place, ``hold``, and frees it in one, ``free_kept``:
#   1. Holding sets the handle's value (an alias of the forward tensor without autograd
#      history, or a host copy when offloaded) and its reason.
#   2. ``kept_bytes`` counts memory the region holds that nobody else accounts for: an
#      op output that is not a view. A region input is the caller's; a view's bytes
#      belong to its base. The kept new version of a value an in-place op overwrote
#      is the same memory, counted once (``hold_new_version``); a copy taken before a
#      write is new memory for an input or a view (``hold_copy``), and for an op output
#      when another kept value (a written view's new version) still holds its storage.
#   3. A held value joins the storage index, once that is built (see ``before_write``).
#   4. A region input without autograd history (a parameter, a batch: a tensor that does
#      not require grad, or one that is not a view and has no ``grad_fn``) is held as
#      itself, not as an alias: no history of it could refer back to the region, and
#      replay runs under no grad (see Note [RNG replay]), so it builds no graph from it.
#      Making the alias below autograd costs microseconds per input, and a model has an
#      input per parameter in every region, every step. A view's ``grad_fn`` is not read:
#      reading it rebuilds the view's history when its base was written since, and for an
#      output of a multi-output view op (``unbind``, ``split``) that raises "Output 0 of
#      Unbind is a view and its base ... has been modified inplace", where eager, which
#      reads no ``grad_fn``, runs (the view written under ``torch.no_grad()`` in the region).
#   5. A kept op output is watched while the region records: it is freed when the program
#      drops its forward tensor and nothing reads the value any more (see Note [Kept values
#      live no longer than in eager]).
# Undoing a failed in-place op restores handles and ``kept_bytes`` as they were instead
# (see Note [Failed in-place ops]), and ``Region._release`` frees every value at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ckpt_graph.engine import graph
from ckpt_graph.engine.graph import Handle
from ckpt_graph.engine.kept_lifetime import watch

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = [
    "detached",
    "free_kept",
    "hold",
    "hold_copy",
    "hold_new_version",
    "index_storage",
    "without_history",
]

_DK = torch._C.DispatchKey
_tls_include = torch._C._dispatch_tls_local_include_set
_tls_exclude = torch._C._dispatch_tls_local_exclude_set
_ForceKeys = torch._C._ForceDispatchKeyGuard
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def hold(
    region: Region,
    h: Handle,
    t: torch.Tensor,
    reason: graph.KeptReason,
    offload: bool = False,
    count: bool = True,
) -> None:
    """Keep ``t`` as the value of ``h``. See Note [Holding values]."""
    if h.node_index >= 0 and not (offload and t.device.type != "cpu"):
        watch(region, h, t)  # See Note [Kept values live no longer than in eager].
    if offload and t.device.type != "cpu":  # See Note [Offload on CUDA].
        h.offload_device = t.device
        state = region.recording
        recording, state.on = state.on, False  # a tag at user level: the copy is no op node
        try:
            t = region.offloader().to_host(h, t)
        finally:
            state.on = recording
    if reason is graph.INPUT and type(t) in _PLAIN and without_history(t):
        h.keep(t, reason)  # See Note [Holding values], rule 4.
    else:
        h.keep(detached(region, t), reason)
    if count and h.node_index >= 0 and not h.is_view:
        region.kept_bytes += h.nbytes
    if region.recording.by_storage is not None:
        index_storage(region, h)


def without_history(t: torch.Tensor) -> bool:
    """Whether ``t`` has no autograd history, without reading a view's ``grad_fn``.
    See Note [Holding values], rule 4."""
    return not t.requires_grad or (not t._is_view() and t.grad_fn is None)


def hold_new_version(region: Region, old: Handle, h: Handle, t: torch.Tensor) -> None:
    """Keep the result ``t`` of an in-place op over the kept value ``old``, which nobody
    used: the same memory, so ``old`` frees its value and ``h`` is not counted again.
    See Note [Holding values]."""
    hold(region, h, t, graph.INPLACE_ON_KEPT, count=False)
    old.value = None  # superseded: its saved tensors raise the version error


def hold_copy(region: Region, h: Handle, copy: torch.Tensor, held: bool = False) -> None:
    """Keep ``copy`` instead of the alias ``h`` held, before a write changes the alias;
    ``held``: another kept value still holds the written storage. See Note [Holding values]."""
    h.value = copy
    h.copied = True  # See Note [Version checks through a copied base].
    if h.node_index < 0 or h.is_view or held:
        region.kept_bytes += copy.untyped_storage().nbytes()
    if region.recording.by_storage is not None:
        index_storage(region, h)


def free_kept(region: Region, h: Handle) -> None:
    """Free the kept value of ``h``: it is recomputed. See Note [Holding values]."""
    if h.node_index >= 0 and not h.is_view:
        region.kept_bytes -= h.nbytes
    h.free()


def index_storage(region: Region, h: Handle) -> None:
    """Add a kept value to the region's storage index (see ``before_write``)."""
    by_storage = region.recording.by_storage
    assert by_storage is not None
    if h.value is not None and h.offload_device is None:
        key = h.value.untyped_storage().data_ptr()
        if key:
            by_storage.setdefault(key, []).append(h)


def detached(region: Region, t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` without autograd history, for the region to keep.

    Kept values must not refer to the autograd graph: the graph holds the packed saved
    tensors, which hold the region, which would make a reference cycle. The recorder runs
    below autograd, where ``detach`` would give the alias a version counter of its own;
    re-enabling the ADInplaceOrView key for the call makes it share the forward tensor's
    counter, so later in-place changes stay visible.
    """
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        include = _tls_include()
        exclude = _tls_exclude()
        state = region.recording
        keys = state.alias_keys  # the same for every op of a region, in practice
        if keys is None or keys[0] != include or keys[1] != exclude:
            alias = exclude.remove(_DK.ADInplaceOrView).add(_DK.Python).add(_DK.PythonTLSSnapshot)
            keys = state.alias_keys = (include, exclude, alias)
        with _ForceKeys(include, keys[2]):
            return t.detach()
    state = region.recording
    recording, state.on = state.on, False
    try:
        return t.detach()
    finally:
        state.on = recording
