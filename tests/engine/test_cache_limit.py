"""The bounded recompute cache: one region over a whole model saves memory by itself.

See Note [Bounded recompute cache] in ``ckpt_graph/engine/cache_bound.py``. Gradients are compared
bitwise with a run without checkpointing, peaks are measured with ``ckpt_graph.memory``
against ``torch.utils.checkpoint`` per block, and recompute is counted with the region's
own statistics (``PassState.recomputed_ops``: one per op run in backward).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import LIVE_OUTPUTS, ZOO, check, counted, counted_exp, leaf, make_model, run
from test_lifetime import gc_disabled
from test_liveness import run_region

import ckpt_graph as cg
from ckpt_graph import CkptGraphError
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import Workload, build_workload
from ckpt_graph.engine import cache_bound
from ckpt_graph.engine.segment_plan import SegmentPlan, SegmentProfile
from ckpt_graph.memory import measure
from ckpt_graph.planner.from_region import kept_ops_of
from ckpt_graph.planner.liveness import simulate


@pytest.fixture
def tiny_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound every pass, however small, with a cut after every third op and a 1-byte peak:
    every realize closes segments, and values read only by unpacks, or by ops past the next
    cut, are dropped and made again, random ops included (the harshest test of exactness; a
    cut after every op would make nearly every value a checkpoint, read by the next op)."""

    def dense(self: SegmentProfile, limit: int | None = None, extra: int = 0) -> SegmentPlan:
        return SegmentPlan(1, tuple(range(1, self.n, 3)))

    monkeypatch.setattr(SegmentProfile, "plan", dense)
    monkeypatch.setattr(cache_bound, "BOUND_MIN_BYTES", 0)


# ----------------------------------------------------------------------------- cache_limit
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (4096, 4096),
        ("256MiB", 256 * 2**20),
        ("1.5GB", 1_500_000_000),
        (" 64 KiB", 64 * 1024),
        ("300", 300),
        (None, None),
        ("unbounded", "unbounded"),
    ],
)
def test_cache_limit_accepts_sizes_none_and_unbounded(given: Any, expected: Any) -> None:
    with cg.save_recompute_policy(cache_limit=given) as region:
        y = leaf(3).sin().sum()
    y.backward()
    assert region.cache_limit == expected


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "0MiB", "-3MB", "lots", "12 parsecs", "none"])
def test_cache_limit_rejects_other_values(bad: Any) -> None:
    with pytest.raises(CkptGraphError, match=r"ckpt_graph: cache_limit=.* is not a valid bound"):
        cg.save_recompute_policy(cache_limit=bad)


def test_nested_block_asking_for_another_cache_limit_raises() -> None:
    with cg.save_recompute_policy(cache_limit="8MiB"):
        with cg.save_recompute_policy(cache_limit="8MiB"):  # repeating it is fine
            pass
        with (
            pytest.raises(CkptGraphError, match="nested save_recompute_policy block asks for"),
            cg.save_recompute_policy(cache_limit="1MiB"),
        ):
            pass


# ----------------------------------------------------------------------------- exactness
def _grads_of(
    w: Workload, scope: Callable[[], Any] | None
) -> tuple[list[torch.Tensor], torch.Tensor, Any]:
    """Parameter gradients of one step, the RNG state after it, and the region (if any)."""
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    region = None
    if scope is None:
        loss = w.loss(w.model(*w.inputs))
    else:
        with scope() as region:
            loss = w.loss(w.model(*w.inputs))
    loss.backward()
    grads = [p.grad.clone() for p in w.model.parameters() if p.grad is not None]
    return grads, torch.get_rng_state(), region


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("gpt", {"layers": 6, "width": 32, "batch": 2, "seq_len": 16}),
        ("mlp", {"layers": 6, "width": 32, "batch": 64}),
        ("cnn", {"layers": 4, "width": 8, "batch": 2, "seq_len": 8}),
    ],
)
@pytest.mark.parametrize("segments", ["automatic", "tiny"])
def test_zoo_gradients_bitwise_under_one_bounded_region(
    name: str, sizes: dict[str, int], segments: str, request: pytest.FixtureRequest
) -> None:
    if segments == "tiny":
        request.getfixturevalue("tiny_segments")
    dropout = 0.1 if name == "gpt" else 0.0
    w = build_workload(name, dropout=dropout, **sizes)  # type: ignore[arg-type]
    w.model.train()
    ref, ref_rng, _ = _grads_of(w, None)
    got, got_rng, region = _grads_of(w, lambda: cg.save_recompute_policy("recompute_all"))
    assert len(got) == len(ref)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert torch.equal(ref_rng, got_rng), "recompute advanced the user's RNG stream"
    if segments == "tiny" or name != "cnn":  # the CNN's blocks are too few ops to bound
        assert region.pass_state.closed_segments > 0
        again = [n for n in region.nodes if n.realized >= 2]
        assert again, "no op ran twice: nothing was dropped from the cache"
        if dropout:
            assert any(n.rng is not None or n.info.is_random for n in again), (
                "no random op ran twice"
            )


