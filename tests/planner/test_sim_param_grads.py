"""Parameters' gradient buffers in the liveness simulator (Note [Parameters' gradients in
backward], rule 10 of Note [Backward liveness model]).

A parameter whose ``.grad`` is ``None`` gets its gradient buffer in backward, at the step of
its first reader in forward order, and keeps it to the end of the step; one whose ``.grad``
exists is summed into in place. Checked on hand-built graphs and against measured peaks of
models whose parameters' gradients make most of the peak, with tied weights, views of
parameters, a frozen and an unused parameter, and a step of several regions.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import mlp_blocks
from test_liveness import predicted_peak, run_region
from torch import nn

import ckpt_graph as cg
from ckpt_graph.memory import measure
from ckpt_graph.planner.memory_budget import memory_budget
from ckpt_graph.planner.param_grads import param_grads
from ckpt_graph.planner.sim_graph import SimOp, SimValue

W = 64  # bytes of the parameter


def _graph(
    second: str | None = None, head: str = "aten.mm.default"
) -> tuple[list[SimValue], list[SimOp], list[bool], list[int]]:
    """x, w -> y = mm(x, w) (step 0) -> z = tanh(y) (step 1) [-> op ``second`` reading w]."""
    values = [SimValue(W, -1, 0), SimValue(8, -1, 1), SimValue(8, 0, 2), SimValue(8, 1, 3)]
    ops = [SimOp((1, 0), (2,), 1, head), SimOp((2,), (3,), 1, "aten.tanh.default")]
    if second is not None:
        values.append(SimValue(8, 2, 4))
        ops.append(SimOp((3, 0), (4,), 1, second))
    floating = [True, False] + [True] * (len(values) - 2)
    return values, ops, floating, list(range(len(values)))


def test_a_buffer_appears_at_its_readers_step_and_lives_to_the_end() -> None:
    values, ops, floating, store = _graph()
    ops.append(SimOp((3,), (), 1, "aten.sum.default"))  # step 2: no output, no gradient
    assert param_grads(values, ops, floating, store, [0]) == ({}, {}, W)  # made at step 0
    values, ops, floating, store = _graph(second="aten.mul.Tensor")
    # read at steps 2 and 0: complete at step 0 (one buffer, rule 4 holds it from step 2)
    assert param_grads(values, ops, floating, store, [0]) == ({}, {}, W)
    # read at step 2 only (the mm at step 0 reads another weight): alive at steps 1 and 0
    ops[0] = SimOp((1,), (2,), 1, "aten.tanh.default")
    assert param_grads(values, ops, floating, store, [0]) == ({0: W, 1: W}, {}, W)


def test_an_existing_grad_or_no_gradient_makes_no_buffer() -> None:
    values, ops, floating, store = _graph()
    assert param_grads(values, ops, floating, store, []) == ({}, {}, 0)  # .grad exists
    frozen = [False, *floating[1:]]  # requires_grad=False
    assert param_grads(values, ops, frozen, store, [0]) == ({}, {}, 0)
    # read only by an op whose output gets no gradient (zeros_like): no buffer
    values, ops, floating, store = _graph(second="aten.zeros_like.default")
    ops[0] = SimOp((1,), (2,), 1, "aten.tanh.default")
    floating[4] = False
    assert param_grads(values, ops, floating, store, [0]) == ({}, {}, 0)


def test_a_shared_or_transposed_gradient_is_copied_at_its_step() -> None:
    values, ops, floating, store = _graph(second="aten.add.Tensor")
    ops[0] = SimOp((1,), (2,), 1, "aten.tanh.default")
    # add hands its output's gradient to both inputs: AccumulateGrad copies it (rule 2)
    assert param_grads(values, ops, floating, store, [0], passthrough=[2]) == (
        {0: W, 1: W, 2: W},
        {2: W},
        W,
    )
    # w reaches its reader through t: copied unless the reader is mm / addmm (rule 2)
    for head, copied in (("aten.mul.Tensor", True), ("aten.mm.default", False)):
        values = [SimValue(W, -1, 0), SimValue(8, -1, 1), SimValue(W, 0, 0, True)]
        values.append(SimValue(8, 1, 3))
        ops = [SimOp((0,), (2,), 0, "aten.t.default"), SimOp((1, 2), (3,), 1, head)]
        result = param_grads(values, ops, [True, False, False, True], [0, 1, 0, 3], [0])
        # made at step 1, alive at step 0; a copy beside the contribution at step 1
        assert result == (({0: W, 1: W}, {1: W}, W) if copied else ({0: W}, {}, W)), head


class Tied(nn.Module):
    """A tied embedding and head around a wide MLP whose weight is read through a view and a
    slice, with a frozen and an unused parameter: parameters' gradients make the peak."""

    def __init__(self, vocab: int = 512, dim: int = 128) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.w = nn.Parameter(torch.randn(dim * dim) * 0.02)  # read as a (dim, dim) view
        self.table = nn.Parameter(torch.randn(2 * dim, dim) * 0.02)  # half of it read
        self.frozen = nn.Parameter(torch.randn(dim, dim), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(dim, dim))
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.emb)
        h = torch.tanh(h @ self.w.view(self.dim, self.dim)) @ self.frozen
        h = h * self.table[: self.dim].sum(0)
        return F.linear(h, self.emb)  # tied head


