"""Saved-tensor hooks: pack handles instead of tensors, realize them on unpack.

# Note [Packed lifetime]
# The pack hook returns a small ``Packed`` object (region, handle) for each tensor autograd
# saves in the region, counting it in the handle's ``packs`` and the region's live packs.
# Autograd holds these objects in its graph; when it releases one (after the node ran in a
# backward without ``retain_graph``, or when the graph is dropped), ``Packed.__del__``
# decrements the counts. When the region has exited and its last packed object is gone,
# the region drops every tensor it holds: kept values, caches, RNG states. A region object
# the user still refers to keeps only metadata. Reference counting makes this prompt;
# nothing here creates a reference cycle, so no garbage collection is needed.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from .realize import unpack_value

if TYPE_CHECKING:
    from .graph import Handle
    from .region import Region

__all__ = ["Packed", "pack_hook", "unpack_hook", "unpack_hook_for_autograd"]


class Packed:
    """What autograd stores for a saved tensor of a region."""

    __slots__ = ("handle", "region")

    def __init__(self, region: Region, handle: Handle) -> None:
        self.region = region
        self.handle = handle
        handle.packs += 1
        region._live_packs += 1

    def __del__(self) -> None:
        try:
            handle, region = self.handle, self.region
        except AttributeError:  # made without __init__ (e.g. by a compiler's tracing)
            return
        handle.packs -= 1
        region._pack_released(handle)

    def __repr__(self) -> str:
        return f"Packed({self.handle!r})"


def pack_hook(region: Region, t: torch.Tensor) -> Any:
    """Pack a saved tensor as its handle (raw tensor for backward run inside the region)."""
    if not region._recording or torch._C._current_graph_task_id() != region._task:
        return t
    if region._unsettled:
        region._settle()
    h = region.handle_of(t)
    h.uses += 1
    region.saved.append((len(region.nodes), h))
    return Packed(region, h)


def unpack_hook(packed: Any) -> torch.Tensor:
    """Return the saved tensor: the kept value, or its recomputation."""
    if type(packed) is not Packed:
        return packed  # type: ignore[no-any-return]
    return unpack_value(packed.region, packed.handle)


_compiler_safe_unpack: list[Any] = []


def unpack_hook_for_autograd() -> Any:
    """The unpack hook to install: excluded from dynamo once dynamo is in use.

    Under compiled autograd with a torch.compile backend, dynamo would trace the hook
    (and fail on the engine's callbacks); excluded, it is called from the compiled
    backward instead. Importing dynamo costs seconds, so it is only touched when the
    program has imported it already (nothing can be compiling otherwise).
    """
    if "torch._dynamo" not in sys.modules:
        return unpack_hook
    if not _compiler_safe_unpack:
        _compiler_safe_unpack.append(torch._dynamo.disable(unpack_hook))
    return _compiler_safe_unpack[0]
