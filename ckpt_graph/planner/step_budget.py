"""The budget of a step shared by its regions: the joint choice of each region's plan.

# Note [Step budget across regions]
# 1. Memory of a step. Backward visits the step's regions in the reverse order of their
#    forward (region k's backward ends before region k-1's starts). What region j keeps,
#    and its activation inputs (values with autograd history made before it, e.g. the
#    hidden states a layer reads, counted once per storage in the first region of the step
#    that reads them), stay alive from its forward until its backward ends. So during the
#    backward of region k the step holds
#        sum over j < k of (kept_j + inputs_j)  +  inputs_k  +  peak_k  +  sum over j > k of grads_j
#    (grads_j: the parameters' gradient buffers region j's backward made, alive to the end
#    of the step: ``SimGraph.param_grad_bytes``, Note [Parameters' gradients in backward])
#    and while its forward runs
#        sum over j < k of (kept_j + inputs_j)  +  inputs_k  +  forward_k
#    where kept_j is the liveness simulator's ``kept_bytes`` of region j's plan, peak_k its
#    ``peak_total_bytes`` (activations, with the region's gradient buffers and backward
#    temporaries: Note [Backward liveness model] rule 4) and forward_k its forward peak
#    (Note [Forward memory of a plan]). The step's peak is the largest of these terms: what
#    a measurement of the step sees, less the memory outside the regions (rule 5). The
#    budget bounds it; a fraction budget is a fraction of it when every region keeps every
#    candidate (no checkpointing; measured, with the terms of rule 4 of Note [Measured
#    budget check]). Every term counts: activations alone leave out the
#    forward of the last region (which can be the step's peak) and the gradients, and a
#    budget in bytes would then say little about the measured peak.
# 2. Identical layers share a graph: a region's graph is stored once per op signature
#    (rule 3 of Note [Memory budget policy]), and so is its *menu*: the trade-offs
#    (kept bytes, peak, forward peak, recompute cost) of keeping nothing, keeping every
#    candidate, and the solver's plans for ``_MENU`` activation budgets spread between the
#    lowest activation peak it finds and that of keeping everything, each without the kept
#    ops backward never reads (``forward_memory.prune``). Regions given the same menu entry
#    share one plan.
# 3. Joint choice: a DP over the regions in forward order picks one menu entry per region
#    with the least summed recompute cost such that every term of rule 1 fits the budget.
#    Its state is the prefix sum of rule 1 (rounded up to 1/1024 of the budget); states
#    with a larger prefix and no lower cost are dropped. Later regions thus keep more: what
#    they keep is freed first (unless their forward terms bind). If nothing fits, the
#    budget is raised by 5% steps until a plan does and the policy warns once with the
#    predicted step peak. The raise starts from at least ``_GRAIN`` bytes and stops at the
#    step peak of each region's lowest-peak entry, which always fits: a budget that kept
#    values alone exceed (a limit at or below zero) once raised it towards minus infinity.
# 4. A step of one region is planned by the solver alone (finer than a menu), against the
#    same budget (rule 1 of Note [Memory budget policy]): its activation inputs plus its
#    ``peak_total_bytes``; its forward peak is not budgeted.
# 5. Accuracy. Measured (6-layer tiny GPT-2 and Llama, ``integrations.transformers.enable``,
#    tests/integration/test_hf_budget.py), the step's peak is the predicted one plus
#    24 KiB on GPT-2 (the tied embedding's gradient, which autograd holds from the LM
#    head's backward to the embedding's, through every layer's backward) and 73 KiB on
#    Llama (the final norm, LM head and loss, run after the last layer's forward on top of
#    everything the regions hold), keeping everything and at HF's checkpointing peak alike.
#    A budget of a target peak less that difference measures within the target.
# 6. The boundary. When the regions' backward starts, everything they keep and their
#    activation inputs are alive (the DP's last prefix), and a loss computed outside them
#    runs its backward on top: a measured step gives its bytes (Note [Phases of a measured
#    step]), and the last prefix plus them must fit the budget too.
# Known limitations: memory outside the step's regions is not modelled (rule 5): the
# policy sees only its regions' ops, and CPU has no allocator statistics to learn it from.
# Measure one step and subtract its peak less ``StepPlan.predicted_peak_bytes`` from the
# budget. A step of one region does not budget its forward (rule 4). Forward peaks are lower
# bounds (Note [Forward memory of a plan]). Regions of one step whose backwards interleave
# (two regions in parallel branches) are modelled as nested.
"""

