"""The memory-budget planner: a liveness simulator of backward, costs, and solvers.

``memory_budget`` (re-exported by ``ckpt_graph.policies``) is the policy; ``liveness`` simulates
the engine's backward, ``from_region`` and ``workspaces`` build its inputs from a recorded region,
``seeds`` and ``solve`` search for the cheapest plan that fits.
"""

from __future__ import annotations

__all__: list[str] = []
