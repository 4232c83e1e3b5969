"""The planner behind a ``memory_budget`` policy: plans by ordinal and by graph, solver
dispatch, the measured check's re-plan, and the warnings.

The policy (``memory_budget.py``) answers the engine op by op; at a block's exit it hands
the block to :meth:`BudgetPlanner.record`, and when a step ends (``step_tracker.py``) it
asks :meth:`BudgetPlanner.next_step` to plan it. See Note [Memory budget policy] (rules 2,
3 and 8) and Note [Step budget across regions].

Example:
    >>> planner = BudgetPlanner(0.5, None, "memory_budget(0.5)")
    >>> planner.plans_for(0), planner.report(None)
    ([], None)
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from ckpt_graph.planner.across_sizes import catch_up, cheap_start, scaled
from ckpt_graph.planner.budget_check import BudgetCheck, Check
from ckpt_graph.planner.budget_heuristic import count_saved
from ckpt_graph.planner.budget_report import BudgetReport
from ckpt_graph.planner.cost_model import machine_flops_per_byte, recorded_costs
from ckpt_graph.planner.local_search import Refinement
from ckpt_graph.planner.menus import warm_kept
from ckpt_graph.planner.plans import make_plan
from ckpt_graph.planner.records import (
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
from ckpt_graph.planner.sim_graph import with_before_backward
from ckpt_graph.planner.solve import solve, solve_from
from ckpt_graph.planner.step_budget import (
    plain_peak,
    plan_jointly,
    reference_bytes,
    step_budget_bytes,
)

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["BudgetPlanner"]

_WARM = "warm start"
# local search of a warm start, then per later step (Note [Warm start at a new size])
_WARM_EVALS = 40
_REFINE_EVALS = 10
# plans of single-region steps kept by graph signature (rule 8 of Note [Memory budget policy])
_CACHE = 8


class _PlanCache:
    """Plans of steps of one region by graph signature, the ``_CACHE`` most recent (rule 8
    of Note [Memory budget policy])."""

    def __init__(self) -> None:
        self._plans: OrderedDict[tuple[Signature, ...], Plan] = OrderedDict()

    def plans(self) -> list[Plan]:
        """The plans kept, most recent first."""
        return list(reversed(self._plans.values()))

    def get(self, signature: tuple[Signature, ...]) -> Plan | None:
        """The plan of a graph, marked most recent; ``None`` if not kept."""
        plan = self._plans.get(signature)
        if plan is not None:
            self._plans.move_to_end(signature)
        return plan

    def put(self, plan: Plan) -> None:
        """Keep ``plan`` as the most recent; drop the oldest beyond ``_CACHE``."""
        self._plans[plan.signature] = plan
        self._plans.move_to_end(plan.signature)
        while len(self._plans) > _CACHE:
            self._plans.popitem(last=False)

    def drop(self, signature: tuple[Signature, ...]) -> None:
        """Forget the plan of a graph, if kept."""
        self._plans.pop(signature, None)

    def clear(self) -> None:
        self._plans.clear()


class BudgetPlanner:
    """Plans the regions of a policy's steps and keeps the plans they follow.

    Attributes:
        check: the measured check (Note [Measured budget check]): on by default for a
            budget in bytes (``check="auto"``), off with ``check=False``.

    Invariants:
        ``plan(k)`` is the plan region ``k`` of a step tries first; the regions recorded
        this step (``record``) are planned at most once per change (``plan_step``).
    """

    def __init__(
        self,
        budget: int | float,
        flops_per_byte: float | None,
        name: str,
        check: Check = "auto",
    ) -> None:
        self._budget = budget
        self._flops_per_byte = flops_per_byte
        self._name = name  # the policy's repr, in warnings and reports
        # See Note [Measured budget check].
        self.check = BudgetCheck(check, isinstance(budget, float))
        self._plans: dict[int, Plan] = {}
        self._last: PlanReport | None = None
        self._warned = False
        self._warned_step = False
        self._pending: str | None = None  # a "no plan found" warning the check may settle
        # the current step (Note [Step budget across regions])
        self._seen: list[Seen] = []
        self._storages: set[int] = set()
        self._graphs: dict[tuple[Signature, ...], RegionGraph] = {}
        self._dirty = False
        self._planned: tuple[int, ...] = ()
        self._step_plan: StepPlan | None = None
        # a warm start's search, continued at later steps (Note [Warm start at a new size])
        self._refining: tuple[int, RegionGraph, int, Refinement] | None = None
        self._cache = _PlanCache()
        self._inputs = 0  # activation inputs of a step of one region
        # a fraction's reference, simulated and as measured (Note [Measured budget check]
        # rule 4); 0: not corrected by a measured step
        self._reference = (0, 0)

    @property
    def _fraction(self) -> bool:
        return isinstance(self._budget, float)

    def plan(self, ordinal: int) -> Plan | None:
        """The plan region ``ordinal`` of a step tries first, if any."""
        return self._plans.get(ordinal)

    def plans_for(self, ordinal: int) -> list[Plan]:
        """The plans region ``ordinal`` tries, in order: its own, the step's others, then
        the plans kept by graph (rules 3 and 8 of Note [Memory budget policy])."""
        own = self._plans.get(ordinal)
        others = dict.fromkeys([*self._plans.values(), *self._cache.plans()])
        return ([own] if own is not None else []) + [p for p in others if p is not own]

    def next_step(self, ended: Callable[[], bool]) -> None:
        """The step is over: compare it with its prediction, plan it (or continue a warm
        start's search), and start recording the next one, measured if the check asks for
        it (Note [Measured budget check]); ``ended()`` says whether that next step is over."""
        self.measure_step()
        if not self.plan_step():
            self._refine()
        self._seen = []
        self._storages = set()
        predicted, boundary = self._predicted()
        self.check.start(predicted, ended, boundary)
        pending, self._pending = self._pending, None
        if pending is not None:
            if self.check.measuring:  # the measured step decides (Note [Measured budget check])
                self._pending = pending
            else:
                warnings.warn(pending, stacklevel=4)

    def _warn_plan(self, message: str) -> None:
        """Warn that no plan fits; after a measured miss, leave it to the measured check
        when the next step will be measured: the re-planned step measures within the
        budget (no warning) or warns once with the measured figures (rule 3 of Note
        [Measured budget check])."""
        if self.check.corrected:
            self._pending = message  # decided when the next step starts
        else:
            warnings.warn(message, stacklevel=6)

    def record(self, region: Region, run: Run) -> None:
        """Record a block that saved something for the step's plan, unless a plan matched
        it fully (rule 3 of Note [Memory budget policy])."""
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
            self._last = plan.report if exact else scaled(plan, run, self._fraction)
            assert plan.graph is not None
            self._seen.append(Seen(run.ordinal, plan.graph, inputs, plan.graph.g.param_grad_bytes))
            return
        warm = [p for p in run.plans if len(p.signature) == n] if run.grown else []
        old = self._plans.get(run.ordinal)
        if old is not None and not self._warned and not warm:
            self._warned = True
            at = run.diverged_at if run.diverged_at >= 0 else len(region.nodes)
            warnings.warn(
                f"ckpt_graph: {self._name}: the graph of region #{run.ordinal} "
                f"of this step differs from the planned one (first at op #{at}); "
                "this step used the online heuristic from there, and the region was planned "
                "again for the next steps (warned once per policy)",
                stacklevel=3,
            )
        graph = self.graph(region, run)
        graph = self._graphs.setdefault(graph.signature, graph)
        if warm and warm[0].graph is not None and graph.menu is None:
            graph.warm = warm[0]  # See Note [Warm start at a new size].
        self._seen.append(Seen(run.ordinal, graph, inputs, graph.g.param_grad_bytes))
        self._dirty = True

    def graph(self, region: Region, run: Run) -> RegionGraph:
        """The block's graph as the planner sees it, with the ops the plan may decide; a
        byte budget's with its ops' measured workspaces (Note [Workspaces in budget
        planning])."""
        # See Note [Parameters' gradients in backward] rule 5; a measured fraction is of the
        # measured step (Note [Measured budget check] rule 4)
        byte_budget = not self._fraction or self.check.mode is True
        return region_graph(region, run, self.op_costs(region, run), byte_budget, byte_budget)

    def op_costs(self, region: Region, run: Run) -> dict[int, int]:
        """Recompute cost per op index of the block. See Note [Recompute cost model]."""
        fpb = self._flops_per_byte
        if fpb is None:
            fpb = machine_flops_per_byte()  # See Note [Pinned calibration]
        return recorded_costs(region, run.answers, fpb)

    def plan_step(self) -> bool:
        """Plan the regions of the current step for the next ones, unless already planned.

        Returns whether it planned. See Note [Step budget across regions].
        """
        if not self._seen:
            return False
        key = tuple(id(s.graph) for s in self._seen)
        added = self._add_workspaces()
        if not self._dirty and key == self._planned and not added:
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

    def _add_workspaces(self) -> bool:
        """Measure the workspaces the step's graphs lack, unless the step running now is
        measured; whether a graph got them. See Note [Workspaces in budget planning]."""
        if self.check.measuring:
            return False
        added = False
        for s in self._seen:
            graph = s.graph
            if graph.unmeasured is not None:
                if not graph.unmeasured(graph):
                    break  # not possible now: planned without them, tried at the next step
                self._cache.drop(graph.signature)  # planned without them
                added = True
        return added

    def _plan_region(self, seen: Seen) -> None:
        """A step of one region: the solver alone (rule 4 of Note [Step budget across
        regions]), or a warm start (Note [Warm start at a new size])."""
        graph = seen.graph
        cached = self._cache.get(graph.signature)
        if cached is not None:  # planned before: See rule 8 of Note [Memory budget policy].
            self._plans.setdefault(seen.ordinal, cached)  # the own plan is still tried first
            self._inputs = seen.inputs
            self._last = cached.report
            self._step_plan = None
            return
        budget = self._budget_bytes([seen])  # See Note [Memory budget policy] rule 1.
        limit = budget + graph.outside - seen.inputs - self.check.correction
        # the loss's backward outside the region, at its boundary (Note [Phases of a measured
        # step]): the simulator adds it to the kept values there
        graph.g = with_before_backward(graph.g, self.check.before_backward or 0)
        self._inputs = seen.inputs
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
            # The plan is held to the budget less what a measured step put outside the
            # planner's model (Note [Measured budget check], rule 2): the figures say so.
            correction = self.check.correction
            target = budget - correction
            within = f"{target:,} bytes"
            if correction:
                within += (
                    f" (the budget, {budget:,} bytes, less {correction:,} bytes a measured "
                    "step put outside the planner's model)"
                )
            self._warn_plan(
                f"ckpt_graph: {self._name}: no plan found within "
                f"{within} for region #{seen.ordinal}; the plan with the lowest "
                f"simulated peak ({peak:,} bytes) is used, {peak - target:,} bytes over: "
                f"{_fixed_bytes(graph) + seen.inputs:,} bytes of values kept whatever the plan "
                "(tags, other policies, activation inputs) and "
                f"{r.peak_total_bytes - r.peak_bytes:,} bytes of gradient buffers and backward "
                "temporaries at the peak; parameters' gradients and memory outside the region "
                "come on top (the measured check learns them: Note [Measured budget check])"
            )
        plan = make_plan(graph, option, seen.ordinal, budget)
        self._plans[seen.ordinal] = plan
        self._cache.put(plan)
        self._last = plan.report
        self._step_plan = None

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
            self._cache.put(plan)
            self._last = plan.report
        if ref.done:
            self._refining = None

    def _plan_jointly(self) -> None:
        """The DP of rule 3 of Note [Step budget across regions]."""
        budget = self._budget_bytes(self._seen)
        # the boundary is the step's, not a region's: See Note [Phases of a measured step].
        for s in self._seen:
            if s.graph.g.before_backward_bytes:
                s.graph.g = with_before_backward(s.graph.g, 0)
                s.graph.menu = s.graph.everything = None
        plans, step = plan_jointly(
            self._seen, budget - self.check.correction, self.check.before_backward or 0
        )
        step = replace(
            step,
            budget_bytes=budget,
            correction_bytes=self.check.correction,
            reference_bytes=self._reference[1],
        )
        if not step.feasible and not self._warned_step:
            self._warned_step = True
            self._warn_plan(
                f"ckpt_graph: {self._name}: no plan found within "
                f"{budget:,} bytes for the step's {step.regions} regions; the plans with the "
                f"lowest predicted step peak found ({step.predicted_peak_bytes:,} bytes) are "
                "used (warned once per policy)"
            )
        for s, plan in zip(self._seen, plans, strict=True):
            self._plans[s.ordinal] = plan
            self._last = plan.report
        self._step_plan = step

    def _predicted(self) -> tuple[int | None, int]:
        """What the plans predict for what the budget bounds (None without a plan), and for
        what they hold when the regions' backward starts.

        See Note [Measured budget check] rule 2 and Note [Phases of a measured step].
        """
        step = self._step_plan
        if step is not None:
            return step.predicted_peak_bytes, step.predicted_boundary_bytes
        plan = self._plans.get(0)
        if plan is None or plan.graph is None:
            return None, 0
        r, outside = plan.report, plan.graph.outside
        return (
            r.predicted_total_peak_bytes - outside + self._inputs,
            r.predicted_kept_bytes - outside + self._inputs,
        )

    def _budget_bytes(self, seen: list[Seen]) -> int:
        """The step's budget in bytes: a fraction of its simulated peak without
        checkpointing, or of that peak as a measured step corrected it (Note [Measured
        budget check] rule 4)."""
        check = self.check
        if not self._fraction:
            return step_budget_bytes(seen, self._budget)
        if not check.learnt:
            plain = plain_peak(seen)
            self._reference = (plain, 0)
            return int(self._budget * plain)
        reference = reference_bytes(seen, check.correction, check.before_backward or 0)
        self._reference = (plain_peak(seen), reference)
        return int(self._budget * reference)

    def measure_step(self) -> None:
        """Compare the step that just ended with its prediction; plan again once if it
        missed its budget (a fraction's: of the reference the measurement corrected), warn
        if it still does. See Note [Measured budget check]."""
        m = self.check.stop(self._seen, not self._dirty)
        if m is None:
            return
        if self._fraction and not self.check.learnt:
            self.check.learn(m)  # See Note [Measured budget check] rule 4.
        budget = self._budget_bytes(self._seen)
        self._pending = None  # the measurement settles it
        if self.check.over(m, budget):
            self._dirty = True  # plan the step again with the correction
            self._cache.clear()
            return
        lowest = not (self._step_plan.feasible if self._step_plan else self._last_feasible())
        self.check.warn(self._name, m, budget, lowest)

    def _last_feasible(self) -> bool:
        plan = self._plans.get(0)
        return plan is None or plan.report.feasible

    def report(self, ordinal: int | None) -> BudgetReport | None:
        """The plan of region ``ordinal`` of a step, or the last one made or used, with the
        step's figures (Note [Budget reports]); plans the step first if it needs it."""
        self.plan_step()
        if ordinal is None:
            last = self._last
        else:
            plan = self._plans.get(ordinal)
            last = plan.report if plan is not None else None
        if last is None:
            return None
        step = self.step_report() if ordinal is None else None
        figures = {f.name: getattr(last, f.name) for f in fields(PlanReport)}
        simulated, reference = self._reference
        if reference:  # a plan made before the measurement is held to the corrected budget
            figures["budget_bytes"] = int(self._budget * reference)
        return BudgetReport(
            **figures,
            policy=self._name,
            fraction=self._budget if self._fraction else None,
            measured_peak_bytes=self._measured_bytes(),
            correction_bytes=self.check.correction,
            before_backward_bytes=self.check.before_backward or 0,
            checked=self._checked(),
            plain_peak_bytes=simulated,
            reference_bytes=reference,
            step=step,
            regions=step.rows if step is not None else (),
        )

    def step_report(self) -> StepPlan | None:
        """The joint plan of the last step with several regions (None for one region), with
        each region's plan (Note [Budget reports]); plans the step first if it needs it."""
        self.plan_step()
        step = self._step_plan
        if step is None:
            return None
        rows = tuple(
            replace(p.report, ordinal=k)
            for k, p in sorted(self._plans.items(), key=lambda t: t[0])
            if k < step.regions
        )
        reference = self._reference[1]
        return replace(
            step,
            budget_bytes=int(self._budget * reference) if reference else step.budget_bytes,
            reference_bytes=reference,
            measured_peak_bytes=self._measured_bytes(),
            checked=self._checked(),
            rows=rows,
            policy=self._name,
            fraction=self._budget if self._fraction else None,
        )

    def _checked(self) -> str:
        """What the measured check did, for the reports (Note [Measured budget check])."""
        if not self._fraction:
            return self.check.status(int(self._budget))
        reference = self._reference[1]
        return self.check.status(int(self._budget * reference) if reference else None)

    def _measured_bytes(self) -> int | None:
        m = self.check.last
        return m.measured_bytes if m is not None else None


def _fixed_bytes(graph: RegionGraph) -> int:
    """Bytes of the values the region keeps whatever the plan (tags, other policies)."""
    g = graph.g
    return sum(
        g.values[v].nbytes
        for v in g.fixed
        if g.values[v].storage == v and g.values[v].producer >= 0
    )