from __future__ import annotations

import math

from ckpt_graph.planner.menus import everything, menu, warm_menu
from ckpt_graph.planner.plans import make_plan
from ckpt_graph.planner.records import Option, Plan, Seen, StepPlan

__all__ = [
    "choose",
    "grads_after",
    "plain_peak",
    "plan_jointly",
    "reference_bytes",
    "step_budget_bytes",
    "step_peaks",
]

_GRAIN = 1024


def plan_jointly(seen: list[Seen], budget: int, before: int = 0) -> tuple[list[Plan], StepPlan]:
    """The plan of each region of ``seen`` and the step's figures, within ``budget`` bytes,
    with ``before`` bytes outside the regions on top of their kept values when their
    backward starts (rule 6 of Note [Step budget across regions]).

    The DP of rule 3 of Note [Step budget across regions]; if nothing fits, the budget is
    raised by 5% steps until a choice does (``StepPlan.feasible`` is then False).
    """
    baseline = sum(s.graph.baseline + s.inputs for s in seen)
    outside = sum(s.graph.outside for s in seen)
    plain = plain_peak(seen)
    menus = [warm_menu(s.graph) if s.graph.warm else menu(s.graph) for s in seen]
    limit = budget + outside
    choice = choose(seen, menus, limit, before)
    if choice is None and any(s.graph.warm for s in seen):
        for s in seen:  # See Note [Warm start at a new size].
            if s.graph.warm is not None:
                s.graph.warm = s.graph.menu = None
        menus = [menu(s.graph) for s in seen]
        choice = choose(seen, menus, limit, before)
    if choice is None:  # nothing fits: raise the budget until a plan does (rule 3)
        # the lowest-peak entry of each region fits its own step peak: the loop ends there
        low = [
            min(options, key=lambda o: (o.result.peak_total_bytes, o.forward)) for options in menus
        ]
        reach = step_peaks(seen, low, before)[0]
        while choice is None:
            limit = min(max(int(limit * 1.05) + 1, _GRAIN), reach)
            choice = choose(seen, menus, limit, before)
            if choice is None and limit >= reach:  # the DP's rounding at the boundary
                choice = choose(seen, menus, limit)
    chosen = [options[m] for options, m in zip(menus, choice, strict=True)]
    peak, activations = step_peaks(seen, chosen, before)
    cost = sum(o.result.recompute_cost for o in chosen)
    shared: dict[tuple[int, int], Plan] = {}
    plans = []
    prefix = 0
    for s, options, m, grads in zip(seen, menus, choice, grads_after(seen), strict=True):
        plan = shared.get((id(s.graph), m))
        if plan is None:
            share = budget + outside - prefix - s.inputs - grads  # what this region may use
            plan = make_plan(s.graph, options[m], s.ordinal, share)
            shared[id(s.graph), m] = plan
        plans.append(plan)
        prefix += s.inputs + options[m].result.kept_bytes
    step = StepPlan(
        regions=len(seen),
        budget_bytes=budget,
        baseline_bytes=baseline,
        input_bytes=sum(s.inputs for s in seen),
        predicted_peak_bytes=peak - outside,
        predicted_recompute_flops=cost,
        feasible=limit == budget + outside,
        graphs=len({id(s.graph) for s in seen}),
        predicted_activation_peak_bytes=activations - outside,
        plain_peak_bytes=plain,
        predicted_boundary_bytes=prefix - outside,
        before_backward_bytes=before,
    )
    return plans, step


