"""``summary``: what a region keeps, what it recomputes and what that costs.

See Note [Counting kept and recomputed bytes] in ``analysis/values.py`` for how bytes are
counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt_graph.analysis.values import (
    category,
    decided_by,
    describe,
    fmt_bytes,
    fmt_flops,
    kept_roots,
    recompute_chain,
    storage_root,
)

if TYPE_CHECKING:
    from ckpt_graph.engine.graph import Handle
    from ckpt_graph.engine.region import Region

__all__ = ["RegionSummary", "summary"]

_CATEGORIES = ("input", "policy", "tag", "engine", "snapshot")


@dataclass(frozen=True)
class RegionSummary:
    """What a region keeps, what it recomputes and what that costs.

    Attributes:
        ops: op nodes recorded.
        saved_tensors: tensors autograd saved in the region (each would be kept without
            checkpointing).
        saved_bytes: bytes of the distinct region values autograd saved: roughly what plain
            autograd would keep (region inputs excluded).
        kept_bytes: bytes the region keeps, by reason: ``"input"`` (region inputs:
            parameters, arguments, buffers; always kept, by reference, at no extra cost),
            ``"policy"`` (a policy of the stack
            answered a save decision, or none answered), ``"tag"`` (``tag_with_policy``),
            ``"engine"`` (op outputs the engine keeps for correctness, e.g. in-place ops on
            kept values) and ``"snapshot"`` (values the engine took as they were after an
            in-place change through an alias; they may share memory allocated outside the
            region). Views count nothing of their own.
        kept_by: kept bytes of op outputs by who decided: policy name, ``"tag"``, an engine
            reason, or ``"default"`` (no policy answered). Snapshots are not included.
        unused_kept_bytes: bytes of kept op outputs that no saved tensor and no
            recomputation ever reads (kept for nothing; the engine may free them when
            the forward ends).
        held_bytes: bytes of kept op outputs the region holds right now: what the kept
            values occupy in memory at this point (the engine frees kept values when
            no saved tensor or recomputation needs them any more; 0 after backward).
        largest_kept: up to five ``(value, bytes, decided by)`` of the largest kept values.
        recomputable_bytes: bytes of the recomputed values a full backward realizes: values
            autograd saved that are not kept, and the recomputed values needed to recompute
            them (storages counted once, views of kept values free).
        recompute_ops: op nodes such a backward runs (each once).
        recompute_flops: their estimated FLOPs (``torch.utils.flop_counter``; 0 if unknown).
        rng_state_bytes: bytes of generator states held to replay random ops (0 once the
            region has freed its values).
        backward_passes: backward passes that unpacked a recomputed value.
        recomputed_ops_last_pass: ops recomputed in the last pass.
        recomputed_ops_total: ops recomputed over all passes.
        peak_cached_bytes: highest bytes of recomputed values cached at once in the last
            pass, as the engine counts them (every cached handle, views included).
        opened_by: the integration that opened the region (``Region.opened_by``), or ``""``.

    Example:
        >>> s = region.summary()
        >>> s.kept_bytes["policy"], s.recompute_flops  # doctest: +SKIP
        (4096, 131072)
    """

    ops: int
    saved_tensors: int
    saved_bytes: int
    kept_bytes: dict[str, int]
    kept_by: dict[str, int]
    unused_kept_bytes: int
    held_bytes: int
    largest_kept: tuple[tuple[str, int, str], ...]
    recomputable_bytes: int
    recompute_ops: int
    recompute_flops: int
    rng_state_bytes: int
    backward_passes: int
    recomputed_ops_last_pass: int
    recomputed_ops_total: int
    peak_cached_bytes: int
    opened_by: str = ""

    @property
    def total_kept_bytes(self) -> int:
        """Bytes of op outputs kept by policies, tags and the engine (not inputs, snapshots)."""
        return sum(v for k, v in self.kept_bytes.items() if k not in ("input", "snapshot"))

    def __str__(self) -> str:
        rows: list[tuple[str, str]] = [("opened by", self.opened_by)] if self.opened_by else []
        rows += [
            ("ops recorded", str(self.ops)),
            ("tensors saved by autograd", f"{self.saved_tensors} ({fmt_bytes(self.saved_bytes)})"),
            ("region inputs (kept by reference)", fmt_bytes(self.kept_bytes["input"])),
            ("kept op outputs", fmt_bytes(self.total_kept_bytes)),
        ]
        rows += [
            (f"  by {k}", fmt_bytes(v))
            for k, v in self.kept_bytes.items()
            if v and k not in ("input", "snapshot")
        ]
        rows += [(f"  decided by {k}", fmt_bytes(v)) for k, v in self.kept_by.items()]
        if self.unused_kept_bytes:
            rows.append(("  kept but never read", fmt_bytes(self.unused_kept_bytes)))
        rows.append(("  held now", fmt_bytes(self.held_bytes)))
        if self.kept_bytes.get("snapshot"):
            rows.append(
                ("engine snapshots (may alias inputs)", fmt_bytes(self.kept_bytes["snapshot"]))
            )
        if self.rng_state_bytes:
            rows.append(("RNG states held", fmt_bytes(self.rng_state_bytes)))
        rows += [
            ("recomputable", fmt_bytes(self.recomputable_bytes)),
            ("recompute ops (one backward)", str(self.recompute_ops)),
            ("recompute FLOPs (estimate)", fmt_flops(self.recompute_flops)),
        ]
        if self.backward_passes:
            rows += [
                ("backward passes", str(self.backward_passes)),
                ("ops recomputed (last pass)", str(self.recomputed_ops_last_pass)),
                ("ops recomputed (all passes)", str(self.recomputed_ops_total)),
                ("peak cached recomputed bytes", fmt_bytes(self.peak_cached_bytes)),
            ]
        width = max(len(name) for name, _ in rows)
        lines = ["RegionSummary"] + [f"  {name:<{width}}  {value}" for name, value in rows]
        if self.largest_kept:
            lines.append("  largest kept values:")
            lines += [f"    {fmt_bytes(n):>10}  {v}  ({by})" for v, n, by in self.largest_kept]
        return "\n".join(lines)


def summary(region: Region) -> RegionSummary:
    """What ``region`` keeps, what it recomputes and what that costs.

    Example:
        >>> print(region.summary())  # doctest: +SKIP
        RegionSummary
          ops recorded                       18
          ...
    """
    saved = {id(h): h for _, h in region.saved}
    saved_roots: dict[int, Handle] = {}
    for h in saved.values():
        root = storage_root(region, h)
        if root.node_index >= 0:
            saved_roots[id(root)] = root
    chain = recompute_chain(region, [h for h in saved.values() if not h.kept])
    read = set(saved) | {id(h) for h in chain.sources}

    kept = dict.fromkeys(_CATEGORIES, 0)
    kept_by: dict[str, int] = {}
    roots: dict[int, tuple[Handle, Handle]] = {}
    used: set[int] = set()
    held: set[int] = set()
    for h, root in kept_roots(region):
        if id(h) in read:
            used.add(id(root))
        if h.value is not None:
            held.add(id(root))
        if h.reason == "input":
            kept["input"] += h.nbytes
            continue
        if id(root) in roots:
            continue
        if root is not h and root.node_index < 0:
            continue  # a view of a region input: no memory of its own
        roots[id(root)] = (h, root)
        kind = category(h.reason, h)
        kept[kind] += root.nbytes
        if kind != "snapshot":
            who = decided_by(region, h)
            kept_by[who] = kept_by.get(who, 0) + root.nbytes
    own = {k: p for k, p in roots.items() if category(p[0].reason, p[0]) != "snapshot"}
    largest = sorted(own.values(), key=lambda p: -p[1].nbytes)[:5]
    return RegionSummary(
        ops=len(region.nodes),
        saved_tensors=len(region.saved),
        saved_bytes=sum(h.nbytes for h in saved_roots.values()),
        kept_bytes=kept,
        kept_by=dict(sorted(kept_by.items(), key=lambda kv: -kv[1])),
        unused_kept_bytes=sum(r.nbytes for k, (_, r) in own.items() if k not in used),
        held_bytes=sum(r.nbytes for k, (_, r) in own.items() if k in held),
        largest_kept=tuple(
            (describe(region, h), r.nbytes, decided_by(region, h)) for h, r in largest
        ),
        recomputable_bytes=chain.nbytes,
        recompute_ops=len(chain.nodes),
        recompute_flops=chain.flops,
        rng_state_bytes=sum(  # random ops that drew nothing share one state tensor
            {id(n.rng[1]): n.rng[1].nbytes for n in region.nodes if n.rng is not None}.values()
        ),
        backward_passes=region.pass_state.number,
        recomputed_ops_last_pass=region.pass_state.recomputed_ops,
        recomputed_ops_total=sum(n.realized for n in region.nodes),
        peak_cached_bytes=region.pass_state.peak_cached_bytes,
        opened_by=region.opened_by,
    )
