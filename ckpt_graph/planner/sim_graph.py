"""The simulator's graph: values, ops and saved tensors of a region, without framework
objects, and the result of one simulated pass (see Note [Backward liveness model] in
``liveness.py``). Planners and their tests build these directly or with
``from_region.from_region``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from ckpt_graph.engine.pass_graph import PassGraph

__all__ = ["SimGraph", "SimOp", "SimResult", "SimValue", "with_before_backward"]


@dataclass(frozen=True)
class SimValue:
    """One value: an op output or a region input.

    Attributes:
        nbytes: bytes of the value's storage if it owns it (ignored for views).
        producer: index of the producing op, -1 for a region input.
        storage: id of the value owning the storage (itself unless a view).
        is_view: whether the engine sees the value as a view (rule 7); ``None`` means
            ``storage`` differs from its own id (an in-place result sharing the storage of
            the old version is not a view).
        copied: a region input the region holds as a copy taken before a write of the
            region (batch norm's running statistics): its bytes count (rule 3).
    """

    nbytes: int
    producer: int
    storage: int
    is_view: bool | None = None
    copied: bool = False


@dataclass(frozen=True)
class SimOp:
    """One op: value ids in and out, and its recompute cost.

    Attributes:
        inputs: distinct value ids it reads.
        outputs: value ids it makes (tensor outputs only).
        cost: recompute cost of one run.
        name: op name, for reports.
        workspace: bytes its backward formula allocates beyond the input gradients (rule 4).
        run_workspace: bytes it allocates beyond its outputs when it runs again (rule 4).
        pointwise: it may run again at each use of its value (rule 7): elementwise, not
            random, not in place, one output.
        rng: index in ``SimGraph.rng_bytes`` of the generator state it replays with (rule
            9), -1 if it is not random; random ops that share one state share the index.
    """

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    cost: int
    name: str = ""
    workspace: int = 0
    run_workspace: int = 0
    pointwise: bool = False
    rng: int = -1


@dataclass(frozen=True)
class SimGraph:
    """A region's graph as the simulator sees it (no framework objects).

    Attributes:
        values: every value, indexed by id.
        ops: the ops in forward (topological) order.
        saved: ``(step op index, value id)`` per saved tensor, in forward order.
        fixed: value ids kept whatever the plan says (region inputs are always kept).
        step_grad_bytes: gradient bytes alive at each step (op index), see Note [Backward
            liveness model] rule 4; empty for graphs without gradients.
        transient_min_bytes: smaller values are never transient (rule 7; the engine's
            ``passes.TRANSIENT_MIN_BYTES``).
        cache_limit: the region's ``cache_limit`` (rule 8); ``"unbounded"`` caches every
            recomputed value until its last use.
        rng_bytes: bytes of each generator state random ops hold (rule 9).
        step_grad_in_bytes: gradient bytes alive while a step unpacks its saved tensors,
            before its formula allocates its inputs' gradients (rule 4); a step missing
            here counts ``step_grad_bytes``.
        bound_min_bytes: an automatic bound (``cache_limit=None``) leaves a pass unbounded
            when its first caching realize caches less (rule 8; the engine's
            ``cache_bound.BOUND_MIN_BYTES``).
        param_grad_bytes: parameters' gradient buffers the region's backward makes (their
            ``.grad`` was ``None``), alive after it to the end of the training step (rule
            10).
        param_grad_steps: bytes of those buffers alive at each step of the region's
            backward (rule 10), on top of ``step_grad_bytes``.
        param_grad_made: bytes of them a step makes (a copy of a shared or transposed
            gradient), not yet there while it unpacks.
        before_backward_bytes: memory outside the region on top of its kept values when its
            backward starts (the loss's backward outside it), as a measured step found it
            (Note [Phases of a measured step]); 0 when not known.

    Example:
        >>> from ckpt_graph.planner.liveness import simulate
        >>> g = SimGraph(
        ...     values=(SimValue(8, -1, 0), SimValue(8, 0, 1), SimValue(8, 1, 2)),
        ...     ops=(SimOp((0,), (1,), 5), SimOp((1,), (2,), 5)),
        ...     saved=((1, 1), (1, 2)),
        ... )
        >>> simulate(g, []).recompute_cost, simulate(g, [0, 1]).peak_bytes
        (10, 16)
    """

    values: tuple[SimValue, ...]
    ops: tuple[SimOp, ...]
    saved: tuple[tuple[int, int], ...]
    fixed: frozenset[int] = frozenset()
    step_grad_bytes: Mapping[int, int] = field(default_factory=dict)
    transient_min_bytes: int = 0
    cache_limit: int | str | None = "unbounded"
    rng_bytes: tuple[int, ...] = ()
    step_grad_in_bytes: Mapping[int, int] = field(default_factory=dict)
    bound_min_bytes: int = 0
    param_grad_bytes: int = 0
    param_grad_steps: Mapping[int, int] = field(default_factory=dict)
    param_grad_made: Mapping[int, int] = field(default_factory=dict)
    before_backward_bytes: int = 0

    @cached_property
    def pass_graph(self) -> PassGraph:
        """The graph as the pass rules see it (``engine.pass_core``), built once."""
        values, ops = self.values, self.ops
        view = tuple(
            v.storage != k if v.is_view is None else v.is_view for k, v in enumerate(values)
        )
        has_views = [False] * len(values)
        for k, v in enumerate(values):
            if view[k]:
                has_views[v.storage] = True
        return PassGraph(
            inputs=tuple(op.inputs for op in ops),
            outputs=tuple(op.outputs for op in ops),
            producer=tuple(v.producer for v in values),
            nbytes=tuple(v.nbytes for v in values),
            view=view,
            has_views=tuple(has_views),
            transient_ok=tuple(op.pointwise and len(op.outputs) == 1 for op in ops),
        )

    def saved_bytes(self) -> int:
        """Activation bytes kept without checkpointing: distinct op-made saved storages."""
        roots = {self.values[v].storage for _, v in self.saved}
        return sum(self.values[s].nbytes for s in roots if self.values[s].producer >= 0)


def with_before_backward(g: SimGraph, nbytes: int) -> SimGraph:
    """``g`` with ``before_backward_bytes=nbytes`` (``g`` itself when it has them), sharing
    its pass graph. See Note [Phases of a measured step]."""
    if g.before_backward_bytes == nbytes:
        return g
    new = replace(g, before_backward_bytes=nbytes)
    built = g.__dict__.get("pass_graph")
    if built is not None:  # a cached_property: set as ``functools`` sets it
        new.__dict__["pass_graph"] = built
    return new


@dataclass(frozen=True)
class SimResult:
    """What one simulated backward pass costs.

    Attributes:
        peak_bytes: highest activation memory (kept + cached + held storages).
        peak_total_bytes: highest activation + gradient + workspace + generator state
            memory (rules 4 and 9).
        kept_bytes: storages of kept values some saved tensor still needs when backward starts.
        recompute_cost: summed cost of the op runs in backward.
        recomputed_ops: number of op runs in backward (the producer of a transient value
            counts once per run, as ``PassState.recomputed_ops``).
        peak_step: op index of the step where ``peak_total_bytes`` was reached (-1 if none).
        runs: runs of each op in backward (``OpNode.realized`` of one pass).
    """

    peak_bytes: int
    peak_total_bytes: int
    kept_bytes: int
    recompute_cost: int
    recomputed_ops: int
    peak_step: int
    runs: tuple[int, ...] = ()
