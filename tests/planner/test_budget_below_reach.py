"""A budget below what recompute can reach: the plan with the lowest real peak.

See step 7 of Note [Memory budget planning] (``ckpt_graph/planner/solve.py``).
"""

from __future__ import annotations

import warnings

import pytest

from ckpt_graph.compare.runner import run_comparison

SIZES = dict(layers=4, width=64, batch=4, seq_len=64)


@pytest.mark.slow  # run by .ci/run after the README's test command (issue 21 item 14)
def test_below_reach_falls_back_to_a_peak_below_torch_checkpoint_per_block() -> None:
    """memory_budget(0.001) on a 4-layer GPT cannot fit; it falls back to the lowest-peak plan
    it found, which must measure no higher a step peak than torch.utils.checkpoint per block,
    recompute no more than one region ``recompute_all`` (the bounded cache: about two
    forwards), and give the gradients of the run without checkpointing.

    (Before the bounded cache sized itself from the pass, the lowest peak was also torch's
    FLOPs or fewer; the lowest-peak plan now trades recompute for a lower peak: 3.35 MB at
    0.187 GFLOP against torch's 3.56 MB at 0.084.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no plan found": expected here
        results = run_comparison(
            "gpt",
            **SIZES,
            strategies=["torch-ckpt", "cg-budget", "cg-policy"],
            policy="recompute_all",
            repeat=1,
            budget=0.001,
        )
    by = {r.strategy: r for r in results}
    assert all(r.status == "ok" for r in results), [(r.strategy, r.note) for r in results]
    torch_ckpt, budget, one_region = by["torch-ckpt"], by["cg-budget"], by["cg-policy"]
    assert "does not fit" in budget.note
    assert budget.peak_bytes is not None and torch_ckpt.peak_bytes is not None
    assert budget.peak_bytes <= torch_ckpt.peak_bytes, (budget.peak_bytes, torch_ckpt.peak_bytes)
    assert budget.extra_flops is not None and one_region.extra_flops is not None
    assert budget.extra_flops <= one_region.extra_flops
    assert budget.max_grad_diff == 0.0
