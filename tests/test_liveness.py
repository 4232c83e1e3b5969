"""Tests of the backward liveness simulator (ckpt_graph/_liveness.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from models import make_model, save_matmuls

import ckpt_graph as cg
from ckpt_graph._liveness import SimGraph, SimOp, SimValue, from_region, kept_ops_of, simulate
from ckpt_graph.memory import measure, measure_with_result
from ckpt_graph.policies._budget import memory_budget
from ckpt_graph.zoo import GPT


def chain(n: int, nbytes: int = 8) -> SimGraph:
    """x -> v1 -> ... -> vn; op j (producing v_{j+1}) saves its input v_j (not x)."""
    values = [SimValue(nbytes, -1, 0)] + [SimValue(nbytes, j, j + 1) for j in range(n)]
    ops = [SimOp((j,), (j + 1,), 1 + j) for j in range(n)]
    saved = tuple((j, j) for j in range(1, n))
    return SimGraph(tuple(values), tuple(ops), saved)


def test_chain_recompute_all_caches_the_whole_chain_then_frees_it_step_by_step() -> None:
    # Step 3 realizes v3 from x: v1, v2, v3 are all cached (each has a pending unpack).
    r = simulate(chain(4), [])
    assert r.peak_bytes == 3 * 8
    assert r.kept_bytes == 0
    assert r.recomputed_ops == 3  # ops 0, 1, 2 (op 3's output is never unpacked)
    assert r.recompute_cost == 1 + 2 + 3


def test_chain_keeping_the_middle_splits_the_recompute() -> None:
    # v2 kept: step 3 recomputes v3 only, step 1 recomputes v1 only.
    r = simulate(chain(4), [1])
    assert r.kept_bytes == 8
    assert r.peak_bytes == 8 + 8
    assert r.recompute_cost == 1 + 3
    assert simulate(chain(4), [0, 1, 2]).recompute_cost == 0
    assert simulate(chain(4), [0, 1, 2]).peak_bytes == 24


def test_a_kept_view_keeps_its_whole_base() -> None:
    # v1 (64 bytes) -> view v2 (8 bytes) -> v3; v3's op saves the view.
    values = (SimValue(8, -1, 0), SimValue(64, 0, 1), SimValue(8, 1, 1), SimValue(8, 2, 3))
    ops = (SimOp((0,), (1,), 10), SimOp((1,), (2,), 0), SimOp((2,), (3,), 1))
    g = SimGraph(values, ops, ((2, 2),))
    assert g.saved_bytes() == 64
    assert simulate(g, [1]).kept_bytes == 64
    held = simulate(g, [])
    assert held.peak_bytes == 64 and held.recompute_cost == 10


def test_values_with_two_consumers_stay_cached_until_both_ran() -> None:
    # x -> a; b = f(a), c = g(a); step of b saves a, step of c saves a.
    values = (SimValue(4, -1, 0), SimValue(16, 0, 1), SimValue(4, 1, 2), SimValue(4, 2, 3))
    ops = (SimOp((0,), (1,), 7), SimOp((1,), (2,), 1), SimOp((1,), (3,), 1))
    g = SimGraph(values, ops, ((1, 1), (2, 1)))
    r = simulate(g, [])
    assert r.recomputed_ops == 1 and r.recompute_cost == 7  # a is realized once
    assert r.peak_bytes == 16


def test_gradient_bytes_add_to_the_total_not_to_the_activation_peak() -> None:
    g = chain(3)
    with_grads = SimGraph(g.values, g.ops, g.saved, g.fixed, {0: 5, 1: 100, 2: 7})
    r = simulate(with_grads, [])
    assert r.peak_bytes == simulate(g, []).peak_bytes
    assert r.peak_total_bytes == 100 + 8  # step 1: v1 held, 100 gradient bytes
    assert r.peak_step == 1


def run_region(model: torch.nn.Module, x: torch.Tensor, policy: Any, steps: int = 1) -> Any:
    """Run forward + backward ``steps`` times; return the last region and measured peak.

    The peak is the bytes the region keeps when backward starts plus the highest level
    backward adds on top (parameter gradients are preallocated and accumulate in place).
    """
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # accumulate in place: .grad is not part of the peak
    out: tuple[Any, int] = (None, 0)
    for _ in range(steps):
        with cg.save_recompute_policy(policy) as region:
            y = model(x)
        loss = y.pow(2).sum()
        out = (region, live_kept_bytes(region) + measure(loss.backward).peak_bytes)
    return out


def live_kept_bytes(region: cg.Region) -> int:
    """Bytes of the storages the region still keeps (region inputs excluded)."""
    refs = [h.ref() if h.ref is not None else None for h in region.inputs]
    inputs = {t.untyped_storage().data_ptr() for t in refs if t is not None}
    storages = {}
    for node in region.nodes:
        for h in node.outputs:
            if h is not None and h.value is not None:
                st = h.value.untyped_storage()
                if st.data_ptr() not in inputs:
                    storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def gpt() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(64, 32, 2, 2, 16).train(), torch.randint(0, 64, (4, 16))


POLICIES = ["recompute_all", "must_save_all", save_matmuls, "budget"]


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    return gpt() if name == "gpt" else make_model(name)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("name", ["mlp", "transformer", "gpt"])
def test_simulator_counts_the_ops_the_engine_recomputes(name: str, policy: Any) -> None:
    model, x = build(name)
    pol = memory_budget(0.5) if policy == "budget" else policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        region, _ = run_region(model, x, pol, steps=2 if policy == "budget" else 1)
    r = simulate(from_region(region), kept_ops_of(region))
    assert r.recomputed_ops == region._pass.recomputed_ops


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize(
    "name",
    [
        "mlp",
        "transformer",
        "gpt",
        pytest.param(
            "cnn",
            marks=pytest.mark.xfail(
                strict=True,
                reason="convolution and batch-norm backward allocate workspaces the model "
                "does not know (measured 1.5-3x the simulated transient)",
            ),
        ),
    ],
)
def test_simulated_backward_peak_within_10_percent_of_measured(name: str, policy: Any) -> None:
    model, x = build(name)
    pol = memory_budget(0.5) if policy == "budget" else policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        region, peak = run_region(model, x, pol, steps=2)
    measured = peak  # live kept storages at backward start + backward's peak increase
    predicted = simulate(from_region(region), kept_ops_of(region)).peak_total_bytes
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


@pytest.mark.parametrize("name", ["mlp", "transformer", "gpt"])
def test_baseline_is_what_plain_autograd_keeps_after_forward(name: str) -> None:
    model, x = build(name)
    torch.manual_seed(1)
    y, report = measure_with_result(model, x)  # no region: autograd keeps every saved tensor
    with cg.save_recompute_policy("recompute_all") as region:
        torch.manual_seed(1)
        model(x)
    g = from_region(region)
    assert g.saved_bytes() == report.end_bytes - y.numel() * y.element_size()
    steps = [s for s, _ in g.saved]
    assert steps == sorted(steps) and all(0 <= s < len(g.ops) for s in steps)
