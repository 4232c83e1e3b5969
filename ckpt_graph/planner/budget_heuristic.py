"""The online heuristic of ``memory_budget``: decide each op as it is recorded, no plan.

See rule 5 of Note [Memory budget policy]; a block's state (``records.Run``) also holds what plan
matching (Note [Plans across sizes]) and planning read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ckpt_graph.planner.records import Run

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["aliases", "count_saved", "heuristic", "tensors", "views_of_kept"]

_CHAIN_OPS = 200
_CHEAP = 0.9
_SEGMENT = 0.3


def heuristic(
    budget: int | float, ctx: Any, run: Run, flops: int, out: Any, args: tuple[Any, ...]
) -> bool:
    """Keep this op's output? See rule 5 of Note [Memory budget policy]."""
    region = ctx.region
    count_saved(region, run)
    i = ctx.op_index
    nbytes = ctx.out_bytes
    if ctx.is_inplace or aliases(out, args):
        nbytes = 0  # nothing of its own to keep
    if isinstance(budget, float) and budget >= 1.0:  # all the region keeps without checkpointing
        return nbytes > 0 or (not ctx.is_inplace and views_of_kept(region, run, args))
    # the recomputed values backward runs to recompute this one (rule 5b)
    chain: set[int] = set()
    for a in tensors(args):
        h = region.lookup(a)
        if h is not None and h.node_index >= run.start and not h.kept:
            chain.add(h.node_index)
            chain |= run.chain.get(h.node_index, frozenset())
    run.chain[i] = frozenset(chain)
    run.own[i] = nbytes
    if nbytes == 0:
        return False
    chain_bytes = nbytes + sum(run.own.get(j, 0) for j in chain)
    fraction = isinstance(budget, float)
    allowance = budget * (run.saved_bytes + nbytes) if fraction else float(budget)
    kept: int = ctx.kept_bytes - run.kept_at_enter
    limit = allowance if flops > 0 else _CHEAP * allowance
    keep: bool = kept + nbytes <= allowance and (
        chain_bytes >= _SEGMENT * allowance  # rule 5b: a periodic keep
        or len(chain) >= _CHAIN_OPS
        or kept + nbytes + max(run.longest, chain_bytes) <= limit
    )
    if not keep:
        run.longest = max(run.longest, chain_bytes)
    return keep


def views_of_kept(region: Region, run: Run, args: tuple[Any, ...]) -> bool:
    """Whether every tensor argument of a view op is kept: keeping it costs no memory.

    See rule 5d of Note [Memory budget policy] and Note [Kept views].
    """
    found = False
    for a in tensors(args):
        h = region.lookup(a)
        if h is not None and h.node_index >= run.start and not h.kept:
            return False
        found = True
    return found


def count_saved(region: Region, run: Run) -> None:
    """Add the saves since the last call to ``run.saved_bytes`` (rule 5a)."""
    saved = region.saved
    for _, h in saved[run.saved_seen :]:
        while h.is_view and h.node_index >= run.start:  # count the base's storage
            h = region.nodes[h.node_index].inputs[0]
        if h.node_index >= run.start and id(h) not in run.seen:
            run.seen.add(id(h))
            run.saved_bytes += h.nbytes
    run.saved_seen = len(saved)


def tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """Tensor arguments, including those in lists (``aten.cat``)."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def aliases(out: Any, args: tuple[Any, ...]) -> bool:
    """Whether every tensor output shares the storage of a tensor argument (a view)."""
    outs = [
        o
        for o in (out if isinstance(out, (tuple, list)) else (out,))
        if isinstance(o, torch.Tensor)
    ]
    if not outs:
        return False
    ptrs = {t.untyped_storage().data_ptr() for t in tensors(args)}
    return all(o.untyped_storage().data_ptr() in ptrs for o in outs)
