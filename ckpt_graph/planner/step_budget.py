"""The budget of a step shared by its regions: region graphs, menus, the joint choice.

# Note [Step budget across regions]
# 1. Memory of a step. Backward visits the step's regions in the reverse order of their
#    forward (region k's backward ends before region k-1's starts). What region j keeps,
#    and its activation inputs (values with autograd history made before it, e.g. the
#    hidden states a layer reads, counted once per storage in the first region of the step
#    that reads them), stay alive from its forward until its backward ends. So during the
#    backward of region k the step holds
#        sum over j < k of (kept_j + inputs_j)  +  inputs_k  +  peak_k
#    and while its forward runs
#        sum over j < k of (kept_j + inputs_j)  +  inputs_k  +  forward_k
#    where kept_j is the liveness simulator's ``kept_bytes`` of region j's plan, peak_k its
#    ``peak_total_bytes`` (activations, with the region's gradient buffers and backward
#    temporaries: Note [Backward liveness model] rule 4) and forward_k its forward peak
#    (Note [Forward memory of a plan]). The step's peak is the largest of these terms: what
#    a measurement of the step sees, less the memory outside the regions (rule 5). The
#    budget bounds it; a fraction budget is a fraction of it when every region keeps every
#    candidate (no checkpointing). Before, the terms counted activations only
#    (``peak_bytes``, no forward) against a fraction of the regions' saved bytes: on tiny
#    GPT-2 with a region per layer, a budget meant for HF's checkpointing peak let the last
#    layer keep every candidate, and its forward, holding values backward never reads, was
#    the step's peak at 1.24x HF's; gradients were left out, so a budget in bytes said
#    little about the measured peak, and the simulated peak with them was not even
#    monotone in the budget (tiny Llama: 2,010,048 bytes at 0.2, 1,944,512 at 0.2166).
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
#    predicted step peak.
# 4. A step of one region is planned as before: the solver alone, against the region's
#    budget, which bounds its activation peak (rule 1 of Note [Memory budget policy]).
# 5. Accuracy. Measured (6-layer tiny GPT-2 and Llama, ``integrations.transformers.enable``,
#    tests/integration/test_hf_budget.py), the step's peak is the predicted one plus
#    24 KiB on GPT-2 (the tied embedding's gradient, which autograd holds from the LM
#    head's backward to the embedding's, through every layer's backward) and 73 KiB on
#    Llama (the final norm, LM head and loss, run after the last layer's forward on top of
#    everything the regions hold), keeping everything and at HF's checkpointing peak alike.
#    A budget of a target peak less that difference measures within the target.
# Known limitations: memory outside the step's regions is not modelled (rule 5): the
# policy sees only its regions' ops, and CPU has no allocator statistics to learn it from.
# Measure one step and subtract its peak less ``StepPlan.predicted_peak_bytes`` from the
# budget. A step of one region budgets activations only (rule 4). Forward peaks are lower
# bounds (Note [Forward memory of a plan]). Regions of one step whose backwards interleave
# (two regions in parallel branches) are modelled as nested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ckpt_graph.planner.forward_memory import forward_peak, prune
from ckpt_graph.planner.hand_seeds import block_ids, hand_seeds
from ckpt_graph.planner.liveness import SimGraph, SimResult, from_region, simulate
from ckpt_graph.planner.solve import KeptTensor, PlanReport, candidate_ops, solve

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region
    from ckpt_graph.planner.budget_heuristic import Run

__all__ = [
    "Option",
    "Plan",
    "RegionGraph",
    "Seen",
    "Signature",
    "StepPlan",
    "choose",
    "everything",
    "input_bytes",
    "make_plan",
    "menu",
    "menu_entry",
    "numel",
    "plain_peak",
    "plan_jointly",
    "region_graph",
    "step_budget_bytes",
    "step_peaks",
    "undominated",
    "warm_kept",
    "warm_menu",
]

_MENU = 4  # solver budgets per distinct region graph (Note [Step budget across regions])
_MENU_EVALS = 100
_GRAIN = 1024
Signature = tuple[str, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class Option:
    """One entry of a graph's menu: kept ops, the simulated backward and forward peak.

    ``forward`` is the forward's simulated peak (Note [Forward memory of a plan]); 0 when
    not computed (a step of one region does not use it).
    """

    kept_ops: frozenset[int]
    result: SimResult
    method: str
    feasible: bool = True
    forward: int = 0


def menu_entry(
    g: SimGraph, kept_ops: frozenset[int], result: SimResult, method: str, feasible: bool = True
) -> Option:
    """The menu entry of a plan: without the kept ops backward never reads, with its
    forward peak (Note [Forward memory of a plan])."""
    kept, result = prune(g, kept_ops, result)
    return Option(kept, result, method, feasible, forward_peak(g, kept))


@dataclass
class RegionGraph:
    """A region's graph as planned; one per op signature (Note [Step budget across regions])."""

    signature: tuple[Signature, ...]
    g: SimGraph
    candidates: list[int]
    positions: dict[int, int]
    baseline: int
    outside: int
    hand: dict[str, frozenset[int]] = field(default_factory=dict)  # Note [Hand seeds]
    menu: list[Option] | None = None
    everything: Option | None = None  # keeping every candidate (see ``everything``)
    # the plan of the same ops at smaller sizes to start from (Note [Warm start at a new size])
    warm: Plan | None = None


