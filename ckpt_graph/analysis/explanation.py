"""``explain``: why one value of a region is kept or recomputed, and what recomputing costs.

See Note [Counting kept and recomputed bytes] in ``analysis/values.py`` for how bytes are
counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ckpt_graph._errors import CkptGraphTypeError, CkptGraphValueError
from ckpt_graph.analysis.values import (
    decided_by,
    describe,
    fmt_bytes,
    fmt_flops,
    recompute_chain,
    storage_root,
    value_position,
)

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle
    from ckpt_graph.engine.region import Region

__all__ = ["Explanation", "explain"]


@dataclass(frozen=True)
class Explanation:
    """Why one value of a region is kept or recomputed, and what recomputing it costs.

    Attributes:
        value: readable name of the value (producer op, output index, module, shape).
        op_index: index of the producing op node (-1 for a region input).
        output_index: output index within the producer (input position for region inputs).
        nbytes: bytes of the value.
        kept: whether the region keeps it.
        reason: the kept reason (``"input"``, ``"policy"``, ``"tag"``, ``"engine: ..."``)
            or ``None`` when it is recomputed.
        decision: the producer's resolved ``CheckpointPolicy`` name (``""`` for inputs).
        decided_by: the policy's name, ``"tag"``, an engine reason, ``"input"`` or
            ``"default"`` (no policy answered).
        why: one or two sentences saying why.
        saved_count: how many times autograd saved this value for backward.
        saved_aliases: how many times autograd saved another value sharing its storage (a
            view of it, or an in-place version): those keep or recompute it too.
        consumers: how many recorded ops read it in the forward.
        recompute_ops: ops that run to recompute it from the nearest kept values (for a kept
            value: what it would cost if it were not kept).
        recompute_flops: their estimated FLOPs.
        recompute_bytes: bytes of the recomputed values on that chain (cached while needed).
        chain: names of those ops, in forward order.
        sources: the kept values the chain starts from.
        realized: times its producer ran in backward passes.
        needed: whether backward needs the value: autograd saved it (or a view or version
            of it), or recomputing a saved value reads it. A kept value that is not needed
            is wasted memory; a recomputed one that is not needed is never recomputed.

    Example:
        >>> print(region.explain(h))  # doctest: +SKIP
        output 0 of op #4 aten.addmm.default in blocks.0.0 [4x16 float64]: kept (policy)
        ...
    """

    value: str
    op_index: int
    output_index: int
    nbytes: int
    kept: bool
    reason: str | None
    decision: str
    decided_by: str
    why: str
    saved_count: int
    saved_aliases: int
    consumers: int
    recompute_ops: int
    recompute_flops: int
    recompute_bytes: int
    chain: tuple[str, ...] = field(default=())
    sources: tuple[str, ...] = field(default=())
    realized: int = 0
    needed: bool = True

    def __str__(self) -> str:
        state = f"kept ({self.reason})" if self.kept else "recomputed"
        lines = [f"{self.value}: {state}, {fmt_bytes(self.nbytes)}", f"  why: {self.why}"]
        aliases = f" (views or versions of it: {self.saved_aliases})" if self.saved_aliases else ""
        lines.append(
            f"  autograd saved it {self.saved_count} time(s){aliases}; {self.consumers} "
            "recorded op(s) read it"
        )
        if not self.needed:
            lines.append(
                "  backward never reads it: keeping it wastes memory"
                if self.kept
                else "  backward never needs it: it is not recomputed"
            )
        if self.op_index >= 0:
            cost = (
                "recomputing it costs"
                if self.needed and not self.kept
                else "recomputing it would cost"
            )
            lines.append(
                f"  {cost} {self.recompute_ops} op(s), {fmt_flops(self.recompute_flops)}, "
                f"{fmt_bytes(self.recompute_bytes)} of recomputed values"
            )
            if self.chain:
                shown = list(self.chain[:8]) + (["..."] if len(self.chain) > 8 else [])
                lines.append(f"  chain: {' -> '.join(shown)}")
            if self.sources:
                more = f" and {len(self.sources) - 4} more" if len(self.sources) > 4 else ""
                lines.append(f"  from kept values: {'; '.join(self.sources[:4])}{more}")
            if self.realized:
                lines.append(f"  its op ran {self.realized} time(s) in backward")
        return "\n".join(lines)


def _why(region: Region, h: Handle) -> str:
    if h.node_index < 0:
        if h.reason == "input":
            return (
                "a region input (parameter, argument or buffer from outside the region): "
                "inputs are always kept, by reference"
            )
        return f"{h.reason}: the engine took the value as it was when an op read it"
    node = region.nodes[h.node_index]
    decision = getattr(node.decision, "name", str(node.decision))
    by = node.decided_by
    if h.reason is not None and h.reason.by_engine:
        return f"{h.reason}; the engine keeps it whatever the policies said ({decision})"
    if h.reason == "tag":
        return "tag_with_policy() on this value asked to keep it"
    if h in region.tagged and h.reason is None:
        return "tag_with_policy() on this value asked to recompute it"
    if not by:
        return f"no policy answered for {node.info.name}: the default {decision} keeps it"
    verb = "keeps" if h.kept else "recomputes"
    return f"policy {by} answered {decision} for {node.info.name}, which {verb} it"


def explain(region: Region, tensor: torch.Tensor) -> Explanation:
    """Why ``tensor``'s value is kept or recomputed in ``region``, and what recomputing costs.

    Raises:
        TypeError: if ``tensor`` is not a tensor.
        ValueError: if the region never saw ``tensor`` (not an input or output of a
            recorded op), or it was freed or changed in place since.

    Example:
        >>> print(region.explain(h))  # doctest: +SKIP
    """
    if not isinstance(tensor, torch.Tensor):
        raise CkptGraphTypeError(
            f"ckpt_graph: explain() needs a torch.Tensor, got {type(tensor).__name__}"
        )
    h = region.lookup(tensor)
    if h is None:
        shape = "x".join(str(s) for s in tensor.shape) or "scalar"
        raise CkptGraphValueError(
            f"ckpt_graph: explain(): this tensor [{shape} {tensor.dtype}] was never seen in the "
            "region (no recorded op read or produced it); pass a tensor computed or used inside "
            "the `with save_recompute_policy(...)` block"
        )
    saved_count = sum(1 for _, s in region.saved if s is h)
    root = storage_root(region, h)
    saved_aliases = sum(
        1 for _, s in region.saved if s is not h and storage_root(region, s) is root
    )
    consumers = sum(1 for node in region.nodes if any(i is h for i in node.inputs))
    full = recompute_chain(region, [s for _, s in region.saved if not s.kept])
    needed = (
        saved_count + saved_aliases > 0
        or any(v is h for v in full.values)
        or any(v is h for v in full.sources)
    )
    if h.node_index < 0:
        chain = recompute_chain(region, [])
        decision, realized = "", 0
    else:
        chain = recompute_chain(region, [h], as_recomputed=h if h.kept else None)
        node = region.nodes[h.node_index]
        decision = getattr(node.decision, "name", str(node.decision))
        realized = node.realized
    return Explanation(
        value=describe(region, h),
        op_index=h.node_index,
        output_index=value_position(h),
        nbytes=h.nbytes,
        kept=h.kept,
        reason=h.reason,
        decision=decision,
        decided_by=decided_by(region, h),
        why=_why(region, h),
        saved_count=saved_count,
        saved_aliases=saved_aliases,
        consumers=consumers,
        recompute_ops=len(chain.nodes),
        recompute_flops=chain.flops,
        recompute_bytes=chain.nbytes,
        chain=tuple(f"#{i} {region.nodes[i].info.name}" for i in chain.nodes),
        sources=tuple(describe(region, s) for s in chain.sources),
        realized=realized,
        needed=needed,
    )
