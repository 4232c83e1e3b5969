"""Shared computations of introspection: FLOPs, storage accounting, recompute chains.

Everything here reads only a region's metadata (op nodes and handles), never a tensor
value, so it works during the forward, after it, and after the region freed its values.

# Note [Counting kept and recomputed bytes]
# Several handles can describe one block of memory: a view op's output shares its base's
# storage, and an in-place op's result is a new version of the tensor it wrote. Bytes are
# therefore counted once per *storage root*:
#   1. A kept value counts the bytes of the forward storage it holds: walk from the handle
#      through view ops (to their first input, the base) and in-place ops (to the written
#      argument) until a value that owns its storage; each root counts once, under the
#      reason of the first kept handle reaching it in forward order. A kept value that the
#      engine copied before an in-place op (``Handle.ref is None``) owns its copy.
#   2. A recomputed value costs new memory when realized unless it is a view of a kept
#      value. A replayed in-place op runs on the cached value when that value is
#      recomputed (one storage, counted once) and on a copy when it is kept (new bytes).
#   3. *Recomputable* values are the recomputed values a full backward may realize: every
#      value autograd saved (``region.saved``) that is not kept, plus, transitively, the
#      recomputed inputs of the op nodes that produce them. The chain stops at kept values
#      (region inputs included). Their op nodes are the ones a backward that unpacks every
#      saved tensor runs once each; their FLOPs are the recompute FLOPs.
# The engine's own figure ``region.pass_state.peak_cached_bytes`` counts every cached handle
# (views and in-place versions included), so it can exceed these storage bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.region import Region

__all__ = [
    "Chain",
    "category",
    "decided_by",
    "describe",
    "fmt_bytes",
    "fmt_flops",
    "kept_roots",
    "recompute_chain",
    "recompute_key",
    "storage_root",
    "value_position",
    "written_input",
]

from ckpt_graph.engine.flops import node_flops
from ckpt_graph.engine.graph import KeptReason
from ckpt_graph.engine.pass_graph import collect
from ckpt_graph.engine.passes import pass_graph


def written_input(node: OpNode) -> Handle | None:
    """The handle of the first argument an in-place op writes, if it is a region value."""
    from ckpt_graph.engine.graph import Handle

    for w in node.info.writes:
        h = node.args[w] if isinstance(w, int) and w < len(node.args) else node.kwargs.get(str(w))
        if type(h) is Handle:
            return h
    return None


def _base(region: Region, h: Handle) -> Handle | None:
    """The handle whose storage ``h`` shares in the forward, or ``None`` if it owns it."""
    if h.node_index < 0:
        return None
    node = region.nodes[h.node_index]
    if node.info.returns_written:
        return written_input(node)
    if h.is_view and node.inputs:
        return node.inputs[0]
    return None


def category(reason: KeptReason | None, h: Handle) -> str:
    """The summary category of a kept reason: input, snapshot, policy, tag or engine."""
    if reason is None:
        return "recomputed"
    if reason.by_engine:
        return "snapshot" if h.node_index < 0 else "engine"
    return reason.value


def storage_root(region: Region, h: Handle) -> Handle:
    """The value owning the forward storage ``h`` lives in (through views and in-place ops)."""
    while True:
        b = _base(region, h)
        if b is None:
            return h
        h = b


def kept_roots(region: Region) -> list[tuple[Handle, Handle]]:
    """``(kept handle, storage root)`` for every kept handle, in forward order.

    Several kept handles can share a root; callers count each root once. See Note
    [Counting kept and recomputed bytes] rule 1.
    """
    pairs: list[tuple[Handle, Handle]] = []
    for h in _all_handles(region):
        if not h.kept:
            continue
        root = h
        if h.ref is not None:  # a value the engine copied owns its copy
            while True:
                b = _base(region, root)
                if b is None or b.ref is None:
                    break
                root = b
        pairs.append((h, root))
    return pairs


def _all_handles(region: Region) -> Iterable[Handle]:
    yield from region.inputs
    for node in region.nodes:
        for o in node.outputs:
            if o is not None:
                yield o


def recompute_key(region: Region, h: Handle) -> Handle | None:
    """The handle whose bytes realizing ``h`` allocates, or ``None`` if it allocates none.

    See Note [Counting kept and recomputed bytes] rule 2.
    """
    while h.node_index >= 0 and not h.kept:
        node = region.nodes[h.node_index]
        if node.info.returns_written:
            w = written_input(node)
            if w is None or w.kept:
                return h  # replayed on a copy of the kept value
            h = w
        elif h.is_view and node.inputs:
            b = node.inputs[0]
            if b.kept:
                return None  # a view of a kept value
            h = b
        else:
            return h
    return None if h.kept else h


@dataclass(frozen=True)
class Chain:
    """What realizing some recomputed values from the nearest kept values involves.

    Attributes:
        nodes: indices of the op nodes that run, in forward order.
        values: the recomputed values involved (the targets and everything they need).
        sources: the kept values the chain starts from (op outputs first, then region
            inputs).
        flops: estimated FLOPs of running ``nodes`` once each.
        nbytes: bytes of memory the recomputed ``values`` occupy (storages counted once).
    """

    nodes: tuple[int, ...]
    values: tuple[Handle, ...]
    sources: tuple[Handle, ...]
    flops: int
    nbytes: int


def recompute_chain(
    region: Region, targets: Iterable[Handle], as_recomputed: Handle | None = None
) -> Chain:
    """The op nodes and values needed to realize ``targets`` from kept values.

    Args:
        region: the region.
        targets: handles to realize; kept ones need nothing (unless ``as_recomputed``).
        as_recomputed: a kept handle to treat as recomputed (the cost of not keeping it).

    Example:
        >>> recompute_chain(region, [h]).flops  # doctest: +SKIP
        8192
    """
    nodes = region.nodes
    g, handles = pass_graph(region)
    values: dict[int, Handle] = {}
    sources: dict[int, Handle] = {}
    walk: list[int] = []
    for h in targets:
        if (h.kept and h is not as_recomputed) or h.node_index < 0:
            sources[id(h)] = h
        elif id(h) not in values:
            values[id(h)] = h
            walk.append(h.number)
    # The pass's walk back (Note [One pass core]), with nothing cached.
    order, need = collect(g, walk, _Kept(handles, as_recomputed))
    for v in need:
        values[id(handles[v])] = handles[v]
    for j in order:
        for i in nodes[j].inputs:
            if id(i) not in values:
                sources[id(i)] = i
    keys: dict[int, int] = {}
    for h in values.values():
        key = recompute_key(region, h) if h is not as_recomputed else h
        if key is not None:
            keys[id(key)] = key.nbytes
    return Chain(
        nodes=tuple(order),
        values=tuple(sorted(values.values(), key=lambda v: (v.node_index, v.output_index))),
        # kept op outputs first: they say more than parameters
        sources=tuple(
            sorted(
                sources.values(), key=lambda v: (v.node_index < 0, v.node_index, value_position(v))
            )
        ),
        flops=sum(node_flops(nodes[i]) for i in order),
        nbytes=sum(keys.values()),
    )


class _Kept(Sequence[bool]):
    """Per value number, whether the chain stops there: a kept value (but ``as_recomputed``)
    or a region input."""

    __slots__ = ("as_recomputed", "handles")

    def __init__(self, handles: list[Handle], as_recomputed: Handle | None) -> None:
        self.handles, self.as_recomputed = handles, as_recomputed

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, v: int) -> bool:  # type: ignore[override]
        h = self.handles[v]
        return (h.kept and h is not self.as_recomputed) or h.node_index < 0


def value_position(h: Handle) -> int:
    """The second half of the ``(op index, position)`` pairs the analysis records name values
    by: ``h``'s output index within its producer, or its position in ``region.inputs`` for a
    region input (op index -1)."""
    return h.output_index if h.node_index >= 0 else h.input_index


def decided_by(region: Region, h: Handle) -> str:
    """Who decided to keep or recompute ``h``: policy name, "tag", engine reason, "input"."""
    if h.reason is not None and h.reason.by_engine:
        return h.reason.value
    if h.reason is KeptReason.TAG or h in region.tagged:
        return "tag"
    if h.node_index < 0:
        return "input"
    return region.nodes[h.node_index].decided_by or "default"


def describe(region: Region, h: Handle) -> str:
    """A short readable name of a value, e.g. ``"output 0 of op #3 aten.mm.default (mlp.0)"``."""
    shape = "x".join(str(s) for s in h.shape) or "scalar"
    dtype = str(h.dtype).removeprefix("torch.")
    if h.node_index < 0:
        return f"region input {h.input_index} [{shape} {dtype}]"
    node = region.nodes[h.node_index]
    where = f" in {node.module_path}" if node.module_path else ""
    return f"output {h.output_index} of op #{node.index} {node.info.name}{where} [{shape} {dtype}]"


def fmt_bytes(n: int) -> str:
    """Bytes in binary units: ``fmt_bytes(3 * 2**20) == "3.00 MiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def fmt_flops(n: int) -> str:
    """FLOPs with an SI prefix: ``fmt_flops(2_500_000) == "2.50 MFLOP"``."""
    value = float(n)
    for unit in ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP"):
        if abs(value) < 1000 or unit == "TFLOP":
            return f"{n} FLOP" if unit == "FLOP" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{n} FLOP"  # pragma: no cover
