"""The memory-budget planner: a liveness simulator of backward, records, solvers, adapters.

``memory_budget`` (re-exported by ``ckpt_graph.policies``) is the policy; ``liveness``
simulates the engine's backward on ``sim_graph``'s framework-free graph; ``records`` holds the
plans and reports the modules pass to each other; ``seeds`` and ``solve`` search for the
cheapest plan that fits; ``from_region``, ``workspaces``, ``cost_model`` and ``region_graph``
adapt a recorded region to them. See Note [Planner layers].

# Note [Planner layers]
# Each planner module belongs to one layer and imports only planner modules of its own
# layer and of the layers it builds on (``tests/test_layers.py`` lists the modules and
# checks every import, late and TYPE_CHECKING ones included):
# 1. graph (``sim_graph``): the simulator's graph and result types, plain data, and its
#    numbering as the engine's framework-free pass graph (``engine/pass_graph``).
# 2. simulator (``liveness``): imports only its graph type; from outside the planner only
#    modules that depend on no torch (directly or through what they import): the pass rules
#    it shares with the engine (``engine/pass_graph``, ``engine/pass_core``,
#    ``engine/segment_plan``; Note [One pass core]).
# 3. records (``records``): the records the planner's modules pass to each other (a
#    solver's answer, a plan and its report, a region graph as planned, a block's state, an
#    op's workspace), on graph only, below every solver. A record another module imports is
#    defined here or in ``sim_graph`` and imported from there; the re-exports are the
#    policy's public names (``memory_budget``: ``KeptTensor``, ``PlanReport``, ``StepPlan``)
#    and the graph types next to ``simulate`` (``liveness``).
# 4. solver (``seeds``, ``hand_seeds``, ``milp``, ``local_search``, ``solve``): builds on
#    graph, simulator and records; depends on no torch, like the simulator.
# 5. adapters (``from_region``: a recorded region as the simulator's graph; ``workspaces``;
#    ``cost_model``; ``region_graph``; ``blocks``: block boundaries of a recorded region;
#    ``compile_solver``: the compiler's joint graph, planned in its partitioner): build on
#    1-4; the only planner modules that import the engine.
# 6. plans (``forward_memory``, ``plans``, ``menus``, ``step_budget``, ``across_sizes``):
#    build on 1-4, not on the adapters nor the engine.
# 7. policy parts (``step_tracker``: which regions make up a step; ``budget_planner``: the
#    plans by ordinal and by graph, solver dispatch, warnings; ``budget_heuristic``: the
#    first step's decisions; ``budget_check``; ``budget_report``): build on 1-6.
# 8. policy (``memory_budget``): the thin public policy over the parts of 7, on all of
#    them. The engine hands the policy and its parts the region; they name the region's
#    type (``engine.region``, under TYPE_CHECKING only) and import nothing else of the
#    engine.
# Exceptions, each with its reason in the test: ``StepPlan.__str__`` imports
# ``budget_report``'s table when a plan is printed; ``hand_seeds`` reads the matmul op
# names of ``policies.builtins``; ``BudgetReport`` (the policy's report with its tables)
# stays in ``budget_report``.
"""

from __future__ import annotations

__all__: list[str] = []
