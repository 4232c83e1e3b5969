"""Checks that a saved value is still the one the forward saved (version counters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine import graph
from ckpt_graph.engine.debug import check_kept
from ckpt_graph.engine.graph import version_of

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle
    from ckpt_graph.engine.region import Region


def _where(h: Handle, region: Region) -> str:
    """Which value of the region ``h`` is, for error messages."""
    if h.node_index >= 0:
        return f"output {h.output_index} of {region.nodes[h.node_index].info.name} (op #{h.node_index})"
    if h.reason == graph.MUTATED_ALIAS:
        return (
            f"value #{h.input_index} the region took as it was after an in-place op on an alias "
            "(a snapshot)"
        )
    return f"input #{h.input_index} of the region"


def _version_error(h: Handle, region: Region, current: int) -> CkptGraphError:
    where = _where(h, region)
    return CkptGraphError(
        "ckpt_graph: one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{h.dtype} {list(h.shape)}], which is {where}, is at version "
        f"{current}; expected version {h.version} instead. Hint: do not modify a tensor in place "
        "after it was used in a checkpointed region, or clone it before modifying it."
    )


def _untracked_write_error(h: Handle, region: Region) -> CkptGraphError:
    return CkptGraphError(
        f"ckpt_graph: {_where(h, region)} [{h.dtype} {list(h.shape)}] was written in place "
        "through an alias "
        "with a version counter of its own (such as `.data`) after autograd saved it: eager "
        "autograd would silently use the new values, the region can only give the old ones. "
        "Write to the tensor itself rather than its `.data` (eager then reports the "
        "conflict), or do the write outside the region."
    )


# Note [Version checks through a copied base]
# A saved view whose tensor is gone is checked through its base (Note [Mutation and
# views], rule 6): the base's forward tensor if it is alive, else its kept value, which
# then stands for the forward tensor only if it shares its version counter (an alias made
# by ``detached``). A kept value that a write of the region would have changed is
# replaced by an exact copy before the write (rule 4, ``hold_copy``); the copy carries the
# version the value had *before* that write and never moves again. The result of an
# in-place op names the written argument as its base, so the kept ``empty_like`` below
# ``inv[perm] = arange(n)`` (MoE routing) was copied at version 0 while the saved index
# ``inv`` is at version 1, and comparing the two reported a write that never happened.
# A copied value (``Handle.copied``) is therefore not read for the view's version: writes
# of the region over the base after the view was made are still counted by ``writes``,
# and a later write outside the region through a view of the base keeps the base's
# forward tensor alive (its ``_base``), whose counter is then read. A write through a
# ``detach`` alias, which shares the counter but not the tensor, goes unseen once the
# forward tensor is gone, as for any recomputed value (a known gap: the strict xfail in
# tests/engine/test_version_copied_base.py).
def _check_version(region: Region, h: Handle) -> None:
    """Raise autograd's version-counter error if the forward tensor of ``h`` changed."""
    t = h.value if h.value is not None and h.offload_device is None else None
    if t is None and h.ref is not None:
        t = h.ref()
    if t is None and h.base is not None:
        # See Note [Mutation and views], rule 6: the view's tensor is gone (a temporary
        # view autograd saved), but it shared its base's version counter.
        b = h.base
        # The forward tensor first: the base's value may be a copy taken before a write
        # (``hold_copy``), whose version never moves, and a recorded write over the base
        # was then blamed on `.data`.
        bt = b.ref() if b.ref is not None else None
        if bt is None and b.value is not None and b.offload_device is None and not b.copied:
            bt = b.value  # See Note [Version checks through a copied base].
        if b.writes > h.base_writes:  # written after the view was made
            if bt is not None and version_of(bt) == b.version:
                raise _untracked_write_error(h, region)
            raise _version_error(h, region, version_of(bt) if bt is not None else h.version + 1)
        t = bt
    if t is not None and h.version != -1 and version_of(t) != h.version:
        raise _version_error(h, region, version_of(t))


def _kept_value(region: Region, h: Handle) -> torch.Tensor:
    v = h.value
    if v is None:
        raise CkptGraphError(
            f"ckpt_graph: the kept value {h!r} was already released; run backward once per "
            "forward, or pass retain_graph=True to the first backward"
        )
    _check_version(region, h)
    if h.offload_device is not None:  # See Note [Offload on CUDA].
        return region.offloader().to_device(h, v)
    if region.debug:
        check_kept(region, h, v)  # See Note [Kept value checks].
    return v