def step_peaks(seen: list[Seen], options: list[Option], before: int = 0) -> tuple[int, int]:
    """The step's simulated peak with ``options[k]`` for region k, and its activation peak.

    The largest terms of rule 1 of Note [Step budget across regions], with each region's
    ``peak_total_bytes`` and with its ``peak_bytes``; the first with the boundary term of
    rule 6 (``before`` bytes on top of every kept value and activation input).
    """
    prefix = peak = activations = 0
    for s, o, after in zip(seen, options, grads_after(seen), strict=True):
        r = o.result
        peak = max(peak, prefix + s.inputs + max(r.peak_total_bytes + after, o.forward))
        activations = max(activations, prefix + s.inputs + max(r.peak_bytes, o.forward))
        prefix += s.inputs + r.kept_bytes
    return max(peak, prefix + before), activations


def grads_after(seen: list[Seen]) -> list[int]:
    """Per region, the parameters' gradient buffers that the regions after it made in their
    backward, which ran before its own (rule 1 of Note [Step budget across regions])."""
    after = [0] * len(seen)
    total = 0
    for k in range(len(seen) - 1, -1, -1):
        after[k] = total
        total += seen[k].grads
    return after


def plain_peak(seen: list[Seen], before: int = 0) -> int:
    """The step's simulated peak keeping every candidate, less fixed values kept before the
    policy's blocks (``RegionGraph.outside``): what a fraction budget is a fraction of;
    with ``before`` bytes on top of every kept value when the regions' backward starts
    (rule 6)."""
    plain = step_peaks(seen, [everything(s.graph) for s in seen], before)[0]
    return plain - sum(s.graph.outside for s in seen)


def reference_bytes(seen: list[Seen], correction: int = 0, before: int = 0) -> int:
    """What a fraction budget is a fraction of: the step's peak without checkpointing,
    simulated (:func:`plain_peak`), or as a measured step's two terms correct it (Note
    [Phases of a measured step] rule 6): ``correction`` bytes outside the regions
    throughout, ``before`` more on top of every kept value when their backward starts."""
    return plain_peak(seen, before) + correction


def step_budget_bytes(
    seen: list[Seen], budget: int | float, correction: int = 0, before: int = 0
) -> int:
    """A step's budget in bytes: an int as is, a fraction of :func:`reference_bytes`."""
    if isinstance(budget, float):
        return int(budget * reference_bytes(seen, correction, before))
    return int(budget)


def choose(
    seen: list[Seen], menus: list[list[Option]], limit: int, before: int = 0
) -> list[int] | None:
    """Menu entry per region, least summed recompute cost within ``limit``, or None.

    A DP over the regions in forward order on the prefix sum of rule 1 of Note [Step budget
    across regions], rounded up to ``limit / _GRAIN``; the final prefix plus ``before``
    (rule 6) within ``limit`` too.
    """
    grain = max(1, limit // _GRAIN)
    # state: rounded prefix -> (prefix, cost, choices so far)
    states: dict[int, tuple[int, int, tuple[int, ...]]] = {0: (0, 0, ())}
    for k, (s, entries, grads) in enumerate(zip(seen, menus, grads_after(seen), strict=True)):
        nxt: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        for prefix, cost, picks in states.values():
            for m, entry in enumerate(entries):
                r = entry.result
                if prefix + s.inputs + max(r.peak_total_bytes + grads, entry.forward) > limit:
                    continue
                after = prefix + s.inputs + r.kept_bytes
                key = math.ceil(after / grain)
                total = cost + r.recompute_cost
                old = nxt.get(key)
                if old is None or (total, after) < (old[1], old[0]):
                    nxt[key] = (after, total, (*picks, m))
        if k == len(seen) - 1:  # the boundary (rule 6)
            nxt = {key: t for key, t in nxt.items() if t[0] + before <= limit}
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
