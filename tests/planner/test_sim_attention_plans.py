"""The simulator on plans that keep some of an eager attention's T x T values.

On the anchor GPT-2 (``benchmarks/bench_anchor.py``) the plan search finds plans that keep
part of the attention probabilities and dropout masks, right at a byte budget. Measured
there, the region's backward peaks where the simulator says, within 0.02%; the step's peak
is higher by the loss computed outside the region (its saved log-softmax and the two
buffers of its backward, on top of every kept value at backward's start), which the
simulator does not see (Note [Backward liveness model], known limitations) and which the
measured check learns (Note [Measured budget check]). These tests pin the first: with the loss
in the region the prediction is the measured peak of the step's backward, to the byte
here, and the gradients are eager's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention_anchor import eager_gpt2
from test_liveness import predicted_peak, run_region

import ckpt_graph as cg
from ckpt_graph.compare.zoo import Workload
from ckpt_graph.planner.from_region import kept_ops_of
from ckpt_graph.policies import memory_budget

SEQ = 256
HEADS = 4


def _workload() -> Workload:
    return eager_gpt2(HEADS, SEQ)


def _square_kept(run: Any) -> tuple[int, int]:
    """(kept, all) ops of the region whose outputs are heads x T x T floats."""
    g, square = run.graph, HEADS * SEQ * SEQ * 4
    ops = [
        j
        for j, op in enumerate(g.ops)
        if any(g.values[o].nbytes == square and g.values[o].storage == o for o in op.outputs)
    ]
    kept = kept_ops_of(run.region)
    return sum(j in kept for j in ops), len(ops)


@pytest.mark.parametrize("fraction", [0.6, 0.8])
def test_prediction_is_measured_peak_when_some_scores_are_kept(fraction: float) -> None:
    w = _workload()
    policy = memory_budget(fraction, flops_per_byte=2.0, check=False)
    run = run_region(w.model, w.inputs, policy, w.loss, steps=3, grads="none")
    kept, square = _square_kept(run)
    assert 0 < kept < square, (kept, square)  # some probabilities or masks kept, not all
    predicted = predicted_peak(run)
    assert abs(predicted - run.measured) <= 0.02 * run.measured, (predicted, run.measured)


def test_gradients_of_a_plan_keeping_some_scores_are_eager_ones() -> None:
    w = _workload()
    policy = memory_budget(0.6, flops_per_byte=2.0, check=False)

    def step(planned: bool) -> list[torch.Tensor]:
        for p in w.model.parameters():
            p.grad = None
        torch.manual_seed(1)  # the same dropout masks in every step
        if planned:
            with cg.save_recompute_policy(policy):
                loss = w.loss(w.model(*w.inputs))
        else:
            loss = w.loss(w.model(*w.inputs))
        loss.backward()
        return [p.grad.clone() for p in w.model.parameters() if p.grad is not None]

    want = step(False)
    step(True)  # records the graph and plans
    got = step(True)
    report = policy.report()
    assert report is not None and report.feasible, report
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
