"""``memory_budget(budget)``: keep what fits a memory budget with the least recompute.

# Note [Memory budget policy]
# 1. Budget. An int (or a string with a unit) is bytes; a float in (0, 1] is a fraction
#    (see Note [Budget argument]). The budget is for a whole *step*: the regions of one
#    step using the same policy object (one ``with`` block over a model, per-layer regions
#    of ``wrap`` or ``integrations.transformers.enable``, several ``with`` blocks) share
#    it. It bounds the step's simulated peak: the regions' kept and cached values (see
#    Note [Backward liveness model]) with their activation inputs, gradient buffers and
#    backward temporaries (``SimResult.peak_total_bytes``), and a fraction is of that peak
#    without checkpointing (Note [Step budget across regions] rule 1). A step of several
#    regions is planned jointly; a step of one region by the solver alone, against the
#    same figure (its forward peak is not budgeted there). Before, one region's budget
#    bounded its *activation* peak, a fraction of its saved bytes: the measured step
#    follows the peak with gradients, and the cheapest plans within an activation budget
#    held their activations where the gradients peak (at the head's backward). On the
#    6-layer GPT of ``benchmarks/bench_pareto.py`` every plan fitting a budget near torch
#    per block's peak measured 1.1-1.2x it (the greedy plan at 25%: 1.52 MiB of
#    activations, 2.72 MiB with gradients, 4.40 MiB measured, where keeping every block
#    input is 1.32, 1.82 and 3.51, torch: 3.53), so only the lowest-peak fallback reached
#    torch's peaks, recomputing 2.3x torch's FLOPs. Bounding the total, the plan at 25%
#    measures 3.52 MiB for 0.97x torch's FLOPs.
# 2. First step: no plan exists, so the online heuristic decides (rule 5) in each region
#    (paced against that region's own saved bytes) while the region records the graph. At
#    the region's exit its graph is kept (``RegionGraph``, no tensors), with each op's
#    recompute cost computed from its op node (Note [Recompute cost model], Note [Following
#    a plan] rule 2); once the step is over, the solver (Note [Memory
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
#    d. A fraction of 1.0 or more is met by keeping every value the region saves: every op
#       is kept, and so are views of kept values (no memory, see Note [Kept views]), so
#       ``memory_budget(1.0)`` recomputes nothing from its first step on.
#    In-place ops, views and ops without tensor outputs are recomputed. Measured (zoo, GPTs:
#    tests/planner/test_budget.py, benchmarks/results_budget.md): the first step's simulated peak is
#    0.8-1.3x the budget where a plan can fit it (before: up to 3.6x, and 0.2x at 90%); its
#    recompute is 1.2-2.0x the plan's at 20-40% on the benchmark's 12-layer GPT but far
#    above it at 60-90%, where the plan recomputes only cheap ops (the reserve in c stays
#    conservative, and the first matmuls do not fit the allowance yet).
# 6. Signatures skip ``aten.detach`` ops (views, no memory; kept only when their input is
#    kept, see Note [Kept views]): keeping a
#    value can make the engine record one (torch's ``make_variable`` dispatches a detach
#    after a kept factory op returns), which would shift positions
#    between a step decided by the heuristic and one decided by the plan.
# 7. Not training steps. A block entered with grad disabled (``torch.no_grad()``,
#    inference mode: an evaluation pass) saves nothing for backward: the policy abstains
#    for its ops, and it neither starts a step nor takes an ordinal. A block that saved
#    nothing (only in-place ops, say) is dropped from its step at exit: there is nothing
#    to plan, and planning it replaced the step's plans (issue 21 items 4 and 10: after
#    three steps at 0.5 on six wrapped MLP blocks, one no-grad pass made the next step
#    peak at 1.15x its budgeted peak, and 1.84x with one region).
# 8. Plans by graph. A step of one region whose graph switches between a few (a layer
#    skipped every other step, train/eval modules, two models sharing the policy) would
#    be planned from scratch at each switch. Its plans are kept by graph signature (the
#    ``_CACHE`` most recent): a region tries them after the plans of the step (rule 3),
#    and a step whose graph has a kept plan uses it with no solver (the ordinal's own
#    plan stays the first one tried: with an int budget, the plan of the largest size). Per-layer steps keep
#    their graphs' menus (Note [Step budget across regions] rule 2).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.planner.across_sizes import (
    catch_up,
    cheap_start,
    follow,
    match,
    op_shapes,
    scaled,
)
from ckpt_graph.planner.budget_check import BudgetCheck
from ckpt_graph.planner.budget_heuristic import count_saved, heuristic, views_of_kept
from ckpt_graph.planner.budget_report import BudgetReport
from ckpt_graph.planner.compile_solver import CompileSolver, solver_for
from ckpt_graph.planner.cost_model import machine_flops_per_byte, parse_budget, recorded_costs
from ckpt_graph.planner.local_search import Refinement
from ckpt_graph.planner.menus import warm_kept
from ckpt_graph.planner.plans import make_plan
from ckpt_graph.planner.records import (
    KeptTensor,
    Option,
    Plan,
    PlanReport,
    RegionGraph,
    Run,
    Seen,
    Signature,
    StepPlan,
)
from ckpt_graph.planner.region_graph import input_bytes, region_graph
from ckpt_graph.planner.solve import solve, solve_from
from ckpt_graph.planner.step_budget import plan_jointly, step_budget_bytes

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["KeptTensor", "MemoryBudget", "PlanReport", "StepPlan", "memory_budget"]

_DETACH = "aten.detach.default"
_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_WARM = "warm start"
# local search of a warm start, then per later step (Note [Warm start at a new size])
_WARM_EVALS = 40
_REFINE_EVALS = 10
# plans of single-region steps kept by graph signature (rule 8 of Note [Memory budget policy])
_CACHE = 8


class MemoryBudget:
    """The policy object returned by :func:`memory_budget`. See Note [Memory budget policy].

    Known limitations:
        The budget bounds the simulated step peak of the regions (activations, gradient
        buffers, backward temporaries), not memory outside them (the loss outside a
        region, parameters' gradients: see Note [Measured budget check]); the simulator's
        unpack order is autograd's usual one for a region (reverse forward order). A step
        of one region does not budget its forward peak.
    """

    def __init__(
        self, budget: int | float | str, *, flops_per_byte: float | None = None, check: bool = False
    ) -> None:
        self.budget: int | float = parse_budget(budget)
        self.check = check
        if flops_per_byte is not None and not flops_per_byte >= 0:
            raise CkptGraphValueError(
                f"ckpt_graph: memory_budget(flops_per_byte={flops_per_byte!r}) must be >= 0 "
                "(FLOPs one byte moved costs); leave it None to calibrate on this machine"
            )
        self.flops_per_byte = flops_per_byte
        self._plans: dict[int, Plan] = {}
        self._runs: dict[int, Run] = {}
        self._step: list[weakref.ref[Region]] = []
        self._last: PlanReport | None = None
        self._warned = False
        self._warned_step = False
        # the current step (Note [Step budget across regions])
        self._seen: list[Seen] = []
        self._storages: set[int] = set()
        self._graphs: dict[tuple[Signature, ...], RegionGraph] = {}
        self._dirty = False
        self._planned: tuple[int, ...] = ()
        self._step_plan: StepPlan | None = None
        # a warm start's search, continued at later steps (Note [Warm start at a new size])
        self._refining: tuple[int, RegionGraph, int, Refinement] | None = None
        self._check = BudgetCheck()  # See Note [Measured budget check].
        # plans of steps of one region by graph signature, most recent last (rule 8)
        self._cache: OrderedDict[tuple[Signature, ...], Plan] = OrderedDict()

    def __repr__(self) -> str:
        return f"memory_budget({self.budget!r})"

    @property
    def compile_fraction(self) -> float | None:
        """The budget as the partitioner's fraction under torch.compile (``None``: bytes).

        See Note [memory_budget under torch.compile] in compile_solver.py.
        """
        return self.budget if isinstance(self.budget, float) else None

    def compile_solver(self) -> CompileSolver:
        """The partitioner's knapsack solver of this policy object under torch.compile."""
        return solver_for(self)

    def on_region_enter(self, region: Region) -> None:
        """Start deciding for the ops of ``region`` recorded from now on."""
        run = self._runs.get(id(region))
        if run is not None:
            run.depth += 1
            return
        if not torch.is_grad_enabled():  # not a training step: See Note [Memory budget policy]
            return
        if all(_done(r()) for r in self._step):  # a new step: plan the last one
            state = region.recording
            recording, state.on = state.on, False  # not the region's ops
            try:
                self._measured_step()
                if not self._plan_step():
                    self._refine()
                self._step, self._seen = [], []
                self._storages = set()
                if self.check:
                    self._check.start(self._predicted())
            finally:
                state.on = recording
        ordinal = len(self._step)
        self._step.append(weakref.ref(region))
        own = self._plans.get(ordinal)
        plans = ([own] if own is not None else []) + [
            p
            for p in dict.fromkeys([*self._plans.values(), *reversed(self._cache.values())])
            if p is not own
        ]
        self._runs[id(region)] = Run(
            len(region.nodes),
            ordinal,
            region.kept_bytes,
            plans,
            len(region.inputs),
            len(region.saved_log),
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
        if self.check:  # only the measured check's breakdown needs the parameters
            self._check.note_region(region)
        if len(region.saved_log) == run.saved_at_enter:  # saved nothing: not planned (rule 7)
            self._step = [r for r in self._step if r() is not region]
            return
        n = len(run.signature)
        inputs = input_bytes(region, run.inputs_at_enter, self._storages)
        if run.lag == 0 and run.exact and len(run.exact[0].signature) == n:
            matched = exact = run.exact[:1]  # it matched to the end (Note [Following a plan])
        else:
            catch_up(run, n)
            matched = [p for p in run.plans if len(p.signature) == n]
            exact = [p for p in run.exact if len(p.signature) == n]
        if matched and not run.heuristic and matched[0].graph is not None:
            if not exact:
                count_saved(region, run)
            plan = exact[0] if exact else matched[0]
            plan.report = replace(plan.report, reuses=plan.report.reuses + 1)
            self._plans.setdefault(run.ordinal, plan)
            self._last = plan.report if exact else scaled(plan, run, isinstance(self.budget, float))
            assert plan.graph is not None
            self._seen.append(Seen(run.ordinal, plan.graph, inputs))
            return
        warm = [p for p in run.plans if len(p.signature) == n] if run.grown else []
        old = self._plans.get(run.ordinal)
        if old is not None and not self._warned and not warm:
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
        if warm and warm[0].graph is not None and graph.menu is None:
            graph.warm = warm[0]  # See Note [Warm start at a new size].
        self._seen.append(Seen(run.ordinal, graph, inputs))
        self._dirty = True

    def __call__(
        self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | None:
        """MUST_SAVE for the ops to keep, PREFER_RECOMPUTE for the others."""
        region = ctx.region
        run = self._runs.get(id(region))
        if run is None:  # called without on_region_enter: start here
            self.on_region_enter(region)
            found = self._runs.get(id(region))
            if found is None:  # grad disabled: nothing is saved, abstain (rule 7)
                return None
            run = found
            run.start = ctx.op_index
        index = ctx.op_index
        name = ctx.op_name
        if name == _DETACH:  # see rule 6 of Note [Memory budget policy]
            free = views_of_kept(region, run, args)
            run.answers[index] = free
            return _SAVE if free else _RECOMPUTE
        pos = len(run.signature)
        sig = (name, op_shapes(out))
        run.signature.append(sig)
        run.positions[index] = pos
        keep: bool | None = None
        if run.grown:
            follow(run, pos, sig)
        elif not run.heuristic and run.plans:
            keep = match(run, pos, sig, isinstance(self.budget, float))
            if keep is None:
                run.heuristic = True
                run.diverged_at = index
        elif not run.plans:
            run.heuristic = True
        if keep is None:
            keep = heuristic(self.budget, ctx, run, ctx.flops, out, args)
        run.answers[index] = keep
        return _SAVE if keep else _RECOMPUTE

    def _graph(self, region: Region, run: Run) -> RegionGraph:
        """The block's graph as the planner sees it, with the ops the plan may decide."""
        return region_graph(region, run, self._op_costs(region, run))

    def _op_costs(self, region: Region, run: Run) -> dict[int, int]:
        """Recompute cost per op index of the block. See Note [Recompute cost model]."""
        fpb = self.flops_per_byte
        if fpb is None:
            fpb = machine_flops_per_byte()  # See Note [Pinned calibration]
        return recorded_costs(region, run.answers, fpb)

    def _plan_step(self) -> bool:
        """Plan the regions of the current step for the next ones, unless already planned.

        Returns whether it planned. See Note [Step budget across regions].
        """
        if not self._seen:
            return False
        key = tuple(id(s.graph) for s in self._seen)
        if not self._dirty and key == self._planned:
            return False
        self._dirty = False
        self._planned = key
        self._graphs = {s.graph.signature: s.graph for s in self._seen}  # drop stale graphs
        self._refining = None
        if len(self._seen) == 1:
            self._plan_region(self._seen[0])
        else:
            self._plan_jointly()
        return True

    def _plan_region(self, seen: Seen) -> None:
        """A step of one region: the solver alone (rule 4 of Note [Step budget across
        regions]), or a warm start (Note [Warm start at a new size])."""
        graph = seen.graph
        cached = self._cache.get(graph.signature)
        if cached is not None:  # planned before: See rule 8 of Note [Memory budget policy].
            self._cache.move_to_end(graph.signature)
            self._plans.setdefault(seen.ordinal, cached)  # the own plan is still tried first
            self._last = cached.report
            self._step_plan = None
            return
        budget = step_budget_bytes([seen], self.budget)  # See Note [Memory budget policy] rule 1.
        limit = budget + graph.outside - seen.inputs - self._check.correction
        ref = None
        option: Option | None = None
        if graph.warm is not None:
            start = warm_kept(graph.warm.kept, graph)
            ref = solve_from(
                graph.g, graph.candidates, limit, start, max_evals=_WARM_EVALS, total=True
            )
            if ref is None:  # See Note [Warm start at a new size] rule 6.
                ref, option = cheap_start(graph, limit, _WARM_EVALS)
        if ref is not None:
            option = Option(ref.kept, ref.result, option.method if option else _WARM)
            if not ref.done:
                self._refining = (seen.ordinal, graph, budget, ref)
        elif option is None:
            sol = solve(
                graph.g, graph.candidates, limit, hand=graph.hand, below_reach="total", total=True
            )
            option = Option(sol.kept_ops, sol.result, sol.method, sol.feasible)
        if not option.feasible:
            r = option.result
            peak = r.peak_total_bytes - graph.outside + seen.inputs
            warnings.warn(
                f"ckpt_graph: memory_budget({self.budget!r}): no plan found within "
                f"{budget:,} bytes for region #{seen.ordinal}; the plan with the lowest "
                f"simulated peak ({peak:,} bytes) is used, {peak - budget:,} bytes over: "
                f"{_fixed_bytes(graph) + seen.inputs:,} bytes of values kept whatever the plan "
                "(tags, other policies, activation inputs) and "
                f"{r.peak_total_bytes - r.peak_bytes:,} bytes of gradient buffers and backward "
                "temporaries at the peak; parameters' gradients and memory outside the region "
                "come on top (memory_budget(..., check=True) measures them)",
                stacklevel=5,
            )
        plan = make_plan(graph, option, seen.ordinal, budget)
        self._plans[seen.ordinal] = plan
        self._remember(plan)
        self._last = plan.report
        self._step_plan = None

    def _remember(self, plan: Plan) -> None:
        """Cache the plan of a step of one region (rule 8 of Note [Memory budget policy])."""
        self._cache[plan.signature] = plan
        self._cache.move_to_end(plan.signature)
        while len(self._cache) > _CACHE:
            self._cache.popitem(last=False)

    def _refine(self) -> None:
        """Continue a warm start's search; a cheaper plan found replaces the step's plan.

        See Note [Warm start at a new size] rule 5.
        """
        if self._refining is None:
            return
        ordinal, graph, budget, ref = self._refining
        old = self._plans.get(ordinal)
        if old is None or old.graph is not graph:  # planned again since
            self._refining = None
            return
        if ref.run(_REFINE_EVALS):
            plan = make_plan(graph, Option(ref.kept, ref.result, _WARM), ordinal, budget)
            plan.report = replace(plan.report, reuses=old.report.reuses)
            self._plans[ordinal] = plan
            self._remember(plan)
            self._last = plan.report
        if ref.done:
            self._refining = None

    def _plan_jointly(self) -> None:
        """The DP of rule 3 of Note [Step budget across regions]."""
        budget = step_budget_bytes(self._seen, self.budget)
        plans, step = plan_jointly(self._seen, budget - self._check.correction)
        step = replace(step, budget_bytes=budget, correction_bytes=self._check.correction)
        if not step.feasible and not self._warned_step:
            self._warned_step = True
            warnings.warn(
                f"ckpt_graph: memory_budget({self.budget!r}): no plan found within "
                f"{budget:,} bytes for the step's {step.regions} regions; the plans with the "
                f"lowest predicted step peak found ({step.predicted_peak_bytes:,} bytes) are "
                "used (warned once per policy)",
                stacklevel=5,
            )
        for s, plan in zip(self._seen, plans, strict=True):
            self._plans[s.ordinal] = plan
            self._last = plan.report
        self._step_plan = step

    def _predicted(self) -> int | None:
        """What the plans predict for what the budget bounds, None without a plan.

        See Note [Measured budget check] rule 2.
        """
        if self._step_plan is not None:
            return self._step_plan.predicted_peak_bytes
        plan = self._plans.get(0)
        if plan is None or plan.graph is None:
            return None
        return plan.report.predicted_total_peak_bytes - plan.graph.outside

    def _measured_step(self) -> None:
        """Compare the step that just ended with its prediction; plan again once if it
        missed a byte budget, warn if it still does. See Note [Measured budget check]."""
        m = self._check.stop(self._seen, not self._dirty)
        if m is None or isinstance(self.budget, float):
            return
        budget = int(self.budget)
        if self._check.over(m, budget):
            self._dirty = True  # plan the step again with the correction
            self._cache.clear()
            return
        lowest = not (self._step_plan.feasible if self._step_plan else self._last_feasible())
        self._check.warn(repr(self), m, budget, lowest)

    def _step_over(self) -> None:
        """If every region of the step is done, end its measurement now (rule 1 of Note
        [Measured budget check]): ``report()`` after a step's backward."""
        if self._step and all(_done(r()) for r in self._step):
            self._measured_step()

    def _last_feasible(self) -> bool:
        plan = self._plans.get(0)
        return plan is None or plan.report.feasible

    def report(self, ordinal: int | None = None) -> PlanReport | None:
        """The plan of region ``ordinal`` of a step, or the last one made or used, with
        the step's figures; printed as a table (Note [Budget reports]).

        Example:
            >>> print(policy.report())  # doctest: +SKIP
        """
        self._step_over()
        self._plan_step()
        if ordinal is None:
            last = self._last
        else:
            plan = self._plans.get(ordinal)
            last = plan.report if plan is not None else None
        if last is None:
            return None
        step = self.step_report() if ordinal is None else None
        return BudgetReport(
            **{f.name: getattr(last, f.name) for f in fields(PlanReport)},
            policy=repr(self),
            fraction=self.budget if isinstance(self.budget, float) else None,
            measured_peak_bytes=self._measured_bytes(),
            correction_bytes=self._check.correction,
            step=step,
            regions=step.rows if step is not None else (),
        )

    def step_report(self) -> StepPlan | None:
        """The joint plan of the last step with several regions (None for one region),
        printed as a table with each region's plan (Note [Budget reports]).

        See Note [Step budget across regions].

        Example:
            >>> print(policy.step_report())  # doctest: +SKIP
        """
        self._step_over()
        self._plan_step()
        step = self._step_plan
        if step is None:
            return None
        rows = tuple(
            replace(p.report, ordinal=k)
            for k, p in sorted(self._plans.items(), key=lambda t: t[0])
            if k < step.regions
        )
        return replace(
            step,
            measured_peak_bytes=self._measured_bytes(),
            rows=rows,
            policy=repr(self),
            fraction=self.budget if isinstance(self.budget, float) else None,
        )

    def _measured_bytes(self) -> int | None:
        m = self._check.last
        return m.measured_bytes if m is not None else None


def memory_budget(
    budget: int | float | str, *, flops_per_byte: float | None = None, check: bool = False
) -> MemoryBudget:
    """A policy that keeps what fits ``budget`` with the least recompute.

    Args:
        budget: bytes (an int of at least 1 KiB, or a string with a unit: ``"512MiB"``,
            ``"2GB"``, ``"1.5 GiB"``), or a fraction in (0, 1] (a float, or ``"40%"``; see
            Note [Budget argument]) of the step's simulated peak without checkpointing,
            for one step: regions of a step that share the object (per-layer regions of
            ``wrap`` or ``integrations.transformers.enable``, several ``with`` blocks) share
            the budget, which covers the step's peak (gradients of activations included)
            less the memory outside the regions; one region is a step of one region. With ``check=True`` bytes are
            checked against the step's measured peak, memory outside the regions included. A
            step ends when every
            region of it ran its backward (or was released); its regions are planned
            jointly when the next step starts. See Note [Memory budget policy] and Note
            [Step budget across regions].
        flops_per_byte: FLOPs one byte moved by a memory-bound op is worth when comparing
            recompute costs; ``None`` takes ``$CKPT_GRAPH_FLOPS_PER_BYTE`` if set, else
            measures it on this machine at the first plan. See Note [Recompute cost model]
            and Note [Pinned calibration].
        check: measure the first planned step (and one more after a re-plan) and, for a
            budget in bytes, plan again once with the memory measured outside the plan's
            model; warn once if the budget is still missed. Off by default: on CPU the
            measured step runs under torch's profiler. See Note [Measured budget check].

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
    return MemoryBudget(budget, flops_per_byte=flops_per_byte, check=check)


def _fixed_bytes(graph: RegionGraph) -> int:
    """Bytes of the values the region keeps whatever the plan (tags, other policies)."""
    g = graph.g
    return sum(
        g.values[v].nbytes
        for v in g.fixed
        if g.values[v].storage == v and g.values[v].producer >= 0
    )


def _done(region: Region | None) -> bool:
    """Whether a region of the current step is finished (backward ran, or released)."""
    if region is None:
        return True
    return region.pass_state.number > 0 or region.released