@dataclass(eq=False)  # by identity: regions of identical layers share one
class Plan:
    signature: tuple[Signature, ...]
    kept: frozenset[int]  # signature positions (see rule 6 of Note [Memory budget policy])
    report: PlanReport
    graph: RegionGraph | None = None
    # output elements of the signature up to each position (See Note [Plans across sizes])
    elements: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.elements:
            total = 0
            for _, shapes in self.signature:
                total += numel(shapes)
                self.elements.append(total)


@dataclass(frozen=True)
class Seen:
    """A region of the current step whose block exited: its graph and activation inputs."""

    ordinal: int
    graph: RegionGraph
    inputs: int


@dataclass(frozen=True)
class StepPlan:
    """The joint plan of a step's regions (Note [Step budget across regions]).

    Attributes:
        regions: regions in the step.
        budget_bytes: the step's budget in bytes.
        baseline_bytes: the step's activation bytes without checkpointing.
        input_bytes: activation inputs of the regions (always kept), in the step's peak.
        predicted_peak_bytes: the largest term of rule 1 of the Note: the step's peak as
            a measurement sees it, less the memory outside the regions (rule 5).
        predicted_recompute_flops: summed recompute cost of the regions' plans.
        feasible: whether the plan fits the budget (else: the budget was raised to fit).
        graphs: distinct region graphs (identical layers share one).
        predicted_activation_peak_bytes: the same without the regions' gradient buffers
            and backward temporaries.
        plain_peak_bytes: ``predicted_peak_bytes`` of keeping every candidate (no
            checkpointing): what a fraction budget is a fraction of.
    """

    regions: int
    budget_bytes: int
    baseline_bytes: int
    input_bytes: int
    predicted_peak_bytes: int
    predicted_recompute_flops: int
    feasible: bool
    graphs: int
    predicted_activation_peak_bytes: int
    plain_peak_bytes: int


def input_bytes(region: Region, since: int, storages: set[int]) -> int:
    """Bytes of the activation inputs of ``region`` from input ``since`` on, not in ``storages``.

    Region inputs with autograd history (a previous layer's output) are activations
    the region keeps until its backward; parameters, the batch and other leaves are
    not. An input the program no longer references (``h = block(h)`` inside a ``with``
    block rebinds ``h`` before the region exits) lives only in the region's hold of it,
    and counts too. See Note [Step budget across regions] rule 1.
    """
    total = 0
    for h in region.inputs[since:]:
        if h.ref is None:
            continue
        t = h.ref()
        if t is None:  # dropped by the program: alive through the region's hold
            t = h.value if h.offload_device is None else None
            if t is None:
                continue
        elif t.grad_fn is None:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a subclass without storage
            continue
        key = storage.data_ptr()
        if key not in storages:
            storages.add(key)
            total += storage.nbytes()
    return total


