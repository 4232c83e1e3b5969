"""Tests of the backward liveness simulator (ckpt_graph/planner/liveness.py)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from models import make_model, save_matmuls

import ckpt_graph as cg
from ckpt_graph.compare.architectures import GPT
from ckpt_graph.compare.zoo import build_workload
from ckpt_graph.memory import measure, measure_with_result
from ckpt_graph.planner import workspaces as _liveness_workspaces
from ckpt_graph.planner.from_region import from_region, grad_bytes, kept_ops_of
from ckpt_graph.planner.liveness import SimGraph, SimOp, SimValue, simulate
from ckpt_graph.planner.memory_budget import memory_budget
from ckpt_graph.planner.workspaces import measure_workspaces


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


def test_kept_values_are_released_after_the_last_step_that_needs_them() -> None:
    # x -> B (64, op 0); x -> k (32, op 1, kept) -> r (16, op 2) -> s (op 3).
    # Step 3 unpacks r (op 2 runs from k); after it, r and so k are dead (rule 5), so B,
    # realized at step 1, never coexists with k.
    values = (
        SimValue(8, -1, 0),
        SimValue(64, 0, 1),
        SimValue(32, 1, 2),
        SimValue(16, 2, 3),
        SimValue(8, 3, 4),
    )
    ops = (SimOp((0,), (1,), 1), SimOp((0,), (2,), 1), SimOp((2,), (3,), 1), SimOp((3,), (4,), 1))
    g = SimGraph(values, ops, ((1, 1), (3, 3)))
    r = simulate(g, [1])
    assert r.kept_bytes == 32
    assert r.peak_bytes == 64  # 32 + 16 at step 3, then B alone at step 1
    assert r.recomputed_ops == 2


def test_workspaces_count_at_their_step_and_when_their_op_runs() -> None:
    g = chain(3)
    runs = (dataclasses.replace(g.ops[0], run_workspace=50), *g.ops[1:])
    recomputed = simulate(SimGraph(g.values, runs, g.saved), [])
    assert recomputed.peak_bytes == 16
    assert recomputed.peak_total_bytes == 8 + 50  # op 0 runs at step 2 with v1 just made
    assert simulate(SimGraph(g.values, runs, g.saved), [0, 1]).peak_total_bytes == 16
    formula = (g.ops[0], dataclasses.replace(g.ops[1], workspace=100), g.ops[2])
    r = simulate(SimGraph(g.values, formula, g.saved), [0, 1])
    assert r.peak_bytes == 16  # v1 and v2 kept; v2 is released after step 2
    assert (r.peak_total_bytes, r.peak_step) == (8 + 100, 1)


def test_gradients_passed_on_share_one_buffer() -> None:
    # x -> a -> b = f(a) -> c = add(a, b) -> d: add hands c's gradient to a and b as is.
    values = [SimValue(8, -1, 0)] + [SimValue(8, j, j + 1) for j in range(4)]
    ops = [SimOp((0,), (1,), 1), SimOp((1,), (2,), 1), SimOp((1, 2), (3,), 1)]
    ops.append(SimOp((3,), (4,), 1))
    floating = [False] + [True] * 4
    # Own buffers: at step 2 the gradients of c, b and a; at step 1 those of b and a plus
    # f's contribution to a's (added to the existing buffer after f's backward).
    assert grad_bytes(values, ops, floating) == {0: 8, 1: 24, 2: 24, 3: 16}
    assert grad_bytes(values, ops, floating, passthrough=[2]) == {0: 8, 1: 16, 2: 8, 3: 16}


def pointwise_graph(pointwise: bool) -> SimGraph:
    """x -> h (16, op 0, elementwise) and x -> B (64, op 1); h saved at steps 2 and 0."""
    values = (SimValue(8, -1, 0), SimValue(16, 0, 1), SimValue(64, 1, 2), SimValue(8, 2, 3))
    ops = (
        SimOp((0,), (1,), 3, pointwise=pointwise),
        SimOp((0,), (2,), 7),
        SimOp((1, 2), (3,), 1),
    )
    return SimGraph(values, ops, ((0, 1), (1, 2), (2, 1)))


def test_transient_values_run_at_each_use_instead_of_staying_cached() -> None:
    # See Note [Transient values] (passes.py): h is dropped after step 2 and runs again
    # at step 0, so it is not cached while B is realized at step 1.
    cached = simulate(pointwise_graph(False), [])
    transient = simulate(pointwise_graph(True), [])
    assert (cached.peak_bytes, cached.recomputed_ops, cached.recompute_cost) == (80, 2, 10)
    assert (transient.peak_bytes, transient.recomputed_ops, transient.recompute_cost) == (
        64,
        3,
        13,
    )
    assert simulate(pointwise_graph(True), [0]).recomputed_ops == 1  # kept: not transient


# --------------------------------------------------------------------------- regions


class Run(NamedTuple):
    """One measured step of a region: what ``run_region`` returns."""

    region: cg.Region
    measured: int  # peak bytes of the backward, see run_region
    graph: SimGraph  # built before the backward, with measured workspaces


def run_region(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    policy: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    steps: int = 2,
    cache_limit: int | str | None = None,
    grads: str = "zeros",
) -> Run:
    """Run forward + backward ``steps`` times; measure the last step.

    The last step is measured whole (forward and backward in one ``measure``), so frees of
    kept values during backward are seen (a measure of ``backward`` alone ignores frees of
    blocks allocated before it). The peak is the bytes the region holds when backward
    starts (kept values and generator states) plus the highest level backward reaches
    above the level it started from. Parameter gradients are preallocated and accumulate
    in place: not part of the peak; with ``grads="none"`` they are ``None`` at each step's
    start, so backward allocates them (Note [Backward liveness model] rule 10). ``loss_fn`` (in the region) maps the output to the
    loss; without it the loss is ``y.pow(2).sum()`` outside the region. The simulator's
    graph is built between forward and backward, while the region still holds every
    generator state it may replay (Note [Backward liveness model] rule 9); the workspaces
    of the earlier steps' ops are memoised, so measuring them there allocates nothing.
    """
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if grads == "zeros" else None
    box: dict[str, Any] = {}

    def step() -> None:
        if grads == "none":
            for p in model.parameters():
                p.grad = None
        with cg.save_recompute_policy(policy, cache_limit=cache_limit) as region:
            y = model(*inputs)
            if loss_fn is not None:
                y = loss_fn(y)
        loss = y if loss_fn is not None else y.pow(2).sum()
        box["region"], box["kept"] = region, held_bytes(region)
        box["graph"] = from_region(region, workspaces=measure_workspaces(region))
        loss.backward()

    for _ in range(steps - 1):
        step()
    timeline = measure(step).timeline
    start = next(k for k, p in enumerate(timeline) if p.phase != "forward")
    base = timeline[start - 1].allocated_bytes if start else 0
    rise = max(p.allocated_bytes for p in timeline[start:]) - base
    return Run(box["region"], box["kept"] + rise, box["graph"])


def held_bytes(region: cg.Region) -> int:
    """Bytes of the storages the region holds: kept values (region inputs excluded, but
    not the copies of them the region took before a write: batch norm's running
    statistics) and generator states."""
    refs = [h.ref() if h.ref is not None else None for h in region.inputs]
    inputs = {t.untyped_storage().data_ptr() for t in refs if t is not None}
    storages = {}
    for h in region.inputs:
        if h.copied and h.value is not None:
            st = h.value.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    for node in region.nodes:
        for h in node.outputs:
            if h is not None and h.value is not None:
                st = h.value.untyped_storage()
                if st.data_ptr() not in inputs:
                    storages[st.data_ptr()] = st.nbytes()
        if node.rng is not None:
            st = node.rng[1].untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def predicted_peak(run: Run) -> int:
    return simulate(run.graph, kept_ops_of(run.region)).peak_total_bytes


def gpt() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(64, 32, 2, 2, 16).train(), torch.randint(0, 64, (4, 16))


POLICIES = ["recompute_all", "must_save_all", save_matmuls, "budget"]


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    return gpt() if name == "gpt" else make_model(name)


def named_policy(policy: Any) -> Any:
    """The policy a test case names: ``"save_matmuls"`` the built-in, ``"budget"`` a
    ``memory_budget(0.5)``, anything else (a policy, or a name the engine knows) as given.
    The simulator tests, the drift tests and ``benchmarks/bench_sim_error.py`` share it."""
    if policy == "save_matmuls":
        return cg.policies.save_matmuls()
    if policy == "budget":
        # A fixed flops_per_byte: the calibrated one varies with machine load, and so would
        # the plan.
        return memory_budget(0.5, flops_per_byte=0.5)
    return policy


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("name", ["mlp", "transformer", "gpt"])
def test_simulator_counts_the_ops_the_engine_recomputes(name: str, policy: Any) -> None:
    model, x = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        region = run_region(
            model, (x,), named_policy(policy), steps=2 if policy == "budget" else 1
        )[0]
    r = simulate(from_region(region), kept_ops_of(region))
    assert r.recomputed_ops == region.pass_state.recomputed_ops


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("name", ["mlp", "transformer", "gpt", "cnn"])
def test_simulated_backward_peak_within_10_percent_of_measured(name: str, policy: Any) -> None:
    model, x = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_region(model, (x,), named_policy(policy))
    predicted, measured = predicted_peak(run), run.measured
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls", "budget"])
@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn"])
def test_embedded_workloads_with_the_loss_in_the_region(name: str, policy: str) -> None:
    # float32: oneDNN convolutions, cross-entropy (log_softmax saves its output, which
    # nll_loss then saves as its input: the step of each save matters, rule 1).
    w = build_workload(name, layers=2, width=32, batch=2, seq_len=16)
    pol = named_policy(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_region(w.model, w.inputs, pol, w.loss)
    predicted, measured = predicted_peak(run), run.measured
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


def test_transient_values_of_one_save_matmuls_region_over_a_gpt() -> None:
    # Residual values of 64 KiB: at passes.TRANSIENT_MIN_BYTES, so they may be transient.
    torch.manual_seed(0)
    model, x = GPT(64, 64, 2, 2, 64).train(), torch.randint(0, 64, (4, 64))
    region, measured, g = run_region(model, (x,), cg.policies.save_matmuls())
    r = simulate(g, kept_ops_of(region))
    assert r.recomputed_ops == region.pass_state.recomputed_ops
    assert any(n.realized > 1 for n in region.nodes)  # some values ran once per use
    assert abs(r.peak_total_bytes - measured) <= 0.10 * measured, (r.peak_total_bytes, measured)
    cached = [dataclasses.replace(op, pointwise=False) for op in g.ops]
    without = simulate(dataclasses.replace(g, ops=tuple(cached)), kept_ops_of(region))
    assert without.peak_bytes > r.peak_bytes
    assert without.recomputed_ops < r.recomputed_ops


def test_measured_workspaces_of_convolution_and_batch_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x = make_model("cnn")
    with cg.save_recompute_policy("recompute_all") as region:
        model(x)
        with pytest.raises(ValueError, match="still open"):
            measure_workspaces(region)
    ws = measure_workspaces(region)
    names = {n.index: n.info.name for n in region.nodes}
    conv = [ws[j] for j, name in names.items() if name == "aten.convolution.default"]
    norm = [ws[j] for j, name in names.items() if name == "aten.native_batch_norm.default"]
    assert conv and all(w.backward > 0 and w.recompute > 0 for w in conv)  # unfolded input
    assert norm and all(w.backward > 0 for w in norm)
    assert all(w.output_saves == 0 for w in conv)
    assert all(w.output_saves == 2 for w in norm)  # save_mean and save_invstd
    assert not any(region.nodes[j].info.returns_written for j in ws)  # add_, div_: not run
    assert not any(all(o is None or o.is_view for o in region.nodes[j].outputs) for j in ws)

    measured: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        measured.append(args)
        return measure(*args, **kwargs)

    monkeypatch.setattr(_liveness_workspaces, "measure", counted)
    assert measure_workspaces(region) == ws
    assert measured == []  # memoised per op signature: nothing measured again


@pytest.mark.parametrize("name", ["mlp", "transformer", "gpt"])
def test_baseline_is_what_plain_autograd_keeps_after_forward(name: str) -> None:
    model, x = build(name)
    torch.manual_seed(1)
    y, report = measure_with_result(model, x)  # no region: autograd keeps every saved tensor
    with cg.save_recompute_policy("recompute_all") as region:
        torch.manual_seed(1)
        out = model(x)  # held, as ``y`` is: a dropped output's saves die with it
    g = from_region(region)
    del out
    assert g.saved_bytes() == report.end_bytes - y.numel() * y.element_size()
    steps = [s for s, _ in g.saved]
    assert steps == sorted(steps) and all(0 <= s < len(g.ops) for s in steps)


def test_simulated_peak_of_a_bytes_heavy_cnn_plan() -> None:
    # Pointwise ops costed at 4 FLOPs per byte: the plan recomputes both convolutions of
    # the first block while the mul after them unpacks. The peak is the convolution's
    # recompute workspace (20 KiB) plus the gradients alive *before* that step (Note
    # [Backward liveness model] rule 4): counting the mul's input gradients too put the
    # prediction 12% above the measured peak.
    model, x = build("cnn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_region(model, (x,), memory_budget(0.5, flops_per_byte=4.0), steps=2)
    predicted, measured = predicted_peak(run), run.measured
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
