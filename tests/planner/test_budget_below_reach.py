"""A budget below what recompute can reach: the plan with the lowest real peak.

See step 7 of Note [Memory budget planning] (``ckpt_graph/planner/solve.py``).
"""

from __future__ import annotations

import warnings

import pytest

from ckpt_graph.compare.runner import run_comparison

SIZES = dict(layers=4, width=64, batch=4, seq_len=64)


@pytest.mark.slow  # run by .ci/run after the README's test command (issue 21 item 14)
def test_below_reach_beats_torch_checkpoint_per_block() -> None:
    """memory_budget(0.001) on a 4-layer GPT cannot fit; the plan it falls back to must
    measure no higher a step peak than torch.utils.checkpoint per block, for no more FLOPs,
    with the gradients of the run without checkpointing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no plan found": expected here
        results = run_comparison(
            "gpt", **SIZES, strategies=["torch-ckpt", "cg-budget"], repeat=1, budget=0.001
        )
    by = {r.strategy: r for r in results}
    assert all(r.status == "ok" for r in results), [(r.strategy, r.note) for r in results]
    torch_ckpt, budget = by["torch-ckpt"], by["cg-budget"]
    assert "does not fit" in budget.note
    assert budget.peak_bytes is not None and torch_ckpt.peak_bytes is not None
    assert budget.peak_bytes <= torch_ckpt.peak_bytes, (budget.peak_bytes, torch_ckpt.peak_bytes)
    assert budget.extra_flops is not None and torch_ckpt.extra_flops is not None
    assert budget.extra_flops <= torch_ckpt.extra_flops
    assert budget.max_grad_diff == 0.0
