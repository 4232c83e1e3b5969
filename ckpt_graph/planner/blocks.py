"""Block boundaries of a recorded region: which op belongs to which repeated block.

Hand plans (Note [Hand seeds]) checkpoint per block, every k blocks, or keep matmuls plus
block inputs; they need to know where blocks start and end. :func:`find_blocks` reads that
from the program: the module calls that ran each op, else the module names, else repeated op
sequences in the recorded graph.

Example:
    >>> with cg.save_recompute_policy("recompute_all") as region:  # doctest: +SKIP
    ...     loss = model(x).sum()
    >>> found = find_blocks(region.nodes, from_region(region, costs))  # doctest: +SKIP
    >>> found.count, found.source  # doctest: +SKIP
    (12, 'modules: GPT2Block')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import torch

from ckpt_graph.planner.sim_graph import SimGraph

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import OpNode
    from ckpt_graph.engine.modules import ModuleCall

__all__ = ["Blocks", "block_ids", "find_blocks", "module_blocks", "repeated_blocks"]

# Note [Block boundaries]
# A block is a stretch of the forward that a hand-written checkpoint would wrap: one layer of
# a transformer, one residual unit of a CNN. Three readings of the program, tried in order:
# 1. Module calls (``OpNode.module_call``, see Note [Module path tracking]). The op nodes a
#    call runs are a contiguous stretch of the forward. Calls are grouped by the module's
#    class; a class's *top* calls are those with no caller of the same class, so they never
#    overlap. A class with at least two top calls is a candidate; its coverage is the number
#    of op nodes its top calls run. The blocks are the top calls of one candidate:
#    a. candidates covering less than ``_NEAR`` of the best coverage are out (a run of
#       ``Linear`` or ``Dropout`` calls repeats too, but covers a fraction of the forward);
#    b. of the rest, a class with branching calls wins over one without: a call branches
#       when some value made before or inside it is read by two op nodes of the call (a
#       residual connection, attention reading Q and K, squeeze-excite). A stage of a
#       ResNet branches through its blocks and so does the block, while the block's
#       conv-BN-ReLU layers do not: they are parts of a block, not blocks;
#    c. then the class with the most top calls wins: stages made of blocks (ConvNeXt, Swin,
#       ResNet, T5's encoder and decoder stacks) give their blocks, not themselves, and
#       the downsampling layers between stages are outside every block;
#    d. ties: the larger coverage, then the first class called;
#    e. another branching candidate of the rest whose top calls overlap no block so far adds
#       its calls as blocks: a UNet's attention layers between its ResNet blocks (a class
#       nested in a chosen one, or containing it, always overlaps);
#    f. blocks that cover less than ``_MIN_COVER`` of the op nodes are no blocks: in a
#       region over one layer the repeated calls (its linear layers) are parts of the layer.
#    g. (applied to the winner of a-d, before e) a class whose top calls each lie inside a top
#       call of a repeated class is a part of those enclosing calls, which are then the
#       blocks whatever their classes, if (i) it covers less than ``_NEAR`` of them together
#       with the branching calls beside it there (what rule e would add), or (ii) some
#       enclosing call holds two of its calls and ops run between every two that share one:
#       blocks of a stage run back to back (``for layer in layers: h = layer(h)``), the
#       attentions of a decoder layer have a residual sum and a norm between them. BART's
#       encoder and decoder layers are two classes of two calls each and its attention
#       (six calls, one class) covers 74% of them: the layers are the blocks. A stage whose
#       blocks cover nearly all of it and run back to back (ConvNeXt, ResNet, Swin) keeps
#       its blocks (rule c), and so does a VAE's middle level: its attention fills the rest
#       beside its ResNet blocks, and the ResNet blocks of its upper levels run back to back.
#    Classes, not names, make this hold for blocks that a Python loop calls without a parent
#    module (each is then an outermost module named ``""``) and for blocks spread over
#    several containers.
# 2. Module names (:func:`block_ids`), where no op node carries a call record (op nodes
#    made outside the module hooks). Where they do, names say nothing more than calls.
# 3. Repeated op sequences (:func:`repeated_blocks`), where modules say nothing (a functional
#    model): the longest stretch of op names that repeats with a fixed period p (at least
#    ``_MIN_PERIOD`` ops, twice or more, covering at least ``_MIN_COVER`` of the ops: a short
#    stretch repeats by chance), the smallest such p of the largest coverage; the
#    period's phase is where the fewest values made before a boundary are read after it
#    (a residual stream crosses a layer boundary alone; inside a layer more values are live).
# Blocks are numbered in forward order; an op node outside every block is -1.

_NEAR = 0.75
_MIN_PERIOD = 3
_MIN_COVER = 0.5


@dataclass(frozen=True)
class Blocks:
    """Block number of each op node (-1 outside blocks) and how they were found.

    Attributes:
        ids: block number per op node, in forward order.
        source: ``"modules: <class>[ + <class>...]"``, ``"names: <container>"``,
            ``"graph: period <p>"``, or ``"none"``.
        calls: with module calls, the call of each block (its ``module_id`` names the block
            module); empty otherwise.
    """

    ids: tuple[int, ...]
    source: str
    calls: tuple[ModuleCall, ...] = ()

    @property
    def count(self) -> int:
        """Number of blocks."""
        return max(self.ids, default=-1) + 1

    def __str__(self) -> str:
        return f"{self.count} blocks ({self.source})"


def block_ids(paths: Sequence[str]) -> list[int]:
    """Block number of each op (-1 outside blocks) from its module path.

    Rule 2 of Note [Block boundaries]: for each op's module path (``"blocks.3.attn.c_attn"``)
    the prefix up to its first numeric component names a child (``"blocks"``, ``"3"``); the
    container with the most distinct children (at least 2) is the block list, its children
    numbered in forward order.

    Example:
        >>> block_ids(["", "blocks.0.ln", "blocks.0", "blocks.1.mlp.0", "head"])
        [-1, 0, 0, 1, -1]
    """
    return _named(paths)[0]


def _named(paths: Sequence[str]) -> tuple[list[int], str]:
    keys: list[tuple[str, str] | None] = []
    children: dict[str, dict[str, int]] = {}
    for path in paths:
        key = None
        parts = path.split(".") if path else []
        for i in range(1, len(parts)):
            if parts[i].isdigit():
                key = (".".join(parts[:i]), parts[i])
                kids = children.setdefault(key[0], {})
                kids.setdefault(key[1], len(kids))
                break
        keys.append(key)
    if not children:
        return [-1] * len(paths), ""
    container, kids = max(children.items(), key=lambda kv: len(kv[1]))  # first on ties
    if len(kids) < 2:
        return [-1] * len(paths), ""
    ids = [kids[k[1]] if k is not None and k[0] == container else -1 for k in keys]
    return ids, container


def _branches(g: SimGraph, first: int, last: int) -> bool:
    """Some value is read by two op nodes ``first..last`` (rule 1b of Note [Block
    boundaries]); region inputs (parameters, the batch) do not count."""
    seen: set[int] = set()
    for op in g.ops[first : last + 1]:
        for v in op.inputs:
            if g.values[v].producer < 0:
                continue
            if v in seen:
                return True
            seen.add(v)
    return False


def _covered(calls: Sequence[ModuleCall], span: dict[ModuleCall, list[int]]) -> int:
    return sum(span[c][1] - span[c][0] + 1 for c in calls)


def _wholes(
    chosen: list[type],
    tops: dict[type, list[ModuleCall]],
    span: dict[ModuleCall, list[int]],
    branching: Callable[[type], bool],
) -> list[type]:
    """Rule 1g of Note [Block boundaries]: while the chosen classes' top calls are parts of
    top calls of other repeated classes, those are the blocks (by class, in forward order)."""
    repeated = {c: cls for cls, cs in tops.items() if len(cs) >= 2 for c in cs}
    while True:
        inner = [c for cls in chosen for c in tops[cls]]
        outer: dict[ModuleCall, list[ModuleCall]] = {}
        for c in sorted(inner, key=lambda c: span[c][0]):
            up = c.parent
            while up is not None and up not in repeated:
                up = up.parent
            if up is None:
                return chosen
            outer.setdefault(up, []).append(c)
        if len(outer) < 2:
            return chosen
        # 1g(ii): calls that share an enclosing call, with ops between each two of them
        held = [cs for cs in outer.values() if len(cs) >= 2]
        apart = bool(held) and all(
            span[a][1] + 1 < span[b][0] for cs in held for a, b in pairwise(cs)
        )
        taken = [span[c] for c in inner]
        for c, cls in repeated.items():  # what rule 1e would add inside the enclosing calls
            if cls in chosen or not branching(cls) or not _inside(c, outer):
                continue
            if not any(a[0] <= span[c][1] and span[c][0] <= a[1] for a in taken):
                taken.append(span[c])
        small = sum(b - a + 1 for a, b in taken) < _NEAR * _covered(list(outer), span)
        if not (small or apart):
            return chosen
        chosen = list(dict.fromkeys(repeated[c] for c in sorted(outer, key=lambda c: span[c][0])))


def _inside(call: ModuleCall, outer: dict[ModuleCall, list[ModuleCall]]) -> bool:
    up = call.parent
    while up is not None and up not in outer:
        up = up.parent
    return up is not None


def module_blocks(calls: Sequence[ModuleCall | None], g: SimGraph | None = None) -> Blocks:
    """Blocks from the module calls of each op node: rule 1 of Note [Block boundaries].

    Args:
        calls: ``OpNode.module_call`` of each op node, in forward order.
        g: the region's graph, with one op per entry of ``calls``; without it no call
            branches (rule 1b is skipped).
    """
    span: dict[ModuleCall, list[int]] = {}
    for j, call in enumerate(calls):
        c = call
        while c is not None:
            s = span.get(c)
            if s is None:
                span[c] = [j, j]
            else:
                s[1] = j
            c = c.parent
    tops: dict[type, list[ModuleCall]] = {}
    for c in span:
        up = c.parent
        while up is not None and up.cls is not c.cls:
            up = up.parent
        if up is None:
            tops.setdefault(c.cls, []).append(c)
    cover = {
        cls: sum(span[c][1] - span[c][0] + 1 for c in cs)
        for cls, cs in tops.items()
        if len(cs) >= 2
    }
    if not cover:
        return Blocks(tuple([-1] * len(calls)), "none")
    best = max(cover.values())
    graph = g if g is not None and len(g.ops) == len(calls) else None

    def branching(cls: type) -> bool:
        return graph is not None and any(_branches(graph, *span[c]) for c in tops[cls])

    first_call = {cls: min(c.index for c in cs) for cls, cs in tops.items()}

    def rank(cls: type) -> tuple[bool, int, int, int]:
        return (branching(cls), len(tops[cls]), cover[cls], -first_call[cls])

    near = sorted((cls for cls, n in cover.items() if n >= _NEAR * best), key=rank, reverse=True)
    chosen = _wholes([near[0]], tops, span, branching)
    taken = [span[c] for cls in chosen for c in tops[cls]]
    for cls in near[1:]:  # rule 1e: branching classes beside the blocks (a UNet's attention)
        if cls in chosen:
            continue
        spans = [span[c] for c in tops[cls]]
        if branching(cls) and not any(a[0] <= b[1] and b[0] <= a[1] for a in spans for b in taken):
            chosen.append(cls)
            taken += spans
    if sum(_covered(tops[cls], span) for cls in chosen) < _MIN_COVER * len(calls):
        return Blocks(tuple([-1] * len(calls)), "none")  # rule 1f: parts of one layer
    blocks = sorted((c for cls in chosen for c in tops[cls]), key=lambda c: span[c][0])
    ids = [-1] * len(calls)
    for b, c in enumerate(blocks):
        first, last = span[c]
        ids[first : last + 1] = [b] * (last - first + 1)
    names = " + ".join(cls.__name__ for cls in chosen)
    return Blocks(tuple(ids), f"modules: {names}", tuple(blocks))


def repeated_blocks(g: SimGraph) -> Blocks:
    """Blocks from repeated op sequences: rule 3 of Note [Block boundaries].

    Example:
        >>> # ops: x, [ln mm gelu mm add] x 3, mm  ->  blocks 0..2 around the repeats
        >>> repeated_blocks(graph).count  # doctest: +SKIP
        3
    """
    n = len(g.ops)
    codes: dict[str, int] = {}
    seq = torch.tensor([codes.setdefault(op.name, len(codes)) for op in g.ops], dtype=torch.long)
    best: tuple[int, int, int, int] | None = None  # (coverage, -period, start, span)
    edge = torch.tensor([False])
    for p in range(_MIN_PERIOD, n // 2 + 1):
        same = torch.cat([edge, seq[p:] == seq[:-p], edge])
        edges = torch.nonzero(same[1:] != same[:-1]).flatten()
        starts, spans = edges[0::2], edges[1::2] - edges[0::2] + p  # seq[s:s+span]: period p
        repeats = spans // p
        if not bool((repeats >= 2).any()):
            continue
        i = int(torch.argmax(torch.where(repeats >= 2, repeats, 0)))
        cand = (int(repeats[i]) * p, -p, int(starts[i]), int(spans[i]))
        if best is None or cand[:2] > best[:2]:
            best = cand
    if best is None or best[0] < _MIN_COVER * n:
        return Blocks(tuple([-1] * n), "none")
    _, neg_p, start, span = best
    p = -neg_p
    # Values live across the cut before each op (made before it, read at or after it).
    delta = [0] * (n + 1)
    last_read: dict[int, int] = {}
    for j, op in enumerate(g.ops):
        for v in op.inputs:
            if g.values[v].producer >= 0:
                last_read[v] = j
    for v, j in last_read.items():
        delta[g.values[v].producer + 1] += 1
        delta[j + 1] -= 1
    live = [0] * (n + 1)
    running = 0
    for i in range(n + 1):
        running += delta[i]
        live[i] = running

    def score(o: int) -> tuple[float, int]:
        count = (span - o) // p
        cuts = [start + o + k * p for k in range(count + 1)]
        return (sum(live[c] for c in cuts) / len(cuts), -count)

    phase = min(range(p), key=score)
    ids = [-1] * n
    for k in range((span - phase) // p):
        first = start + phase + k * p
        ids[first : first + p] = [k] * p
    return Blocks(tuple(ids), f"graph: period {p}")


def find_blocks(nodes: Sequence[OpNode], g: SimGraph | None = None) -> Blocks:
    """Block number of each op node of a region, by the first rule of Note [Block
    boundaries] that finds two blocks or more (module calls, else names where no op node
    has a call record, then repeated op sequences).

    Args:
        nodes: the region's op nodes (``region.nodes``).
        g: the region's graph (``liveness.from_region``), one op per node; needed for rule
            1b and rule 3.
    """
    calls = [n.module_call for n in nodes]
    if any(c is not None for c in calls):
        found = module_blocks(calls, g)
        if found.count >= 2:
            return found
    else:
        ids, container = _named([n.module_path for n in nodes])
        if max(ids, default=-1) >= 1:
            return Blocks(tuple(ids), f"names: {container}")
    if g is not None and len(g.ops) == len(nodes):
        return repeated_blocks(g)
    return Blocks(tuple([-1] * len(nodes)), "none")