@pytest.mark.usefixtures("tiny_segments")
@pytest.mark.parametrize("name", ZOO)
def test_test_zoo_models_bitwise_with_every_value_dropped(name: str) -> None:
    # BatchNorm (running stats applied once), dropout (RNG replayed at each run), SDPA.
    model, x = make_model(name)
    _, got = check(model, [x])
    assert got.region.pass_state.closed_segments > 0
    assert any(n.realized >= 2 for n in got.region.nodes)


def _views_and_inplace(x: torch.Tensor, inplace_view: bool = False) -> torch.Tensor:
    h = x
    for _ in range(4):
        a = h.sin() * 2
        a[0:2].mul_(3)  # in place through a view of a fresh value
        b = a.t().contiguous()
        # An in-place view op: on the copy, or on a fresh value.
        b = b.t_() if inplace_view else (b * 1).t().unsqueeze_(0).squeeze(0)
        c = F.dropout(b.relu_(), 0.3, training=True)  # in place, then random ops
        d = c.unsqueeze(0).exp().squeeze(0)
        h = d.tanh() + h
    return h.sum()


@pytest.mark.usefixtures("tiny_segments")
def test_views_inplace_chains_and_dropout_stay_exact_when_run_again() -> None:
    _, got = check(_views_and_inplace, [leaf(6, 6)])
    region = got.region
    assert region.pass_state.closed_segments > 0
    assert any(n.info.is_random and n.realized >= 2 for n in region.nodes)
    assert any(n.info.is_inplace and n.realized >= 2 for n in region.nodes)


@pytest.mark.usefixtures("tiny_segments")
def test_inplace_view_op_after_a_write_through_a_slice_run_again() -> None:
    # t_ runs on an alias of a kept value; it must not bump the kept value's version counter,
    # or running its reader again fails the version check.
    check(lambda x: _views_and_inplace(x, inplace_view=True), [leaf(6, 6)])


def _two_passes_are_exact(inplace_view: bool, cache_limit: str | None) -> None:
    """Two passes over one recompute_all region of ``_views_and_inplace`` (the first with
    ``retain_graph``) give the same gradient, bit for bit that of the run without it."""
    x = leaf(6, 6)
    torch.manual_seed(0)
    ref = torch.autograd.grad(_views_and_inplace(x, inplace_view=inplace_view), x)[0]
    torch.manual_seed(0)
    with cg.save_recompute_policy("recompute_all", cache_limit=cache_limit):
        y = _views_and_inplace(x, inplace_view=inplace_view)
    (g1,) = torch.autograd.grad(y, x, retain_graph=True)
    (g2,) = torch.autograd.grad(y, x)
    torch.testing.assert_close(g2, g1, rtol=0, atol=0)
    torch.testing.assert_close(g1, ref, rtol=0, atol=0)


def test_inplace_view_op_on_a_kept_value_in_a_second_pass() -> None:
    _two_passes_are_exact(inplace_view=True, cache_limit="unbounded")


@pytest.mark.usefixtures("tiny_segments")
def test_retain_graph_second_pass_and_partial_grad_are_exact() -> None:
    _two_passes_are_exact(inplace_view=False, cache_limit=None)


