"""``memory_budget(budget)``: keep what fits a memory budget with the least recompute.

# Note [Memory budget policy]
# 1. Budget. An int (or a string with a unit) is bytes; a float in (0, 1] is a fraction
#    (see Note [Budget argument]) of the activation memory the region would keep without
#    checkpointing: the distinct storages of the values
#    autograd saves that the region's ops produce (``SimGraph.saved_bytes``). It bounds
#    the *simulated activation peak of backward* (kept + cached + held recomputed values,
#    see Note [Backward liveness model]); gradient buffers are reported, not budgeted.
#    Each region is budgeted separately (per-layer regions each get the budget).
# 2. First step: no plan exists, so the online heuristic decides (rule 5) while the region
#    records the graph, with each op's FLOPs (``ctx.flops``) and, for ops without a FLOP
#    formula, the bytes it reads and writes: its recompute cost (Note [Recompute cost
#    model]). At the region's exit the solver (Note [Memory budget planning]) plans the
#    kept ops for the next steps, starting also from the hand plans of Note [Hand seeds].
# 3. Plans are keyed by the region's *ordinal within a step*: a step starts when a region
#    is entered after every region of the previous one ran its backward or was released.
#    A region first tries the plan of its ordinal, then any other plan (identical layers
#    under per-layer regions share one), following each op's signature (op name and
#    output shapes): answers come from the first plan still matching. A region that
#    diverges from every plan (or ends early) falls back to the heuristic for the rest,
#    and is planned again at exit; if its ordinal had a plan, the graph changed: warn once.
# 4. Nesting. The policy decides only for the ops recorded while its own block is open
#    (from ``on_region_enter`` to ``on_region_exit``), answering MUST_SAVE for kept ops
#    (an inner "recompute the rest" policy cannot undo it) and PREFER_RECOMPUTE otherwise
#    (an inner policy may still keep more). Ops whose outcome differs from its answer
#    (another policy's MUST_*, a tag, values the engine keeps) are fixed in the plan and
#    their memory counts against the budget. Entering the same policy object again inside
#    its own block is a no-op: the outer block plans.
# 5. Heuristic (no plan, or a changed graph), decided per op as it is recorded:
#    a. Allowance: the budget for an int; budget x saved bytes so far for a fraction (the
#       total is unknown before the region ends; views count as their base's storage), so
#       more is kept later in the forward, where backward starts. Kept bytes never pass it.
#    b. Chains: for each recomputed value the policy tracks the set of recomputed op outputs
#       backward must run to recompute it (its inputs' sets, stopping at kept values) and
#       their bytes (``chain``): roughly what realizing it caches at once. A value whose
#       chain reaches ``_SEGMENT`` x allowance or ``_CHAIN_OPS`` ops is kept (a periodic
#       keep: its consumers start new chains; the op bound also bounds the bookkeeping). On
#       a transformer these are mostly residual-stream values, which cut every later chain.
#       (Before: a residual-add rule plus keeping whatever op came after N ops; on a 4-layer
#       GPT at 20% that first step peaked at 3.6x the budget.)
#    c. Expensive ops first: other values are kept while kept bytes + the value + the
#       longest chain left recomputed so far (the reserve for backward's cached values) stay
#       within the allowance for ops with a FLOP formula (matmuls, convolutions, attention:
#       many FLOPs per byte), within ``_CHEAP`` x allowance for the others.
#    In-place ops, views and ops without tensor outputs are recomputed. Measured (zoo, GPTs:
#    tests/test_budget.py, benchmarks/results_budget.md): the first step's simulated peak is
#    0.8-1.3x the budget where a plan can fit it (before: up to 3.6x, and 0.2x at 90%); its
#    recompute is 1.2-2.0x the plan's at 20-40% on the benchmark's 12-layer GPT but far
#    above it at 60-90%, where the plan recomputes only cheap ops (the reserve in c stays
#    conservative, and the first matmuls do not fit the allowance yet).
# 6. Signatures skip ``aten.detach`` ops (always recomputed: views, no memory): keeping a
#    value can make the engine record one (core_bugs.md), which would shift positions
#    between a step decided by the heuristic and one decided by the plan.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .._errors import CkptGraphError
from .._liveness import from_region, simulate
from ._budget_cost import calibrated_flops_per_byte, op_cost, parse_budget
from ._budget_seeds import block_ids, hand_seeds
from ._budget_solve import KeptTensor, PlanReport, candidate_ops, solve

if TYPE_CHECKING:
    from ..region import Region

__all__ = ["KeptTensor", "MemoryBudget", "PlanReport", "memory_budget"]

_CHAIN_OPS = 200
_CHEAP = 0.9
_DETACH = "aten.detach.default"
_SEGMENT = 0.3
Signature = tuple[str, tuple[tuple[int, ...], ...]]


@dataclass
class _Plan:
    signature: tuple[Signature, ...]
    kept: frozenset[int]  # signature positions (see rule 6 of Note [Memory budget policy])
    report: PlanReport


@dataclass
class _Run:
    """State of one open block of the policy in one region."""

    start: int
    ordinal: int
    kept_at_enter: int
    plans: list[_Plan]
    depth: int = 1
    signature: list[Signature] = field(default_factory=list)
    costs: dict[int, int] = field(default_factory=dict)
    moved: dict[int, int] = field(default_factory=dict)  # bytes read + written per op
    answers: dict[int, bool] = field(default_factory=dict)
    heuristic: bool = False
    diverged_at: int = -1
    saved_seen: int = 0
    saved_bytes: int = 0
    chain: dict[int, frozenset[int]] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)
    longest: int = 0
    seen: set[int] = field(default_factory=set)
    positions: dict[int, int] = field(default_factory=dict)


class MemoryBudget:
    """The policy object returned by :func:`memory_budget`. See Note [Memory budget policy].

    Known limitations:
        The budget bounds the simulated activation memory, not backward temporaries or
        gradients; the simulator's unpack order is autograd's usual one for a region
        (reverse forward order). Plans are per region, not across regions.
    """

    def __init__(self, budget: int | float | str, *, flops_per_byte: float | None = None) -> None:
        self.budget: int | float = parse_budget(budget)
        if flops_per_byte is not None and not flops_per_byte >= 0:
            raise CkptGraphError(
                f"ckpt_graph: memory_budget(flops_per_byte={flops_per_byte!r}) must be >= 0 "
                "(FLOPs one byte moved costs); leave it None to calibrate on this machine"
            )
        self.flops_per_byte = flops_per_byte
        self._plans: dict[int, _Plan] = {}
        self._runs: dict[int, _Run] = {}
        self._step: list[weakref.ref[Region]] = []
        self._last: PlanReport | None = None
        self._warned = False

    def __repr__(self) -> str:
        return f"memory_budget({self.budget!r})"

    # ---------------------------------------------------------------- region hooks
    def on_region_enter(self, region: Region) -> None:
        """Start deciding for the ops of ``region`` recorded from now on."""
        run = self._runs.get(id(region))
        if run is not None:
            run.depth += 1
            return
        if all(_done(r()) for r in self._step):
            self._step = []
        ordinal = len(self._step)
        self._step.append(weakref.ref(region))
        own = self._plans.get(ordinal)
        plans = ([own] if own is not None else []) + [
            p for p in self._plans.values() if p is not own
        ]
        self._runs[id(region)] = _Run(len(region.nodes), ordinal, region.kept_bytes, plans)

    def on_region_exit(self, region: Region) -> None:
        """Plan the block's ops for the next steps unless a plan matched it fully."""
        run = self._runs.get(id(region))
        if run is None:
            return
        run.depth -= 1
        if run.depth > 0:
            return
        del self._runs[id(region)]
        matched = [p for p in run.plans if len(p.signature) == len(run.signature)]
        if matched and not run.heuristic:
            plan = matched[0]
            plan.report = replace(plan.report, reuses=plan.report.reuses + 1)
            self._plans.setdefault(run.ordinal, plan)
            self._last = plan.report
            return
        old = self._plans.get(run.ordinal)
        if old is not None and not self._warned:
            self._warned = True
            at = run.diverged_at if run.diverged_at >= 0 else len(region.nodes)
            warnings.warn(
                f"ckpt_graph: memory_budget({self.budget!r}): the graph of region #{run.ordinal} "
                f"of this step differs from the planned one (first at op #{at}); "
                "this step used the online heuristic from there, and the region was planned "
                "again for the next steps (warned once per policy)",
                stacklevel=2,
            )
        plan = self._plan(region, run)
        self._plans[run.ordinal] = plan
        self._last = plan.report

    # ---------------------------------------------------------------- decisions
    def __call__(
        self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | None:
        """MUST_SAVE for the ops to keep, PREFER_RECOMPUTE for the others."""
        region = ctx.region
        run = self._runs.get(id(region))
        if run is None:  # called without on_region_enter: start here
            self.on_region_enter(region)
            run = self._runs[id(region)]
            run.start = ctx.op_index
        flops = ctx.flops
        run.costs[ctx.op_index] = flops  # see Note [Recompute cost model]
        if flops <= 0:
            run.moved[ctx.op_index] = ctx.out_bytes + sum(
                t.numel() * t.element_size() for t in _tensors(args)
            )
        if ctx.op_name == _DETACH:  # see rule 6 of Note [Memory budget policy]
            run.answers[ctx.op_index] = False
            return CheckpointPolicy.PREFER_RECOMPUTE
        pos = len(run.signature)
        sig = (ctx.op_name, _shapes(out))
        run.signature.append(sig)
        run.positions[ctx.op_index] = pos
        keep: bool | None = None
        if not run.heuristic and run.plans:
            run.plans = [p for p in run.plans if pos < len(p.signature) and p.signature[pos] == sig]
            if run.plans:
                keep = pos in run.plans[0].kept
            else:
                run.heuristic = True
                run.diverged_at = ctx.op_index
        elif not run.plans:
            run.heuristic = True
        if keep is None:
            keep = self._heuristic(ctx, run, flops, out, args)
        run.answers[ctx.op_index] = keep
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def _heuristic(self, ctx: Any, run: _Run, flops: int, out: Any, args: tuple[Any, ...]) -> bool:
        """Keep this op's output? See rule 5 of Note [Memory budget policy]."""
        region = ctx.region
        saved = region.saved
        for _, h in saved[run.saved_seen :]:
            while h.is_view and h.node_index >= run.start:  # count the base's storage
                h = region.nodes[h.node_index].inputs[0]
            if h.node_index >= run.start and id(h) not in run.seen:
                run.seen.add(id(h))
                run.saved_bytes += h.nbytes
        run.saved_seen = len(saved)
        i = ctx.op_index
        nbytes = ctx.out_bytes
        if ctx.is_inplace or _aliases(out, args):
            nbytes = 0  # nothing of its own to keep
        # the recomputed values backward runs to recompute this one (rule 5b)
        chain: set[int] = set()
        for a in _tensors(args):
            h = region.lookup(a)
            if h is not None and h.node_index >= run.start and not h.kept:
                chain.add(h.node_index)
                chain |= run.chain.get(h.node_index, frozenset())
        run.chain[i] = frozenset(chain)
        run.own[i] = nbytes
        if nbytes == 0:
            return False
        chain_bytes = nbytes + sum(run.own.get(j, 0) for j in chain)
        if isinstance(self.budget, float):
            allowance = self.budget * (run.saved_bytes + nbytes)
        else:
            allowance = float(self.budget)
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

    # ---------------------------------------------------------------- planning
    def _op_costs(self, run: _Run) -> dict[int, int]:
        """Recompute cost per op index of the block. See Note [Recompute cost model]."""
        fpb = self.flops_per_byte
        if fpb is None:
            fpb = calibrated_flops_per_byte()
        return {j: op_cost(f, run.moved.get(j, 0), fpb) for j, f in run.costs.items()}

    def _plan(self, region: Region, run: _Run) -> _Plan:
        end = len(region.nodes)
        free = []
        for j in range(run.start, end):
            answer = run.answers.get(j)
            node = region.nodes[j]
            if answer is None or node.decided_by == "tag":
                continue
            is_kept = any(o is not None and o.kept for o in node.outputs)
            if is_kept == answer:
                free.append(j)
        g = from_region(region, self._op_costs(run), free)
        candidates = candidate_ops(g, free)
        hand = hand_seeds(g, candidates, block_ids([n.module_path for n in region.nodes]))
        own = {g.values[v].storage for _, v in g.saved if g.values[v].producer >= run.start}
        baseline = sum(g.values[s].nbytes for s in own if g.values[s].producer >= 0)
        fraction = isinstance(self.budget, float)
        budget = int(self.budget * baseline) if fraction else int(self.budget)
        outside = simulate(g, []).kept_bytes  # fixed kept storages count against the budget
        fixed_in = {g.values[v].storage for v in g.fixed if g.values[v].producer >= run.start}
        outside -= sum(g.values[s].nbytes for s in fixed_in)
        sol = solve(g, candidates, budget + outside, hand=hand)
        if not sol.feasible:
            warnings.warn(
                f"ckpt_graph: memory_budget({self.budget!r}): no plan found within {budget:,} "
                f"bytes for region #{run.ordinal}; the plan with the lowest simulated peak "
                f"({sol.result.peak_bytes - outside:,} bytes) is used",
                stacklevel=3,
            )
        kept = tuple(
            KeptTensor(
                j,
                g.ops[j].name,
                sum(g.values[o].nbytes for o in g.ops[j].outputs if g.values[o].storage == o),
            )
            for j in sorted(sol.kept_ops)
        )
        report = PlanReport(
            ordinal=run.ordinal,
            budget_bytes=budget,
            baseline_bytes=baseline,
            kept=kept,
            predicted_peak_bytes=sol.result.peak_bytes,
            predicted_total_peak_bytes=sol.result.peak_total_bytes,
            predicted_recompute_flops=sol.result.recompute_cost,
            recomputed_ops=sol.result.recomputed_ops,
            feasible=sol.feasible,
            candidates=len(candidates),
            method=sol.method,
        )
        kept_pos = frozenset(run.positions[j] for j in sol.kept_ops if j in run.positions)
        return _Plan(tuple(run.signature), kept_pos, report)

    # ---------------------------------------------------------------- introspection
    def report(self, ordinal: int | None = None) -> PlanReport | None:
        """The plan of region ``ordinal`` of a step, or the last one made or used.

        Example:
            >>> print(policy.report())  # doctest: +SKIP
        """
        if ordinal is None:
            return self._last
        plan = self._plans.get(ordinal)
        return plan.report if plan is not None else None


def memory_budget(
    budget: int | float | str, *, flops_per_byte: float | None = None
) -> MemoryBudget:
    """A policy that keeps what fits ``budget`` with the least recompute.

    Args:
        budget: bytes (an int of at least 1 KiB, or a string with a unit: ``"512MiB"``,
            ``"2GB"``, ``"1.5 GiB"``), or a fraction in (0, 1] of the activation memory the
            region keeps without checkpointing (a float, or ``"40%"``). See Note [Budget
            argument] and Note [Memory budget policy].
        flops_per_byte: FLOPs one byte moved by a memory-bound op is worth when comparing
            recompute costs; ``None`` measures it on this machine at the first plan. See
            Note [Recompute cost model].

    Raises:
        CkptGraphError: ``budget`` is not a budget (e.g. ``memory_budget(1)``: one byte; pass
            1.0 for 100%).

    Example:
        >>> policy = memory_budget(0.5)  # the same object for every step
        >>> with cg.save_recompute_policy(policy):  # doctest: +SKIP
        ...     loss = model(x).sum()
        >>> print(policy.report())  # doctest: +SKIP
    """
    return MemoryBudget(budget, flops_per_byte=flops_per_byte)


def _done(region: Region | None) -> bool:
    """Whether a region of the current step is finished (backward ran, or released)."""
    if region is None:
        return True
    return region._pass.number > 0 or (region._closed and region._live_packs == 0)


def _tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """Tensor arguments, including those in lists (``aten.cat``)."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def _aliases(out: Any, args: tuple[Any, ...]) -> bool:
    """Whether every tensor output shares the storage of a tensor argument (a view)."""
    outs = [
        o
        for o in (out if isinstance(out, (tuple, list)) else (out,))
        if isinstance(o, torch.Tensor)
    ]
    if not outs:
        return False
    ptrs = {t.untyped_storage().data_ptr() for t in _tensors(args)}
    return all(o.untyped_storage().data_ptr() in ptrs for o in outs)


def _shapes(out: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape),)
    if isinstance(out, (tuple, list)):
        return tuple(tuple(o.shape) if isinstance(o, torch.Tensor) else () for o in out)
    return ()
