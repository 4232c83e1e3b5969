"""Kept values freed as autograd frees the saved tensors that need them.

# Note [Releasing kept values]
# A kept value is needed as long as a saved tensor refers to it, or a saved tensor of a
# recomputed value whose recomputation would read it. When the region exits, every handle
# gets ``live_uses`` = its live saved tensors + the op nodes that take it as input and could
# still have to run (one sweep from the last node back, the pass's ``count_uses``). Kept
# values with no live use are freed at once. Afterwards, each saved tensor autograd
# frees (after its backward node ran, or when the graph is dropped) takes one live use of
# its handle (``pass_graph.free_use``, which the simulator runs too); a recomputed handle
# that drops to zero makes its producer dead (``PassState.may_run`` false) once all its
# recomputed outputs are, which takes a use of each of the producer's inputs, and so on; a
# kept handle that drops to zero is freed. So a
# kept block input is freed right after the last backward node that could need it, as
# autograd frees a saved tensor. An op node that is dead and whose kept outputs have no live
# use either never runs again: its generator state (Note [RNG replay]) is dropped (a CPU
# state is 5 KiB per random op).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckpt_graph.engine.pass_graph import count_uses, is_dead
from ckpt_graph.engine.pass_graph import free_use as _free_use
from ckpt_graph.engine.passes import pass_graph

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle
    from ckpt_graph.engine.region import Region

__all__ = ["count_live_uses", "free_use"]


def count_live_uses(region: Region) -> None:
    """Count the live uses at region exit (``PassState.live_uses``, ``may_run``); free
    unneeded kept values and the generator states of op nodes that never run.

    The sweep is the pass's (``pass_graph.count_uses``, Note [One pass core]), counting
    kept inputs too. See Note [Releasing kept values].
    """
    g, handles, _ = pass_graph(region)
    state = region.pass_state
    kept = [h.reason is not None for h in handles]
    live_uses = [h.saved_refs for h in handles]
    state.may_run = count_uses(g, kept, live_uses, all_inputs=True)
    state.live_uses = live_uses
    for j, node in enumerate(region.nodes):
        if node.rng is not None and is_dead(g, live_uses, state.may_run, j):
            node.rng = None
    for h, n in zip(handles, live_uses, strict=True):
        if h.reason is not None and n == 0:
            h.value = None


def free_use(region: Region, h: Handle) -> None:
    """A saved tensor of ``h`` was freed: take one live use (``pass_graph.free_use``). See
    Note [Releasing kept values]."""
    g, handles, index = pass_graph(region)
    state = region.pass_state
    nodes = region.nodes

    def free_kept(v: int) -> None:
        handles[v].value = None

    def dead(j: int) -> None:
        node = nodes[j]
        if node.rng is not None and is_dead(g, state.live_uses, state.may_run, j):
            node.rng = None

    _free_use(g, _Kept(handles), state.live_uses, state.may_run, index[h], free_kept, dead)


class _Kept(Sequence[bool]):
    """Per value number, whether the value is kept now (a changed kept value becomes
    recomputed at a pass's start: Note [Kept values changed after the region])."""

    __slots__ = ("handles",)

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, v: int) -> bool:  # type: ignore[override]
        return self.handles[v].reason is not None
