"""Silent writes: an in-place op that bumps no version counter, and the argument it writes
kept as an alias of the forward tensor. See Note [Silent writes].

The recorder calls ``keep_silently_written`` for ops whose ``OpInfo.silent_args`` is set,
before ``before_write`` (see Note [Mutation and views] in ``writes.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph.engine import graph
from ckpt_graph.engine.graph import Handle, arg_at
from ckpt_graph.engine.holding import hold
from ckpt_graph.engine.op_info import OpInfo

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["keep_silently_written"]

# Reasons that keep an alias of the forward tensor, which a silent write may change as is.
_ALIASES = frozenset({graph.POLICY, graph.TAG, graph.SAVED_AFTER_INPUTS_FREED})


# Note [Silent writes]
# Some writes bump no version counter (``OpInfo.silent_args``): CPU ``native_batch_norm``
# updating running statistics, ``rrelu_with_noise`` (and ``rrelu_with_noise_``, whose
# ``self`` is written as usual) filling its noise argument. Autograd
# saves ``noise`` before the op runs, and eager's backward reads whatever the tensor holds
# then: the values the op wrote. A recomputed handle of the written argument would give
# the values before the write (``empty_like``'s garbage), so the written argument is kept
# as an alias of the forward tensor before the op runs (reason ``SILENT_WRITE``): the alias
# sees the write, as eager's saved tensor does, and ``before_write`` does not replace it by
# a copy. Region inputs (running statistics) are kept anyway, and copied before the write
# only for the recomputed op nodes that read them earlier: the op's own outputs do not
# depend on the values it overwrites silently (BatchNorm's output in training mode does not
# read the running statistics it updates; ``rrelu_with_noise`` draws the noise it writes),
# and saved tensors of the argument read the new values, as eager's do. See Note [Kept
# values live no longer than in eager], rule 4.


def keep_silently_written(
    region: Region,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h_args: tuple[Any, ...],
    h_kwargs: dict[str, Any],
) -> None:
    """Keep recomputed arguments a silent write changes. See Note [Silent writes]."""
    for w in info.silent_args:
        t = arg_at(args, kwargs, w)
        h = arg_at(h_args, h_kwargs, w)
        if not isinstance(t, torch.Tensor) or not isinstance(h, Handle) or h.node_index < 0:
            continue
        if h.reason is None:
            hold(region, h, t, graph.SILENT_WRITE)
        elif h.reason in _ALIASES:
            h.reason = graph.SILENT_WRITE  # already an alias; ``before_write`` must not copy it