def region_graph(region: Region, run: Run, costs: dict[int, int]) -> RegionGraph:
    """The graph of ``run``'s block as the planner sees it, with the ops the plan may decide.

    ``costs``: recompute cost per op index (Note [Recompute cost model]).
    """
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
    g = from_region(region, costs, free)
    candidates = candidate_ops(g, free)
    hand = hand_seeds(g, candidates, block_ids([n.module_path for n in region.nodes]))
    own = {g.values[v].storage for _, v in g.saved if g.values[v].producer >= run.start}
    baseline = sum(g.values[s].nbytes for s in own if g.values[s].producer >= 0)
    outside = simulate(g, []).kept_bytes  # fixed kept storages count against the budget
    fixed_in = {g.values[v].storage for v in g.fixed if g.values[v].producer >= run.start}
    outside -= sum(g.values[s].nbytes for s in fixed_in)
    positions = {j: run.positions[j] for j in candidates if j in run.positions}
    return RegionGraph(tuple(run.signature), g, candidates, positions, baseline, outside, hand)


def plan_jointly(seen: list[Seen], budget: int) -> tuple[list[Plan], StepPlan]:
    """The plan of each region of ``seen`` and the step's figures, within ``budget`` bytes.

    The DP of rule 3 of Note [Step budget across regions]; if nothing fits, the budget is
    raised by 5% steps until a choice does (``StepPlan.feasible`` is then False).
    """
    baseline = sum(s.graph.baseline + s.inputs for s in seen)
    outside = sum(s.graph.outside for s in seen)
    plain = plain_peak(seen)
    menus = [warm_menu(s.graph) if s.graph.warm else menu(s.graph) for s in seen]
    limit = budget + outside
    choice = choose(seen, menus, limit)
    if choice is None and any(s.graph.warm for s in seen):
        for s in seen:  # See Note [Warm start at a new size].
            if s.graph.warm is not None:
                s.graph.warm = s.graph.menu = None
        menus = [menu(s.graph) for s in seen]
        choice = choose(seen, menus, limit)
    while choice is None:  # nothing fits: raise the budget until a plan does
        limit = int(limit * 1.05) + 1
        choice = choose(seen, menus, limit)
    chosen = [options[m] for options, m in zip(menus, choice, strict=True)]
    peak, activations = step_peaks(seen, chosen)
    cost = sum(o.result.recompute_cost for o in chosen)
    shared: dict[tuple[int, int], Plan] = {}
    plans = []
    prefix = 0
    for s, options, m in zip(seen, menus, choice, strict=True):
        plan = shared.get((id(s.graph), m))
        if plan is None:
            share = budget + outside - prefix - s.inputs  # what this region may use
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
    )
    return plans, step


def step_peaks(seen: list[Seen], options: list[Option]) -> tuple[int, int]:
    """The step's simulated peak with ``options[k]`` for region k, and its activation peak.

    The largest terms of rule 1 of Note [Step budget across regions], with each region's
    ``peak_total_bytes`` and with its ``peak_bytes``.
    """
    prefix = peak = activations = 0
    for s, o in zip(seen, options, strict=True):
        r = o.result
        peak = max(peak, prefix + s.inputs + max(r.peak_total_bytes, o.forward))
        activations = max(activations, prefix + s.inputs + max(r.peak_bytes, o.forward))
        prefix += s.inputs + r.kept_bytes
    return peak, activations


def plain_peak(seen: list[Seen]) -> int:
    """The step's simulated peak keeping every candidate, less fixed values kept before the
    policy's blocks (``RegionGraph.outside``): what a fraction budget is a fraction of."""
    plain = step_peaks(seen, [everything(s.graph) for s in seen])[0]
    return plain - sum(s.graph.outside for s in seen)


def step_budget_bytes(seen: list[Seen], budget: int | float) -> int:
    """A step's budget in bytes: an int as is, a fraction of :func:`plain_peak`."""
    return int(budget * plain_peak(seen)) if isinstance(budget, float) else int(budget)


