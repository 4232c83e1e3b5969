"""``memory_budget(budget)``: keep what fits a memory budget with the least recompute.

``MemoryBudget`` is the policy protocol only (which blocks are open, an answer per op); it
holds a ``StepTracker`` (``step_tracker.py``: which regions make up a step, when it ends)
and a ``BudgetPlanner`` (``budget_planner.py``: plans by ordinal and by graph, the solver,
the measured check's re-plan, the warnings).

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
#    same figure (its forward peak is not budgeted there), with the gradients the step
#    makes for the regions' parameters (Note [Parameters' gradients in backward]). What
#    that figure leaves out (memory outside the regions, the parameters read there and
#    their gradients, the simulator's error) a byte
#    budget learns from its first planned step, measured by default (Note [Measured
#    budget check]); a fraction keeps its meaning, of the simulated peak, unless measured
#    (``check=True``: then of the peak its measured step corrects, Note [Measured budget
#    check] rule 4). Before, one region's budget
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

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.planner.across_sizes import follow, match, op_shapes
from ckpt_graph.planner.budget_check import Check
from ckpt_graph.planner.budget_heuristic import heuristic, views_of_kept
from ckpt_graph.planner.budget_planner import BudgetPlanner
from ckpt_graph.planner.cost_model import parse_budget
from ckpt_graph.planner.records import KeptTensor, PlanReport, Run, StepPlan
from ckpt_graph.planner.step_tracker import StepTracker

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region
    from ckpt_graph.planner.compile_solver import CompileSolver

__all__ = ["KeptTensor", "MemoryBudget", "PlanReport", "StepPlan", "memory_budget"]

_DETACH = "aten.detach.default"
_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


class MemoryBudget:
    """The policy object returned by :func:`memory_budget`. See Note [Memory budget policy].

    A thin policy over two parts: ``steps`` tells which regions make up one training step
    and when it ends (``step_tracker.py``); ``planner`` keeps the plans, runs the solver
    and warns (``budget_planner.py``). The policy answers the engine op by op: from a
    plan it follows, else from the heuristic (``budget_heuristic.py``).

    Attributes:
        budget: bytes (an int) or a fraction (a float), as parsed from the argument.
        flops_per_byte: the pinned recompute-cost ratio, or ``None`` (calibrated).
        check: ``"auto"`` (the default), ``True`` or ``False``: whether the measured check
            runs (Note [Measured budget check]).
        steps: the regions of the current step (a :class:`StepTracker`).
        planner: the plans and the solver (a :class:`BudgetPlanner`).

    Known limitations:
        The plan bounds the simulated step peak of the regions (activations, gradient
        buffers, backward temporaries, the gradients of their parameters); memory outside
        them (the loss outside a region, gradients of parameters read there) is learnt from a measured step (Note [Measured budget
        check]), and without one it comes on top of a byte budget. The simulator's unpack
        order is autograd's usual one for a region (reverse forward order). A step of one
        region does not budget its forward peak.
    """

    def __init__(
        self,
        budget: int | float | str,
        *,
        flops_per_byte: float | None = None,
        check: Check = "auto",
    ) -> None:
        self.budget: int | float = parse_budget(budget)
        if check not in (True, False, "auto") or not isinstance(check, (bool, str)):
            raise CkptGraphValueError(
                f"ckpt_graph: memory_budget(check={check!r}) must be 'auto' (measure a "
                "budget in bytes when no profiler or measure() runs), True or False"
            )
        self.check: Check = check
        if flops_per_byte is not None and not flops_per_byte >= 0:
            raise CkptGraphValueError(
                f"ckpt_graph: memory_budget(flops_per_byte={flops_per_byte!r}) must be >= 0 "
                "(FLOPs one byte moved costs); leave it None to calibrate on this machine"
            )
        self.flops_per_byte = flops_per_byte
        self.steps = StepTracker()
        self.planner = BudgetPlanner(self.budget, flops_per_byte, repr(self), check)
        self._runs: dict[int, Run] = {}  # the open blocks, by region id
        self._compile_solver: CompileSolver | None = None

    def __repr__(self) -> str:
        return f"memory_budget({self.budget!r})"

    @property
    def checking(self) -> bool:
        """Whether the measured check still wants steps (Note [Measured budget check]): a
        harness that times or measures steps runs them first, so that the profiler of the
        check meets neither its timing nor its own measurement."""
        return self.planner.check.pending

    @property
    def compile_fraction(self) -> float | None:
        """The budget as the partitioner's fraction under torch.compile (``None``: bytes).

        See Note [memory_budget under torch.compile] in compile_solver.py.
        """
        return self.budget if isinstance(self.budget, float) else None

    def compile_solver(self) -> CompileSolver:
        """The partitioner's knapsack solver of this policy object under torch.compile (made
        at first use; its ``reports`` accumulate over the compiles this policy planned)."""
        if self._compile_solver is None:
            # Imported here: the solver subclasses an inductor type, and importing inductor
            # (about 900 modules) at ``import ckpt_graph`` slows the import and every full
            # garbage collection of a program that never compiles.
            from ckpt_graph.planner.compile_solver import solver_for

            self._compile_solver = solver_for(self)
        return self._compile_solver

    def on_region_enter(self, region: Region) -> None:
        """Start deciding for the ops of ``region`` recorded from now on."""
        run = self._runs.get(id(region))
        if run is not None:
            run.depth += 1
            return
        if self.planner.check.measuring and self.steps.ended():
            state = region.recording
            recording, state.on = state.on, False  # the profiler's stop: not the region's ops
            try:
                self.planner.check.finish()  # See Note [Measured budget check] rule 1.
            finally:
                state.on = recording
        if not torch.is_grad_enabled():  # not a training step: See Note [Memory budget policy]
            return
        if self.steps.over():  # a new step: plan the last one
            state = region.recording
            recording, state.on = state.on, False  # not the region's ops
            try:
                self.planner.next_step(self.steps.ended)
                self.steps.new_step()
            finally:
                state.on = recording
        ordinal = self.steps.add(region)
        plans = self.planner.plans_for(ordinal)
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
        if self.planner.check.on:  # only the measured check's breakdown needs the parameters
            self.planner.check.note_region(region)
        if len(region.saved_log) == run.saved_at_enter:  # saved nothing: not planned (rule 7)
            self.steps.drop(region)
            return
        self.planner.record(region, run)

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

    def report(self, ordinal: int | None = None) -> PlanReport | None:
        """The plan of region ``ordinal`` of a step, or the last one made or used, with
        the step's figures; printed as a table (Note [Budget reports]).

        Example:
            >>> print(policy.report())  # doctest: +SKIP
        """
        self._end_finished_step()
        return self.planner.report(ordinal)

    def step_report(self) -> StepPlan | None:
        """The joint plan of the last step with several regions (None for one region),
        printed as a table with each region's plan (Note [Budget reports]).

        See Note [Step budget across regions].

        Example:
            >>> print(policy.step_report())  # doctest: +SKIP
        """
        self._end_finished_step()
        return self.planner.step_report()

    def _end_finished_step(self) -> None:
        """If every region of the step is done, end its measurement now (rule 1 of Note
        [Measured budget check]): ``report()`` after a step's backward."""
        if self.steps.ended():
            self.planner.measure_step()