def _tied() -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 4))
    return Tied(), (ids,), lambda out: F.cross_entropy(out.flatten(0, 1), ids.flatten())


def _wide() -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
    )
    return model, (torch.randn(4, 256),), lambda out: out.pow(2).mean()


@pytest.mark.parametrize("build", [_wide, _tied], ids=["wide-mlp", "tied"])
@pytest.mark.parametrize("policy", ["recompute_all", "must_save_all"])
def test_predicted_peak_matches_measured_with_grads_none_and_existing(
    build: Any, policy: str
) -> None:
    model, inputs, loss = build()
    trained = [p for p in model.parameters() if p.requires_grad]
    # the tied weight and the frozen one are not counted (once, and never); the unused one
    # is not a region input; the sliced table's whole buffer is made
    unused = getattr(model, "unused", None)
    grads = sum(p.nbytes for p in trained if p is not unused)
    runs = {}
    for mode in ("zeros", "none"):
        run = run_region(model, inputs, policy, loss, grads=mode)
        runs[mode] = run
        # within 1%, the drift tests' bound (exact when written)
        assert abs(predicted_peak(run) - run.measured) <= 0.01 * run.measured, (
            mode,
            predicted_peak(run),
            run.measured,
        )
        assert run.graph.param_grad_bytes == (grads if mode == "none" else 0)
    # with .grad None the peak holds every parameter's gradient: about half of it or more
    # (the tied weight's three buffers make the rest)
    assert 0.45 * runs["none"].measured < grads < runs["none"].measured
    if unused is not None:
        assert unused.grad is None and model.frozen.grad is None  # type: ignore[union-attr]


def _six_regions(budget: int | float) -> tuple[Any, Any, int]:
    """Six MLP blocks, one region each, gradients set to None at each step: the step
    function, its policy, and the parameters' bytes."""
    blocks, x = mlp_blocks(), torch.randn(8, 128)
    policy = memory_budget(budget, flops_per_byte=0.5, check=False)

    def step() -> None:
        for p in blocks.parameters():
            p.grad = None
        h = x
        for b in blocks:
            with cg.save_recompute_policy(policy):
                h = b(h)
        h.pow(2).mean().backward()

    return step, policy, sum(p.nbytes for p in blocks.parameters())


def test_a_step_of_several_regions_holds_the_later_regions_gradients() -> None:
    # While block k runs backward, the gradients of blocks k+1.. exist (Note [Step budget
    # across regions] rule 1). The step's prediction with them was 0.13% below the measured
    # step when written; before rule 10, 84% below. A byte budget: a fraction plans without
    # them (rule 5).
    step, policy, grads = _six_regions(2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            step()
        measured = measure(step).peak_bytes
    plan = policy.step_report()
    assert plan is not None and plan.regions == 6
    assert measured > grads
    assert abs(plan.predicted_peak_bytes - measured) <= 0.01 * measured, (
        plan.predicted_peak_bytes,
        measured,
    )


def test_a_fraction_is_of_the_peak_without_the_parameters_gradients() -> None:
    # Rule 5: a fraction budget keeps its meaning, a share of what checkpointing changes.
    plain = {}
    for budget in (0.5, 2**30):
        step, policy, grads = _six_regions(budget)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                step()
        plan = policy.step_report()
        assert plan is not None
        plain[budget] = plan.plain_peak_bytes
    assert plain[0.5] < grads < plain[2**30]
