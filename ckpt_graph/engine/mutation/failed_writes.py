"""An in-place op that raises: what ``before_write`` changed, noted before the op runs and
restored after. See Note [Failed in-place ops].

The recorder calls these for ops whose ``OpInfo.writes`` is set, around ``before_write``
(see Note [Mutation and views] in ``writes.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph.engine import graph
from ckpt_graph.engine.graph import Handle, arg_at
from ckpt_graph.engine.mutation.storage_history import alias_source
from ckpt_graph.engine.op_info import OpInfo

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["restore", "write_state"]


# Note [Failed in-place ops]
# ``before_write`` prepares a region for an in-place op before the op runs: it supersedes
# the old values of the written tensor and of its view bases, and replaces kept values in
# the written storage by copies. An op can still raise (``y[0:2].add_(torch.ones(3))``: a
# shape error), and code may catch that and go on; eager then has nothing changed. So the
# handles ``before_write`` (and ``keep_silently_written``) may touch are noted first
# (``write_state``: the view bases of each written handle and every kept value in a
# written storage; only for ops that write) and restored with ``kept_bytes`` if the op
# raises (``restore``), and nothing is recorded. The storage index
# is rebuilt at the next write. Without this, a saved tensor of the base raised an error
# about `.data` in backward.
_Undo = list[tuple[Handle, bool, int, Any, int, Any, graph.KeptReason | None]]


def write_state(
    region: Region,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
) -> _Undo:
    """What ``before_write`` may change. See Note [Failed in-place ops]."""
    touched: dict[int, Handle] = {}
    by_storage = region.recording.by_storage
    for w in info.writes:
        t = arg_at(args, kwargs, w)
        h = arg_at(h_args, h_kwargs, w)
        if not isinstance(t, torch.Tensor) or not isinstance(h, Handle):
            continue
        touched[id(h)] = h
        # What ``supersede_view_bases`` changes: the view's base and the value an
        # ``unsafe_chunk`` output was cut from. Not the whole chain of views back to it,
        # which grows with every write through a view of the last write's result (a buffer
        # filled step by step): walking it made each write cost the number of writes before.
        b = h.base
        if b is not None:
            touched[id(b)] = b
        src = alias_source(region, b or h)
        if src is not None:
            touched[id(src)] = src
        key = t.untyped_storage().data_ptr()
        if by_storage is not None:
            entries: Any = by_storage.get(key, ())
        else:  # not built yet: the first write of the region (see ``before_write``)
            entries = [
                o
                for o in (*region.inputs, *(o for n in region.nodes for o in n.outputs))
                if o is not None
                and o.value is not None
                and o.offload_device is None
                and o.value.untyped_storage().data_ptr() == key
            ]
        for k in entries:
            touched[id(k)] = k
    return [
        (h, h.superseded, h.writes, h.value, h.version, h.ref, h.reason) for h in touched.values()
    ]


def restore(region: Region, undo: _Undo) -> None:
    """Undo ``before_write`` for an op that raised. See Note [Failed in-place ops]."""
    for h, superseded, writes, value, version, ref, reason in undo:
        h.superseded, h.writes, h.value, h.version = superseded, writes, value, version
        h.ref, h.reason = ref, reason
    region.recording.by_storage = None
