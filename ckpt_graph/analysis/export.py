"""A region's recorded graph as records, a networkx graph, or Graphviz DOT.

Byte counts follow Note [Counting kept and recomputed bytes] in ``analysis/values.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ckpt_graph.analysis.values import category, fmt_bytes, value_position
from ckpt_graph.engine.flops import node_flops

if TYPE_CHECKING:
    import networkx as nx

    from ckpt_graph.engine.graph import Handle, OpNode
    from ckpt_graph.engine.region import Region

__all__ = ["OpRecord", "graph", "to_dot", "to_networkx"]


@dataclass(frozen=True)
class OpRecord:
    """One op node of a region's recorded graph, as plain data.

    Attributes:
        index: position in the region's forward (0-based).
        op: the aten op, e.g. ``"aten.mm.default"``.
        module_path: qualified name of the module running the op (``""`` outside modules).
        shapes: per output, its shape (``None`` for a non-tensor output).
        dtypes: per output, its dtype name, e.g. ``"float32"`` (``None`` for non-tensors).
        out_bytes: per output, its bytes (0 for non-tensors; views report their own size).
        decision: the resolved ``CheckpointPolicy`` name, e.g. ``"PREFER_RECOMPUTE"``.
        decided_by: who decided: the policy's name, ``"tag"`` when every tensor output
            was tagged (tags are per value: ``region.explain`` tells for one output), an
            engine reason (``"engine: ..."``) when the engine kept an output whatever the
            policies said, or ``"default"`` when no policy answered (plain autograd: keep).
        kept: per output, why it is kept (``"policy"``, ``"tag"``, ``"engine: ..."``) or
            ``None`` when it is recomputed (also ``None`` for non-tensor outputs).
        inputs: the values the op read, as ``(producer op index, output index)``; region
            inputs are ``(-1, position in region.inputs)``.
        flops: estimated FLOPs of one run (``torch.utils.flop_counter`` formulas; 0 if
            unknown).
        realized: how many times the op ran during backward passes (all passes).
        is_random: the op draws random numbers (replayed with the forward's generator state).
        is_inplace: the op writes one of its arguments.
    """

    index: int
    op: str
    module_path: str
    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[str | None, ...]
    out_bytes: tuple[int, ...]
    decision: str
    decided_by: str
    kept: tuple[str | None, ...]
    inputs: tuple[tuple[int, int], ...]
    flops: int
    realized: int
    is_random: bool
    is_inplace: bool

    @property
    def is_kept(self) -> bool:
        """Whether any tensor output of the op is kept."""
        return any(k is not None for k in self.kept)


def _decided_by(node: OpNode, tagged: set[Handle]) -> str:
    outs = [o for o in node.outputs if o is not None]
    for o in outs:
        if o.reason is not None and o.reason.by_engine:
            return o.reason.value
    if outs and all(o in tagged for o in outs):
        return "tag"
    return node.decided_by or "default"


def _record(node: OpNode, tagged: set[Handle]) -> OpRecord:
    outs = node.outputs
    return OpRecord(
        index=node.index,
        op=node.info.name,
        module_path=node.module_path,
        shapes=tuple(tuple(o.shape) if o is not None else None for o in outs),
        dtypes=tuple(str(o.dtype).removeprefix("torch.") if o is not None else None for o in outs),
        out_bytes=tuple(o.nbytes if o is not None else 0 for o in outs),
        decision=getattr(node.decision, "name", str(node.decision)),
        decided_by=_decided_by(node, tagged),
        kept=tuple(o.reason if o is not None else None for o in outs),
        inputs=tuple((h.node_index, value_position(h)) for h in node.inputs),
        flops=node_flops(node),
        realized=node.realized,
        is_random=node.info.is_random,
        is_inplace=node.info.is_inplace,
    )


def graph(region: Region) -> tuple[OpRecord, ...]:
    """The region's recorded graph: one :class:`OpRecord` per op node, in forward order.

    Example:
        >>> [(r.op, r.decision) for r in region.graph][:2]  # doctest: +SKIP
        [('aten.t.default', 'PREFER_RECOMPUTE'), ('aten.addmm.default', 'MUST_SAVE')]
    """
    return tuple(_record(node, region.tagged) for node in region.nodes)


def _input_attrs(h: Handle) -> dict[str, Any]:
    return {
        "kind": "input",
        "shape": tuple(h.shape),
        "dtype": str(h.dtype).removeprefix("torch."),
        "nbytes": h.nbytes,
        "kept": h.reason,
        "category": category(h.reason, h),
    }


_FIELDS = tuple(f.name for f in fields(OpRecord))


def _value_node(h: Handle) -> int | tuple[str, int]:
    return h.node_index if h.node_index >= 0 else ("input", h.input_index)


def to_networkx(region: Region) -> nx.DiGraph:
    """The recorded graph as a ``networkx.DiGraph``.

    Op nodes are keyed by their index, with the fields of :class:`OpRecord` as attributes
    (plus ``kind="op"``). Region inputs (parameters, arguments, engine snapshots) are
    source nodes keyed ``("input", i)``, with ``kind="input"``, ``shape``, ``dtype``,
    ``nbytes`` and ``kept``. Each edge goes from the producer of values to an op that
    read them, with attributes ``outputs`` (indices of those values among the producer's
    outputs; usually one), ``nbytes`` (their total bytes) and ``kept`` (per value, its
    kept reason or ``None``).

    Example:
        >>> g = region.to_networkx()
        >>> sum(d["nbytes"] for _, _, d in g.in_edges(5, data=True))  # doctest: +SKIP
        2048
    """
    import networkx as nx

    g = nx.DiGraph()
    for h in region.inputs:
        g.add_node(("input", h.input_index), **_input_attrs(h))
    for node in region.nodes:
        record = _record(node, region.tagged)
        g.add_node(node.index, kind="op", **{f: getattr(record, f) for f in _FIELDS})
        for h in node.inputs:
            src = _value_node(h)
            if g.has_edge(src, node.index):  # several outputs of one producer (split -> cat)
                edge = g.edges[src, node.index]
                edge["outputs"] += (value_position(h),)
                edge["nbytes"] += h.nbytes
                edge["kept"] += (h.reason,)
            else:
                g.add_edge(
                    src, node.index, outputs=(value_position(h),), nbytes=h.nbytes, kept=(h.reason,)
                )
    return g


# Fill colours of DOT nodes.
_KEPT, _RECOMPUTED, _INPUT, _ENGINE = "#9ad08f", "#f7b77a", "#d9d9d9", "#6cb4e4"


def _dot_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def to_dot(region: Region) -> str:
    """The recorded graph as Graphviz DOT text (no graphviz needed to produce it).

    Op nodes whose outputs are kept by a policy or a tag are green, those kept by the
    engine blue, recomputed ones orange, region inputs grey; edges are labelled with the
    bytes of the value they carry. Render with ``dot -Tsvg region.dot -o region.svg``.

    Example:
        >>> Path("region.dot").write_text(region.to_dot())  # doctest: +SKIP
    """
    lines = [
        "digraph region {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8];',
    ]
    for h in region.inputs:
        shape = "x".join(str(s) for s in h.shape) or "scalar"
        label = f"input {h.input_index}\\n[{shape}]"
        if h.reason is not None and h.reason != "input":
            label += "\\nsnapshot"
        lines.append(f'  in{h.input_index} [label="{label}", shape=ellipse, fillcolor="{_INPUT}"];')
    for node in region.nodes:
        reasons = [o.reason for o in node.outputs if o is not None and o.reason is not None]
        if any(r.by_engine for r in reasons):
            colour, state = _ENGINE, "kept (engine)"
        elif reasons:
            colour, state = _KEPT, f"kept ({reasons[0]})"
        else:
            colour, state = _RECOMPUTED, "recomputed"
        shapes = ", ".join(
            "x".join(str(s) for s in o.shape) or "scalar" for o in node.outputs if o is not None
        )
        parts = [f"#{node.index} {node.info.name}"]
        if node.module_path:
            parts.append(node.module_path)
        parts += [f"[{shapes}]", state]
        label = "\\n".join(_dot_escape(p) for p in parts)
        lines.append(f'  op{node.index} [label="{label}", fillcolor="{colour}"];')
        for h in node.inputs:
            src = f"op{h.node_index}" if h.node_index >= 0 else f"in{h.input_index}"
            lines.append(f'  {src} -> op{node.index} [label="{fmt_bytes(h.nbytes)}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
