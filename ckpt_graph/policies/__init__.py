"""Built-in policies for ckpt_graph regions: what to keep, recompute or offload.

Example:
    >>> import ckpt_graph as cg
    >>> from ckpt_graph import policies
    >>> with cg.save_recompute_policy(policies.save_matmuls()):  # doctest: +SKIP
    ...     y = model(x)
"""

from __future__ import annotations

from ckpt_graph.planner.memory_budget import MemoryBudget, PlanReport, memory_budget
from ckpt_graph.policies.builtins import (
    Answer,
    Policy,
    PolicyLike,
    offload,
    recompute_ops,
    save_matmuls,
    save_ops,
)
from ckpt_graph.policies.compose import any_save, first_answer, from_torch_sac
from ckpt_graph.policies.modules import ModuleMatch, save_module_outputs

__all__ = [
    "Answer",
    "MemoryBudget",
    "ModuleMatch",
    "PlanReport",
    "Policy",
    "PolicyLike",
    "any_save",
    "first_answer",
    "from_torch_sac",
    "memory_budget",
    "offload",
    "recompute_ops",
    "save_matmuls",
    "save_module_outputs",
    "save_ops",
]