@pytest.mark.usefixtures("tiny_segments")
def test_nothing_alive_after_a_bounded_backward() -> None:
    x = leaf(3, 4)
    with gc_disabled():
        refs: list[weakref.ref[Any]] = []
        with cg.save_recompute_policy("recompute_all") as region:
            h = x
            for _ in range(6):
                h = counted(counted_exp(h.sin() * 0.5)).tanh()
                refs += [weakref.ref(h), weakref.ref(h.untyped_storage())]
            out = (h * x).sum()
        out.backward()
        del out, h
        assert region.pass_state.closed_segments > 0
        assert not [r for r in refs if r() is not None], "region values alive after backward"
        assert not [r for r in LIVE_OUTPUTS if r() is not None], "recomputed values alive"


# ----------------------------------------------------------------------------- memory
def _per_block(w: Workload) -> Callable[[], None]:
    """One step with torch's checkpoint per block, as ``compare``'s torch-ckpt runs it."""
    forward = make_forward("torch-ckpt", w)

    def step() -> None:
        w.model.zero_grad(set_to_none=True)
        w.loss(forward()).backward()

    return step


def _one_region(w: Workload, box: list[cg.Region], **options: Any) -> Callable[[], None]:
    def step() -> None:
        w.model.zero_grad(set_to_none=True)
        with cg.save_recompute_policy("recompute_all", **options) as region:
            loss = w.loss(w.model(*w.inputs))
        loss.backward()
        box.append(region)

    return step


def _peak(step: Callable[[], None]) -> int:
    step()  # warm-up: lazy allocations of the first call are not the strategy's
    return measure(step).peak_bytes


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_one_recompute_all_region_peaks_no_higher_than_torch_per_block(name: str) -> None:
    # 8 blocks as in the README's comparison, smaller widths (the claim holds at both).
    w = build_workload(name, width=128, batch=2 if name == "gpt" else 256, seq_len=64)
    torch_peak = _peak(_per_block(w))
    box: list[cg.Region] = []
    ours = _peak(_one_region(w, box))
    region = box[-1]
    assert ours <= torch_peak, (ours, torch_peak)
    # At most two forwards of recompute, with no hand placement.
    assert region.pass_state.closed_segments > 0
    assert region.pass_state.recomputed_ops <= 2 * len(region.nodes)
    unbounded = _peak(_one_region(w, box, cache_limit="unbounded"))
    assert ours < 0.8 * unbounded, (ours, unbounded)


def test_explicit_cache_limit_trades_memory_for_recompute_and_warns_when_infeasible() -> None:
    w = build_workload("gpt", layers=8, width=128, batch=2, seq_len=64)
    box: list[cg.Region] = []
    auto = _peak(_one_region(w, box))
    large = _peak(_one_region(w, box, cache_limit="6MiB"))
    assert box[-1].pass_state.recomputed_ops <= 2 * len(box[-1].nodes)
    unbounded = _peak(_one_region(w, box, cache_limit="unbounded"))
    assert auto < large < unbounded
    with pytest.warns(UserWarning, match=r"cache_limit=1,024 bytes is below the [\d,]+ bytes"):
        small = _peak(_one_region(w, box, cache_limit=1024))
    assert small <= auto
    assert box[-1].pass_state.recomputed_ops <= 2 * len(box[-1].nodes)


# ----------------------------------------------------------------------------- simulator
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_simulator_predicts_the_bounded_peak_and_recompute(name: str) -> None:
    w = build_workload(name, layers=8, width=64, batch=2 if name == "gpt" else 128, seq_len=32)
    region, measured, g = run_region(w.model, w.inputs, "recompute_all", w.loss)
    assert region.pass_state.closed_segments > 0
    result = simulate(g, kept_ops_of(region))
    assert result.recomputed_ops == region.pass_state.recomputed_ops
    assert abs(result.peak_total_bytes - measured) <= 0.10 * measured, (
        result.peak_total_bytes,
        measured,
    )
    unbounded = simulate(dataclasses.replace(g, cache_limit="unbounded"), kept_ops_of(region))
    assert unbounded.peak_bytes > result.peak_bytes


def test_run_helper_region_uses_the_automatic_bound() -> None:
    model, x = make_model("mlp")
    got = run(model, [x], "recompute_all")
    assert got.region.cache_limit is None
