"""Saved-tensor hooks: pack handles instead of tensors, realize them on unpack.

# Note [Packed lifetime]
# The pack hook returns a small ``Packed`` object (region, handle) for each tensor autograd
# saves in the region, counting it in the handle's ``saved_refs`` and the region's live packs.
# Autograd holds these objects in its graph; when it frees one (after the node ran in a
# backward without ``retain_graph``, or when the graph is freed), ``Packed.__del__``
# decrements the counts. When the region has exited and its last packed object is gone,
# the region frees every tensor it holds: kept values, caches, RNG states. A region object
# the user still refers to keeps only metadata. Reference counting makes this prompt;
# nothing here creates a reference cycle, so no garbage collection is needed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from ckpt_graph.engine import graph
from ckpt_graph.engine.holding import hold
from ckpt_graph.engine.kept_lifetime import drop_if_unread, need, unneed
from ckpt_graph.engine.realize import unpack_value

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle
    from ckpt_graph.engine.region import Region

__all__ = ["Packed", "pack_hook_for", "unpack_hook", "unpack_hook_for_autograd"]


try:  # torch >= 2.10: objects a custom op can take, opaque to torch.compile
    from torch._library.opaque_object import register_opaque_type as _register_opaque
    from torch._opaque_base import OpaqueBase as _PackedBase
except ImportError:  # pragma: no cover - older torch
    _PackedBase = object  # type: ignore[assignment,misc]
    _register_opaque = None  # type: ignore[assignment]


class Packed(_PackedBase):
    """What autograd stores for a saved tensor of a region.

    An opaque object for torch.compile, so that compiled autograd can pass it to the
    ``ckpt_graph::unpack`` op instead of tracing the engine. See Note [Compiled autograd].
    """

    __slots__ = ("handle", "read", "region")

    def __init__(self, region: Region, handle: Handle) -> None:
        self.region = region
        self.handle = handle
        self.read = -1  # pass number of the last read; see Note [Reading a saved tensor again]
        handle.saved_refs += 1
        region.saved_log.live_packs += 1

    def __del__(self) -> None:
        try:
            handle, region = self.handle, self.region
        except AttributeError:  # made without __init__ (e.g. by a compiler's tracing)
            return
        handle.saved_refs -= 1
        if handle.saved_refs == 0 and region.is_open:  # a graph dropped during the forward
            # See Note [Kept values live no longer than in eager], rule 3.
            if handle.reason is not None:
                drop_if_unread(region, handle)
            elif handle.recompute_readers == 0 and region.recording.counting:
                unneed(region, handle)
        region.pack_released(handle)

    def __repr__(self) -> str:
        return f"Packed({self.handle!r})"


def pack_hook_for(region: Region) -> Callable[[torch.Tensor], Any]:
    """The pack hook of ``region``: packs a saved tensor as its handle.

    Backward run inside the region saves raw tensors. The hook is a closure over the region
    (not a lambda calling a function): it runs for every tensor autograd saves.
    """
    current_task = torch._C._current_graph_task_id
    handle_of = region.handle_of
    log, recording = region.saved_log, region.recording
    saved_at, saved_handles, strides, nodes = log.at, log.handles, log.strides, region.nodes

    def pack_hook(t: torch.Tensor) -> Any:
        if not recording.on or current_task() != recording.task:
            return t
        if recording.unsettled:
            region.settle()
        h = handle_of(t)
        h.forward_uses += 1
        # The first need of a recomputed value. See Note [Kept values live no longer than
        # in eager], rule 2.
        if (
            recording.counting  # See Note [Kept values live no longer than in eager], rule 6.
            and h.reason is None
            and h.saved_refs == 0
            and h.recompute_readers == 0
            and not need(region, h)
        ):
            hold(region, h, t, graph.SAVED_AFTER_INPUTS_FREED)
        if h.device is None:
            stride = t.stride()
            h.stride = strides.setdefault(stride, stride)  # shared, as sizes are
            h.device = t.device
            _note_storage(h, t)
        saved_at.append(len(nodes))  # See Note [Saved tensor records].
        saved_handles.append(h)
        return Packed(region, h)

    return pack_hook


def _note_storage(h: Handle, t: torch.Tensor) -> None:
    """Remember where the saved tensor's elements are. See Note [Live forward tensors].

    A weak reference as a plain int, not a ``StorageWeakRef`` object: an object per saved
    value counts towards the garbage collector's passes (Note [One recording path], rule 3),
    which cost more than ten times the reference itself. Releasing the region frees it.
    """
    try:
        # torch's stubs type ``_weak_ref`` as returning a storage; it returns the int.
        h.storage = cast(int, t.untyped_storage()._weak_ref())
        h.storage_offset = int(t.storage_offset())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses)
        h.storage = 0


def unpack_hook(packed: Any) -> torch.Tensor:
    """Return the saved tensor: the kept value, or its recomputation."""
    if type(packed) is Packed:
        return unpack_value(packed.region, packed.handle, packed)
    if torch.compiler.is_compiling() and _UNPACK_OP:
        return _UNPACK_OP[0](packed)  # type: ignore[no-any-return]
    return packed  # type: ignore[no-any-return]


# Note [Compiled autograd]
# Compiled autograd turns each unpack hook call into a node of its FX backward graph and,
# with a torch.compile backend, has dynamo trace the hook. Tracing the engine (use counts,
# autograd engine callbacks) cannot work, and excluding the hook from dynamo makes every
# unpack a graph break across which the compiled backward keeps all its values alive. So
# Packed is registered as an opaque reference type, and under tracing the hook becomes one
# call of the custom op ``ckpt_graph::unpack(Packed) -> Tensor``, whose fake implementation
# describes the value from the handle's metadata. At run time the op realizes the handle as
# usual, in graph order, so recomputation stays progressive. Without opaque-object support
# (older torch), the hook is excluded from dynamo instead: exact, but not progressive.
_UNPACK_OP: list[Any] = []
if _register_opaque is not None:
    _register_opaque(Packed, typ="reference")

    @torch.library.custom_op("ckpt_graph::unpack", mutates_args=())
    def _unpack_op(packed: Packed) -> torch.Tensor:
        return unpack_value(packed.region, packed.handle, packed)

    @_unpack_op.register_fake  # type: ignore[misc]
    def _(packed: Any) -> torch.Tensor:
        real = getattr(packed, "real_obj", packed)
        h = real.handle
        return torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=h.device)

    _UNPACK_OP.append(torch.ops.ckpt_graph.unpack)

_compiler_safe_unpack: list[Any] = []


def unpack_hook_for_autograd() -> Any:
    """The unpack hook to install. See Note [Compiled autograd].

    With opaque-object support the plain hook is traceable. Otherwise, once dynamo is
    loaded, the hook is excluded from it (importing dynamo costs seconds, so it is only
    touched when the program has imported it already: nothing can be compiling before).
    """
    if _UNPACK_OP or "torch._dynamo" not in sys.modules:
        return unpack_hook
    if not _compiler_safe_unpack:
        _compiler_safe_unpack.append(torch._dynamo.disable(unpack_hook))
    return _compiler_safe_unpack[0]
