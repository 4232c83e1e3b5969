"""Second reads of a saved tensor in one backward pass.

# Note [Reading a saved tensor again]
# Autograd unpacks a saved tensor at every read: a custom ``autograd.Function`` whose
# backward reads ``ctx.saved_tensors`` twice, or a hook reading ``grad_fn._saved_self``
# before the node runs, unpack the same packed object twice in one pass. Its use was taken
# at the first read (see Note [Use counts and freeing]), so the value may be freed already
# and its producer has run in this pass. A packed object therefore remembers the pass of
# its last read (``Packed.read``); a further read in that pass takes no use and returns the
# cached value, or recomputes it with ``realize_again``: from kept and cached values (the
# pass's walk back, ``pass_graph.collect``, run in forward order), into
# a local table, without touching use counts, caches or the pass state, writes replayed on
# copies. The result belongs to the caller only, so nothing stays alive once it drops it;
# a second read costs a recomputation instead of holding every value read until the end
# of the pass.

"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph.engine.graph import Handle, arg_at
from ckpt_graph.engine.pass_graph import collect
from ckpt_graph.engine.replay import (
    _call,
    _enter_replay,
    _exit_replay,
    exact_copy,
    note_recompute_failure,
)
from ckpt_graph.engine.version_check import _kept_value

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["realize_again"]


def realize_again(region: Region, h: Handle) -> torch.Tensor:
    """Recompute ``h`` once more, outside the pass bookkeeping.

    See Note [Reading a saved tensor again].
    """
    nodes = region.nodes
    state = region.pass_state
    core = state.core
    assert core is not None
    # The op nodes from ``h`` back to kept and cached values, once each, in forward order.
    order, _ = collect(core.g, (state.index[h],), core.kept, core.cached)
    # id(handle) -> value of this call. No closures over it: a nested function that
    # calls itself is a reference cycle, which would keep the values until a gc pass.
    local: dict[int, torch.Tensor] = {}
    replay = _enter_replay(region)
    try:
        for index in order:
            node = nodes[index]
            args = [_local_value(region, local, a) for a in node.args]
            kwargs = {k: _local_value(region, local, v) for k, v in node.kwargs.items()}
            for w in node.info.writes:  # never write a value someone else holds
                v = arg_at(args, kwargs, w)
                if isinstance(v, torch.Tensor):
                    v = (
                        v.as_strided(v.size(), v.stride(), v.storage_offset())
                        if node.info.is_inplace_view
                        else exact_copy(v)
                    )
                    if isinstance(w, int):
                        args[w] = v
                    else:
                        kwargs[w] = v
            try:
                out = _call(node, args, kwargs)
            except Exception as e:  # See Note [Errors raised by a recomputed op].
                note_recompute_failure(e, node)
                raise
            for o, v in zip(node.outputs, out if node.out_is_tuple else (out,), strict=True):
                if o is not None:
                    local[id(o)] = v
    finally:
        _exit_replay(region, replay)
    return local[id(h)]


def _local_value(region: Region, local: dict[int, torch.Tensor], a: Any) -> Any:
    """An argument's value for ``realize_again``: kept, cached, or computed by this call."""
    if type(a) is Handle:
        if a.reason is not None:
            return _kept_value(region, a)
        if a.cache is not None:
            return a.cache
        return local[id(a)]
    if type(a) is list:
        return [_local_value(region, local, e) for e in a]
    return a
