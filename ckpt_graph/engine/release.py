"""Kept values released as autograd releases the saved tensors that need them.

# Note [Releasing kept values]
# A kept value is needed as long as a saved tensor refers to it, or a saved tensor of a
# recomputed value whose recomputation would read it. When the region exits, every handle
# gets ``live_uses`` = its live saved tensors + the op nodes that take it as input and could
# still have to run (one sweep from the last node back, as for the pass use counts). Kept
# values with no live use are released at once. Afterwards, each saved tensor autograd
# releases (after its backward node ran, or when the graph is dropped) takes one live use of
# its handle; a recomputed handle that drops to zero makes its producer dead
# (``OpNode.may_run`` false) once all its recomputed outputs are, which takes a use of each
# of the producer's inputs, and so on; a kept handle that drops to zero is released. So a
# kept block input is freed right after the last backward node that could need it, as
# autograd frees a saved tensor. An op node that is dead and whose kept outputs have no live
# use either never runs again: its generator state (Note [RNG replay]) is dropped (a CPU
# state is 5 KiB per random op).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_graph.engine.pass_graph import count_uses
from ckpt_graph.engine.passes import pass_graph

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["count_live_uses", "free_use"]


def count_live_uses(region: Region) -> None:
    """Set ``Handle.live_uses`` at region exit; free unneeded kept values.

    The sweep is the pass's (``pass_graph.count_uses``, Note [One pass core]), counting
    kept inputs too. See Note [Releasing kept values].
    """
    g, handles, _ = pass_graph(region)
    kept = [h.reason is not None for h in handles]
    uses = [h.saved_refs for h in handles]
    runs = count_uses(g, kept, uses, all_inputs=True)
    for h, n in zip(handles, uses, strict=True):
        h.live_uses += n
    for node, may_run in zip(region.nodes, runs, strict=True):
        node.may_run = may_run
        if not may_run and node.rng is not None:
            _free_rng_if_dead(node)
    for h in handles:
        if h.reason is not None and h.live_uses == 0:
            h.value = None


def free_use(region: Region, h: Handle) -> None:
    """A saved tensor of ``h`` was freed: take one live use. See Note [Releasing kept values]."""
    nodes = region.nodes
    stack = [h]
    while stack:
        h = stack.pop()
        h.live_uses -= 1
        if h.live_uses > 0:
            continue
        if h.reason is not None:
            h.value = None
            if h.node_index >= 0 and nodes[h.node_index].rng is not None:
                _free_rng_if_dead(nodes[h.node_index])
            continue
        if h.node_index < 0:
            continue
        node = nodes[h.node_index]
        if not node.may_run or any(
            o is not None and o.reason is None and o.live_uses > 0 for o in node.outputs
        ):
            continue
        node.may_run = False
        if node.rng is not None:
            _free_rng_if_dead(node)
        stack.extend(node.inputs)


def _free_rng_if_dead(node: OpNode) -> None:
    """Drop the generator state of a node that can no longer run.

    A node with a kept output still in use stays able to run: Note [Kept values changed
    after the region] may recompute that output. See Note [Releasing kept values].
    """
    if not node.may_run and not any(o is not None and o.live_uses > 0 for o in node.outputs):
        node.rng = None
