"""``memory_budget(budget)``: keep what fits a memory budget with the least recompute.

# Note [Memory budget policy]
# 1. Budget. An int (or a string with a unit) is bytes; a float in (0, 1] is a fraction
#    (see Note [Budget argument]) of the activation memory the region would keep without
#    checkpointing: the distinct storages of the values
#    autograd saves that the region's ops produce (``SimGraph.saved_bytes``); for a step
#    of several regions, of the step's (Note [Step budget across regions]). It bounds
#    the *simulated activation peak of backward* (kept + cached + held recomputed values,
#    see Note [Backward liveness model]); gradient buffers are reported, not budgeted.
#    The budget is for a whole *step*: several regions of one step using the same policy
#    object (per-layer regions of ``wrap`` or ``integrations.transformers.enable``, several
#    ``with`` blocks) share it, planned jointly (Note [Step budget across regions]).
# 2. First step: no plan exists, so the online heuristic decides (rule 5) in each region
#    (paced against that region's own saved bytes) while the region records the graph, with
#    each op's FLOPs (``ctx.flops``) and, for ops without a FLOP formula, the bytes it reads
#    and writes: its recompute cost (Note [Recompute cost model]). At the region's exit its
#    graph is kept (``_Graph``, no tensors); once the step is over, the solver (Note [Memory
#    budget planning]) plans the kept ops of the step's regions for the next steps, starting
#    also from the hand plans of Note [Hand seeds].
# 3. Plans are keyed by the region's *ordinal within a step*: a step starts when a region
#    is entered after every region of the previous one ran its backward or was released
#    (gradient accumulation over micro-batches: each forward + backward is a step; several
#    forwards before one backward: one step). The step's regions are planned when the next
#    step's first region is entered, or when ``report()`` is asked for. A region first
#    tries the plan of its ordinal, then any other plan, following each op's signature (op
#    name and output shapes; other sizes of the same ops match too, see Note [Plans across
#    sizes]): answers come from the first plan still matching. A region that diverges from
#    every plan (or ends early) falls back to the heuristic for the rest, and its step is
#    planned again; if its ordinal had a plan, the graph changed: warn once.
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
#    tests/planner/test_budget.py, benchmarks/results_budget.md): the first step's simulated peak is
#    0.8-1.3x the budget where a plan can fit it (before: up to 3.6x, and 0.2x at 90%); its
#    recompute is 1.2-2.0x the plan's at 20-40% on the benchmark's 12-layer GPT but far
#    above it at 60-90%, where the plan recomputes only cheap ops (the reserve in c stays
#    conservative, and the first matmuls do not fit the allowance yet).
# 6. Signatures skip ``aten.detach`` ops (always recomputed: views, no memory): keeping a
#    value can make the engine record one (torch's ``make_variable`` dispatches a detach
#    after a kept factory op returns), which would shift positions
#    between a step decided by the heuristic and one decided by the plan.
#
# Note [Plans across sizes]
# Variable-length batches change every shape of a step but not its ops. Planning such a
# step from scratch costs tens of planned steps (graph, simulator, solver), so a plan is
# applied across sizes:
# 1. Matching. Op by op, a plan matches when the op name, the number of outputs and each
#    output's number of dimensions are the plan's at that position (the *structure*); the
#    sizes themselves are not compared, nor required to map consistently (the ops already
#    fix which value feeds which). Among the plans matching the structure, one whose sizes
#    are also equal so far is preferred (an exact match, as before).
# 2. Fractions. With a fraction, the budget scales with the step's activation bytes, and
#    so does the peak of the same kept set when the sizes scale together (batch, sequence
#    length of pointwise and matmul ops); so the plan is applied as it is, with no warning
#    and no new plan. ``report()`` then gives the plan's byte figures scaled by the ratio of
#    the region's activation bytes (rule 1) to the planned region's (``reuses`` counts it).
#    Terms that grow faster than the rest (attention scores with the sequence length) make
#    this an approximation: tests/planner/test_budget_shapes.py measures it.
# 3. Bytes. With an int budget, a kept set planned at some sizes fits at sizes no larger:
#    every value is no larger, so no simulated peak is. At each position the elements of
#    the outputs so far are compared with the plan's; once they exceed the plan's, the rest
#    of the region is decided by the heuristic and its step planned again (no warning: the
#    graph did not change), for the larger sizes. So a run plans once per new largest size,
#    not once per step.

# Note [Step budget across regions]
# 1. Memory of a step. Backward visits the step's regions in the reverse order of their
#    forward (region k's backward ends before region k-1's starts). What region j keeps,
#    and its activation inputs (values with autograd history made before it, e.g. the
#    hidden states a layer reads, counted once per storage in the first region of the step
#    that reads them), stay alive from its forward until its backward ends. So during the
#    backward of region k the activation memory is
#        sum over j < k of (kept_j + inputs_j)  +  inputs_k  +  peak_k
#    where kept_j and peak_k are the liveness simulator's ``kept_bytes`` and
#    ``peak_bytes`` of each region's plan (Note [Backward liveness model]); the step's
#    peak is the largest of these. A fraction budget is of the step's activation memory
#    without checkpointing: the regions' saved bytes plus their activation inputs.
# 2. Identical layers share a graph: a region's graph is stored once per op signature
#    (rule 3 of Note [Memory budget policy]), and so is its *menu*: the trade-offs
#    (kept bytes, peak, recompute cost) of keeping nothing, keeping every candidate, and
#    the solver's plans for ``_MENU`` budgets spread between the lowest peak it finds and
#    the peak of keeping everything. Regions given the same menu entry share one plan.
# 3. Joint choice: a DP over the regions in forward order picks one menu entry per region
#    with the least summed recompute cost such that every term of rule 1 fits the budget.
#    Its state is the prefix sum of rule 1 (rounded up to 1/1024 of the budget); states
#    with a larger prefix and no lower cost are dropped. Later regions thus keep more: what
#    they keep is freed first. If nothing fits, the budget is raised by 5% steps until a
#    plan does and the policy warns once with the predicted step peak.
# 4. A step of one region is planned as before: the solver alone, against the region's
#    budget (rule 1 of Note [Memory budget policy]).
# Known limitations: the model ignores memory outside the step's regions (embeddings,
# logits, the loss), the forward's own peak, and gradient buffers; regions of one step
# whose backwards interleave (two regions in parallel branches) are modelled as nested.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.planner.cost_model import calibrated_flops_per_byte, op_cost, parse_budget
from ckpt_graph.planner.hand_seeds import block_ids, hand_seeds
from ckpt_graph.planner.liveness import SimGraph, SimResult, from_region, simulate
from ckpt_graph.planner.solve import KeptTensor, PlanReport, candidate_ops, solve

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["KeptTensor", "MemoryBudget", "PlanReport", "StepPlan", "memory_budget"]

_CHAIN_OPS = 200
_CHEAP = 0.9
_DETACH = "aten.detach.default"
_SEGMENT = 0.3
_MENU = 4  # solver budgets per distinct region graph (Note [Step budget across regions])
_MENU_EVALS = 100
_GRAIN = 1024
Signature = tuple[str, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class _Option:
    """One entry of a graph's menu: kept ops and the simulated backward."""

    kept_ops: frozenset[int]
    result: SimResult
    method: str
    feasible: bool = True