def everything(graph: RegionGraph) -> Option:
    """The plan of ``graph`` keeping every candidate (pruned, see :func:`menu_entry`)."""
    if graph.everything is None:
        g, cands = graph.g, frozenset(graph.candidates)
        graph.everything = menu_entry(g, cands, simulate(g, cands), "all")
    return graph.everything


def menu(graph: RegionGraph) -> list[Option]:
    """Trade-offs of one region graph (rule 2 of Note [Step budget across regions])."""
    if graph.menu is not None:
        return graph.menu
    g, cands = graph.g, graph.candidates
    options = [menu_entry(g, frozenset(), simulate(g, []), "none"), everything(graph)]
    low = solve(g, cands, 0, max_evals=_MENU_EVALS, hand=graph.hand)
    options.append(menu_entry(g, low.kept_ops, low.result, low.method))
    lo = min(o.result.peak_bytes for o in options)
    hi = options[1].result.peak_bytes
    for i in range(1, _MENU):
        sol = solve(g, cands, lo + (hi - lo) * i // _MENU, max_evals=_MENU_EVALS, hand=graph.hand)
        if sol.feasible:
            options.append(menu_entry(g, sol.kept_ops, sol.result, sol.method))
    graph.menu = undominated(options)
    return graph.menu


def undominated(options: list[Option]) -> list[Option]:
    """``options`` without the dominated ones (no lower peak, forward peak, kept bytes or
    cost than another), cheapest first."""
    entries: list[Option] = []
    for o in sorted(options, key=lambda o: (o.result.recompute_cost, o.result.peak_total_bytes)):
        r = o.result
        if not any(
            m.result.peak_total_bytes <= r.peak_total_bytes
            and m.result.kept_bytes <= r.kept_bytes
            and m.forward <= o.forward
            for m in entries
        ):
            entries.append(o)
    return entries


def make_plan(graph: RegionGraph, option: Option, ordinal: int, budget: int) -> Plan:
    """The plan of ``graph`` that keeps ``option``'s ops, with its report.

    Kept ops that backward never reads are dropped (Note [Forward memory of a plan]).
    """
    g = graph.g
    kept_ops, result = prune(g, option.kept_ops, option.result)
    option = replace(option, kept_ops=kept_ops, result=result)
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
    return Plan(graph.signature, kept_pos, report, graph)


def choose(seen: list[Seen], menus: list[list[Option]], limit: int) -> list[int] | None:
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
            for m, entry in enumerate(menu):
                r = entry.result
                if prefix + s.inputs + max(r.peak_total_bytes, entry.forward) > limit:
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


def numel(shapes: tuple[tuple[int, ...], ...]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def warm_kept(kept: frozenset[int], graph: RegionGraph) -> frozenset[int]:
    """Kept signature positions of a plan as op indices of ``graph`` (same ops, other sizes).

    Positions that are not candidates of ``graph`` (decided otherwise there) are dropped.
    """
    back = {pos: j for j, pos in graph.positions.items()}
    return frozenset(back[pos] for pos in kept if pos in back)


def warm_menu(graph: RegionGraph) -> list[Option]:
    """The menu of ``graph`` from its warm start's, simulated at its sizes.

    See Note [Warm start at a new size] rule 3.
    """
    if graph.menu is not None:
        return graph.menu
    plan = graph.warm
    assert plan is not None and plan.graph is not None
    old = plan.graph
    starts = [plan.kept]
    for o in old.menu or []:
        starts.append(frozenset(old.positions[j] for j in o.kept_ops if j in old.positions))
    g, cands = graph.g, graph.candidates
    options = [menu_entry(g, frozenset(), simulate(g, []), "none"), everything(graph)]
    seen = {frozenset[int](), frozenset(cands)}
    for kept_pos in starts:
        kept = warm_kept(kept_pos, graph)
        if kept not in seen:
            seen.add(kept)
            options.append(menu_entry(g, kept, simulate(g, kept), "warm start"))
    graph.menu = undominated(options)
    return graph.menu