def memory_budget(
    budget: int | float | str, *, flops_per_byte: float | None = None, check: Check = "auto"
) -> MemoryBudget:
    """A policy that keeps what fits ``budget`` with the least recompute.

    Args:
        budget: bytes (an int of at least 1 KiB, or a string with a unit: ``"512MiB"``,
            ``"2GB"``, ``"1.5 GiB"``), or a fraction in (0, 1] (a float, or ``"40%"``; see
            Note [Budget argument]) of the step's simulated peak without checkpointing,
            for one step: regions of a step that share the object (per-layer regions of
            ``wrap`` or ``integrations.transformers.enable``, several ``with`` blocks) share
            the budget. A budget in bytes is a promise about the step's *measured* peak
            (parameters' gradients and memory outside the regions included): the plan
            bounds the regions' simulated peak (gradients of activations included), the
            first planned step is measured and the step planned again once with what the
            measurement found outside that model (``check``). A fraction is of the regions'
            simulated peak without checkpointing (with ``check=True``, of that peak as the
            first planned step's measurement corrects it). One region is a step of one region. A step
            ends when every region of it ran its backward (or was released); its regions are
            planned jointly when the next step starts. See Note [Memory budget policy] and
            Note [Step budget across regions].
        flops_per_byte: FLOPs one byte moved by a memory-bound op is worth when comparing
            recompute costs; ``None`` takes ``$CKPT_GRAPH_FLOPS_PER_BYTE`` if set, else
            measures it on this machine at the first plan. See Note [Recompute cost model]
            and Note [Pinned calibration].
        check: ``"auto"`` (default): for a budget in bytes, measure the first planned step
            (and one more after a re-plan; on CPU under torch's profiler, on CUDA with
            ``torch.cuda.max_memory_allocated``, whose peak it resets), plan again once
            with the memory measured outside the plan's model if the step missed the
            budget, and warn once, by how much and why, if it still does. It measures
            nothing while a profiler or ``ckpt_graph.memory.measure`` runs at the step's
            start, nor on other devices: ``report()`` then says why. ``True``: measure
            fraction budgets too: the first planned step corrects the fraction's reference
            (no checkpointing's peak) with the memory outside the regions and the loss's
            backward outside them, and the step is planned again once if it missed the
            fraction of that. ``False``: never measure (the budget then bounds the plan's
            model only). See Note [Measured budget check].

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