@dataclass
class _Graph:
    """A region's graph as planned; one per op signature (Note [Step budget across regions])."""

    signature: tuple[Signature, ...]
    g: SimGraph
    candidates: list[int]
    positions: dict[int, int]
    baseline: int
    outside: int
    hand: dict[str, frozenset[int]] = field(default_factory=dict)  # Note [Hand seeds]
    menu: list[_Option] | None = None


@dataclass(eq=False)  # by identity: regions of identical layers share one
class _Plan:
    signature: tuple[Signature, ...]
    kept: frozenset[int]  # signature positions (see rule 6 of Note [Memory budget policy])
    report: PlanReport
    graph: _Graph | None = None
    # output elements of the signature up to each position (See Note [Plans across sizes])
    elements: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.elements:
            total = 0
            for _, shapes in self.signature:
                total += _elements(shapes)
                self.elements.append(total)


@dataclass(frozen=True)
class _Seen:
    """A region of the current step whose block exited: its graph and activation inputs."""

    ordinal: int
    graph: _Graph
    inputs: int


@dataclass(frozen=True)
class StepPlan:
    """The joint plan of a step's regions (Note [Step budget across regions]).

    Attributes:
        regions: regions in the step.
        budget_bytes: the step's budget in bytes.
        baseline_bytes: the step's activation bytes without checkpointing.
        input_bytes: activation inputs of the regions (always kept), in the step's peak.
        predicted_peak_bytes: the largest term of rule 1 of the Note.
        predicted_recompute_flops: summed recompute cost of the regions' plans.
        feasible: whether the plan fits the budget (else: the budget was raised to fit).
        graphs: distinct region graphs (identical layers share one).
    """

    regions: int
    budget_bytes: int
    baseline_bytes: int
    input_bytes: int
    predicted_peak_bytes: int
    predicted_recompute_flops: int
    feasible: bool
    graphs: int


