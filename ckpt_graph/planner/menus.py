"""Menus: the trade-offs of one region graph that a step's joint plan chooses from.

Rule 2 of Note [Step budget across regions] (a menu per distinct graph, shared by identical
layers) and rule 3 of Note [Warm start at a new size] (a menu from the smaller size's).
"""

from __future__ import annotations

from ckpt_graph.planner.forward_memory import forward_peak, prune
from ckpt_graph.planner.liveness import SimGraph, SimResult, simulate
from ckpt_graph.planner.records import Option, RegionGraph
from ckpt_graph.planner.solve import solve

__all__ = ["everything", "menu", "menu_entry", "undominated", "warm_kept", "warm_menu"]

_MENU = 4  # solver budgets per distinct region graph (Note [Step budget across regions])
_MENU_EVALS = 100


def menu_entry(
    g: SimGraph, kept_ops: frozenset[int], result: SimResult, method: str, feasible: bool = True
) -> Option:
    """The menu entry of a plan: without the kept ops backward never reads, with its
    forward peak (Note [Forward memory of a plan])."""
    kept, result = prune(g, kept_ops, result)
    return Option(kept, result, method, feasible, forward_peak(g, kept))


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