@dataclass
class _Run:
    """State of one open block of the policy in one region."""

    start: int
    ordinal: int
    kept_at_enter: int
    plans: list[_Plan]
    inputs_at_enter: int = 0
    exact: list[_Plan] = field(default_factory=list)  # See Note [Plans across sizes].
    elements: int = 0
    grown: bool = False
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
        (reverse forward order). A step's plan ignores memory outside its regions (see
        Note [Step budget across regions]).
    """

    def __init__(self, budget: int | float | str, *, flops_per_byte: float | None = None) -> None:
        self.budget: int | float = parse_budget(budget)
        if flops_per_byte is not None and not flops_per_byte >= 0:
            raise CkptGraphValueError(
                f"ckpt_graph: memory_budget(flops_per_byte={flops_per_byte!r}) must be >= 0 "
                "(FLOPs one byte moved costs); leave it None to calibrate on this machine"
            )
        self.flops_per_byte = flops_per_byte
        self._plans: dict[int, _Plan] = {}
        self._runs: dict[int, _Run] = {}
        self._step: list[weakref.ref[Region]] = []
        self._last: PlanReport | None = None
        self._warned = False
        self._warned_step = False
        # the current step (Note [Step budget across regions])
        self._seen: list[_Seen] = []
        self._storages: set[int] = set()
        self._graphs: dict[tuple[Signature, ...], _Graph] = {}
        self._dirty = False
        self._planned: tuple[int, ...] = ()
        self._step_plan: StepPlan | None = None

    def __repr__(self) -> str:
        return f"memory_budget({self.budget!r})"

    # ---------------------------------------------------------------- region hooks
    def on_region_enter(self, region: Region) -> None:
        """Start deciding for the ops of ``region`` recorded from now on."""
        run = self._runs.get(id(region))
        if run is not None:
            run.depth += 1
            return
        if all(_done(r()) for r in self._step):  # a new step: plan the last one
            self._plan_step()
            self._step, self._seen = [], []
            self._storages = set()
        ordinal = len(self._step)
        self._step.append(weakref.ref(region))
        own = self._plans.get(ordinal)
        plans = ([own] if own is not None else []) + [
            p for p in dict.fromkeys(self._plans.values()) if p is not own
        ]
        self._runs[id(region)] = _Run(
            len(region.nodes),
            ordinal,
            region.kept_bytes,
            plans,
            len(region.inputs),
            exact=list(plans),
        )

    def on_region_exit(self, region: Region) -> None:
        """Record the block's graph for the step's plan unless a plan matched it fully."""
        run = self._runs.get(id(region))
        if run is None:
            return
        run.depth -= 1
        if run.depth > 0:
            return
        del self._runs[id(region)]
        inputs = self._input_bytes(region, run)
        n = len(run.signature)
        matched = [p for p in run.plans if len(p.signature) == n]
        if matched and not run.heuristic and matched[0].graph is not None:
            exact = [p for p in run.exact if len(p.signature) == n]
            if not exact:
                _count_saved(region, run)
            plan = exact[0] if exact else matched[0]
            plan.report = replace(plan.report, reuses=plan.report.reuses + 1)
            self._plans.setdefault(run.ordinal, plan)
            self._last = plan.report if exact else self._scaled(plan, run)
            assert plan.graph is not None
            self._seen.append(_Seen(run.ordinal, plan.graph, inputs))
            return
        old = self._plans.get(run.ordinal)
        if old is not None and not self._warned and not run.grown:
            self._warned = True
            at = run.diverged_at if run.diverged_at >= 0 else len(region.nodes)
            warnings.warn(
                f"ckpt_graph: memory_budget({self.budget!r}): the graph of region #{run.ordinal} "
                f"of this step differs from the planned one (first at op #{at}); "
                "this step used the online heuristic from there, and the region was planned "
                "again for the next steps (warned once per policy)",
                stacklevel=2,
            )
        graph = self._graph(region, run)
        graph = self._graphs.setdefault(graph.signature, graph)
        self._seen.append(_Seen(run.ordinal, graph, inputs))
        self._dirty = True

    def _input_bytes(self, region: Region, run: _Run) -> int:
        """Bytes of the block's activation inputs not yet counted in this step.

        Region inputs with autograd history (a previous layer's output) are activations
        the region keeps until its backward; parameters, the batch and other leaves are
        not. See Note [Step budget across regions] rule 1.
        """
        total = 0
        for h in region.inputs[run.inputs_at_enter :]:
            t = h.ref() if h.ref is not None else None
            if t is None or t.grad_fn is None:
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a subclass without storage
                continue
            key = storage.data_ptr()
            if key not in self._storages:
                self._storages.add(key)
                total += storage.nbytes()
        return total

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
            keep = self._match(run, pos, sig)
            if keep is None:
                run.heuristic = True
                run.diverged_at = ctx.op_index
        elif not run.plans:
            run.heuristic = True
        if keep is None:
            keep = self._heuristic(ctx, run, flops, out, args)
        run.answers[ctx.op_index] = keep
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def _match(self, run: _Run, pos: int, sig: Signature) -> bool | None:
        """The answer of the plan matching the region so far, or ``None`` (the heuristic
        decides from here). See Note [Plans across sizes]."""
        run.elements += _elements(sig[1])
        if run.exact:
            run.exact = [p for p in run.exact if pos < len(p.signature) and p.signature[pos] == sig]
        structure = _structure(sig)
        run.plans = [
            p
            for p in run.plans
            if pos < len(p.signature)
            and (p.signature[pos] == sig or _structure(p.signature[pos]) == structure)
        ]
        if run.exact:
            return pos in run.exact[0].kept
        if not run.plans:
            return None
        plan = run.plans[0]
        if not isinstance(self.budget, float) and run.elements > plan.elements[pos]:
            run.grown = True  # larger than planned: an int budget needs a new plan
            return None
        return pos in plan.kept

    def _scaled(self, plan: _Plan, run: _Run) -> PlanReport:
        """``plan``'s report with its byte figures scaled to the sizes of ``run``."""
        r = plan.report
        ratio = run.saved_bytes / max(r.baseline_bytes, 1)
        return replace(
            r,
            budget_bytes=int(r.budget_bytes * ratio)
            if isinstance(self.budget, float)
            else r.budget_bytes,
            baseline_bytes=int(r.baseline_bytes * ratio),
            kept=tuple(replace(k, nbytes=int(k.nbytes * ratio)) for k in r.kept),
            predicted_peak_bytes=int(r.predicted_peak_bytes * ratio),
            predicted_total_peak_bytes=int(r.predicted_total_peak_bytes * ratio),
            predicted_recompute_flops=int(r.predicted_recompute_flops * ratio),
        )

    def _heuristic(self, ctx: Any, run: _Run, flops: int, out: Any, args: tuple[Any, ...]) -> bool:
        """Keep this op's output? See rule 5 of Note [Memory budget policy]."""
        region = ctx.region
        _count_saved(region, run)
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
    def _graph(self, region: Region, run: _Run) -> _Graph:
        """The block's graph as the planner sees it, with the ops the plan may decide."""
        end = len(region.nodes)
        free = []
        for j in range(run.start, end):
            answer = run.answers.get(j)
            node = region.nodes[j]
            if answer is None or any(o in region.tagged for o in node.outputs):
                continue
            is_kept = any(o is not None and o.kept for o in node.outputs)
            if is_kept == answer:
                free.append(j)
        g = from_region(region, self._op_costs(run), free)
        candidates = candidate_ops(g, free)
        hand = hand_seeds(g, candidates, block_ids([n.module_path for n in region.nodes]))
        own = {g.values[v].storage for _, v in g.saved if g.values[v].producer >= run.start}
        baseline = sum(g.values[s].nbytes for s in own if g.values[s].producer >= 0)
        outside = simulate(g, []).kept_bytes  # fixed kept storages count against the budget
        fixed_in = {g.values[v].storage for v in g.fixed if g.values[v].producer >= run.start}
        outside -= sum(g.values[s].nbytes for s in fixed_in)
        positions = {j: run.positions[j] for j in candidates if j in run.positions}
        return _Graph(tuple(run.signature), g, candidates, positions, baseline, outside, hand)

    def _op_costs(self, run: _Run) -> dict[int, int]:
        """Recompute cost per op index of the block. See Note [Recompute cost model]."""
        fpb = self.flops_per_byte
        if fpb is None:
            fpb = calibrated_flops_per_byte()
        return {j: op_cost(f, run.moved.get(j, 0), fpb) for j, f in run.costs.items()}

    def _plan_step(self) -> None:
        """Plan the regions of the current step for the next ones, unless already planned.

        See Note [Step budget across regions].
        """
        if not self._seen:
            return
        key = tuple(id(s.graph) for s in self._seen)
        if not self._dirty and key == self._planned:
            return
        self._dirty = False
        self._planned = key
        self._graphs = {s.graph.signature: s.graph for s in self._seen}  # drop stale graphs
        if len(self._seen) == 1:
            seen = self._seen[0]
            graph = seen.graph
            fraction = isinstance(self.budget, float)
            budget = int(self.budget * graph.baseline) if fraction else int(self.budget)
            sol = solve(
                graph.g,
                graph.candidates,
                budget + graph.outside,
                hand=graph.hand,
                below_reach="total",
            )
            if not sol.feasible:
                warnings.warn(
                    f"ckpt_graph: memory_budget({self.budget!r}): no plan found within "
                    f"{budget:,} bytes for region #{seen.ordinal}; the plan with the lowest "
                    f"simulated peak ({sol.result.peak_bytes - graph.outside:,} bytes) is used",
                    stacklevel=4,
                )
            option = _Option(sol.kept_ops, sol.result, sol.method, sol.feasible)
            plan = self._make_plan(graph, option, seen.ordinal, budget)
            self._plans[seen.ordinal] = plan
            self._last = plan.report
            self._step_plan = None
            return
        self._plan_jointly()

    def _plan_jointly(self) -> None:
        """The DP of rule 3 of Note [Step budget across regions]."""
        seen = self._seen
        baseline = sum(s.graph.baseline + s.inputs for s in seen)
        outside = sum(s.graph.outside for s in seen)
        fraction = isinstance(self.budget, float)
        budget = int(self.budget * baseline) if fraction else int(self.budget)
        menus = [self._menu(s.graph) for s in seen]
        limit = budget + outside
        choice = _choose(seen, menus, limit)
        while choice is None:  # nothing fits: raise the budget until a plan does
            limit = int(limit * 1.05) + 1
            choice = _choose(seen, menus, limit)
        feasible = limit == budget + outside
        prefix = peak = cost = 0
        for s, menu, m in zip(seen, menus, choice, strict=True):
            r = menu[m].result
            peak = max(peak, prefix + s.inputs + r.peak_bytes)
            prefix += s.inputs + r.kept_bytes
            cost += r.recompute_cost
        if not feasible and not self._warned_step:
            self._warned_step = True
            warnings.warn(
                f"ckpt_graph: memory_budget({self.budget!r}): no plan found within "
                f"{budget:,} bytes for the step's {len(seen)} regions; the plans with the "
                f"lowest predicted step peak found ({peak - outside:,} bytes) are used "
                "(warned once per policy)",
                stacklevel=5,
            )
        shared: dict[tuple[int, int], _Plan] = {}
        prefix = 0
        for s, menu, m in zip(seen, menus, choice, strict=True):
            plan = shared.get((id(s.graph), m))
            if plan is None:
                share = budget + outside - prefix - s.inputs  # what this region may use
                plan = self._make_plan(s.graph, menu[m], s.ordinal, share)
                shared[id(s.graph), m] = plan
            self._plans[s.ordinal] = plan
            self._last = plan.report
            prefix += s.inputs + menu[m].result.kept_bytes
        self._step_plan = StepPlan(
            regions=len(seen),
            budget_bytes=budget,
            baseline_bytes=baseline,
            input_bytes=sum(s.inputs for s in seen),
            predicted_peak_bytes=peak - outside,
            predicted_recompute_flops=cost,
            feasible=feasible,
            graphs=len({id(s.graph) for s in seen}),
        )

    def _menu(self, graph: _Graph) -> list[_Option]:
        """Trade-offs of one region graph (rule 2 of Note [Step budget across regions])."""
        if graph.menu is not None:
            return graph.menu
        g, cands = graph.g, graph.candidates
        options = [_Option(frozenset(), simulate(g, []), "none")]
        everything = _Option(frozenset(cands), simulate(g, cands), "all")
        options.append(everything)
        low = solve(g, cands, 0, max_evals=_MENU_EVALS, hand=graph.hand)
        options.append(_Option(low.kept_ops, low.result, low.method))
        lo = min(o.result.peak_bytes for o in options)
        hi = everything.result.peak_bytes
        for i in range(1, _MENU):
            sol = solve(
                g, cands, lo + (hi - lo) * i // _MENU, max_evals=_MENU_EVALS, hand=graph.hand
            )
            if sol.feasible:
                options.append(_Option(sol.kept_ops, sol.result, sol.method))
        # drop dominated entries: no lower peak, kept bytes or cost than another
        menu: list[_Option] = []
        for o in sorted(options, key=lambda o: (o.result.recompute_cost, o.result.peak_bytes)):
            r = o.result
            if not any(
                m.result.peak_bytes <= r.peak_bytes and m.result.kept_bytes <= r.kept_bytes
                for m in menu
            ):
                menu.append(o)
        graph.menu = menu
        return menu

    def _make_plan(self, graph: _Graph, option: _Option, ordinal: int, budget: int) -> _Plan:
        g = graph.g
        kept = tuple(
            KeptTensor(
                j,
                g.ops[j].name,
                sum(g.values[o].nbytes for o in g.ops[j].outputs if g.values[o].storage == o),
            )
            for j in sorted(option.kept_ops)
        )
        report = PlanReport(
            ordinal=ordinal,
            budget_bytes=budget,
            baseline_bytes=graph.baseline,
            kept=kept,
            predicted_peak_bytes=option.result.peak_bytes,
            predicted_total_peak_bytes=option.result.peak_total_bytes,
            predicted_recompute_flops=option.result.recompute_cost,
            recomputed_ops=option.result.recomputed_ops,
            feasible=option.feasible,
            candidates=len(graph.candidates),
            method=option.method,
        )
        kept_pos = frozenset(graph.positions[j] for j in option.kept_ops if j in graph.positions)
        return _Plan(graph.signature, kept_pos, report, graph)

    # ---------------------------------------------------------------- introspection
    def report(self, ordinal: int | None = None) -> PlanReport | None:
        """The plan of region ``ordinal`` of a step, or the last one made or used.

        Example:
            >>> print(policy.report())  # doctest: +SKIP
        """
        self._plan_step()
        if ordinal is None:
            return self._last
        plan = self._plans.get(ordinal)
        return plan.report if plan is not None else None

    def step_report(self) -> StepPlan | None:
        """The joint plan of the last step with several regions (None for one region).

        See Note [Step budget across regions].

        Example:
            >>> print(policy.step_report())  # doctest: +SKIP
        """
        self._plan_step()
        return self._step_plan


def memory_budget(
    budget: int | float | str, *, flops_per_byte: float | None = None
) -> MemoryBudget:
    """A policy that keeps what fits ``budget`` with the least recompute.

    Args:
        budget: bytes (an int of at least 1 KiB, or a string with a unit: ``"512MiB"``,
            ``"2GB"``, ``"1.5 GiB"``), or a fraction in (0, 1] (a float, or ``"40%"``; see
            Note [Budget argument]) of the activation memory the region keeps without
            checkpointing, for one step: regions of a step that share the
            object (per-layer regions of ``wrap`` or ``integrations.transformers.enable``,
            several ``with`` blocks) share the budget. A step ends when every region of it
            ran its backward (or was released); its regions are planned jointly when the
            next step starts. See Note [Memory budget policy] and Note [Step budget across
            regions].
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
        >>> model = cg.wrap(model, policy)  # a region per block, one budget per step
        >>> print(policy.step_report())  # doctest: +SKIP
    """
    return MemoryBudget(budget, flops_per_byte=flops_per_byte)


def _choose(seen: list[_Seen], menus: list[list[_Option]], limit: int) -> list[int] | None:
    """Menu entry per region, least summed recompute cost within ``limit``, or None.

    A DP over the regions in forward order on the prefix sum of rule 1 of Note [Step budget
    across regions], rounded up to ``limit / _GRAIN``.
    """
    grain = max(1, limit // _GRAIN)
    # state: rounded prefix -> (prefix, cost, choices so far)
    states: dict[int, tuple[int, int, tuple[int, ...]]] = {0: (0, 0, ())}
    for s, menu in zip(seen, menus, strict=True):
        nxt: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        for prefix, cost, picks in states.values():
            for m, option in enumerate(menu):
                r = option.result
                if prefix + s.inputs + r.peak_bytes > limit:
                    continue
                after = prefix + s.inputs + r.kept_bytes
                key = math.ceil(after / grain)
                total = cost + r.recompute_cost
                old = nxt.get(key)
                if old is None or (total, after) < (old[1], old[0]):
                    nxt[key] = (after, total, (*picks, m))
        if not nxt:
            return None
        states = {}
        best = -1
        for key in sorted(nxt):  # keep states with a lower cost than every smaller prefix
            state = nxt[key]
            if best < 0 or state[1] < best:
                states[key] = state
                best = state[1]
    return list(min(states.values(), key=lambda t: (t[1], t[0]))[2])


def _count_saved(region: Region, run: _Run) -> None:
    """Add the saves since the last call to ``run.saved_bytes`` (rule 5a)."""
    saved = region.saved
    for _, h in saved[run.saved_seen :]:
        while h.is_view and h.node_index >= run.start:  # count the base's storage
            h = region.nodes[h.node_index].inputs[0]
        if h.node_index >= run.start and id(h) not in run.seen:
            run.seen.add(id(h))
            run.saved_bytes += h.nbytes
    run.saved_seen = len(saved)


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


def _structure(sig: Signature) -> tuple[str, tuple[int, ...]]:
    """Op name and the number of dimensions of each output. See Note [Plans across sizes]."""
    return sig[0], tuple(len(s) for s in sig[1])


def _elements(shapes: tuple[tuple[int, ...], ...]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total
