"""Transient values: cheap pointwise values recomputed at each use instead of cached.

See Note [Transient values] in ``ckpt_graph/engine/passes.py``. Each test compares against a run
without checkpointing (bitwise, float64) and, for memory, against the same region with the
transient rule switched off (``passes.TRANSIENT_MIN_BYTES`` above every value), measured with
``ckpt_graph.memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import check, leaf, run, save_matmuls
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import ckpt_graph as cg
from ckpt_graph.engine import passes
from ckpt_graph.memory import measure


class Residual(nn.Module):
    """Pre-LN residual blocks: ``h = x + proj(ln1(x))``, ``x = h + proj2(ln2(h))``."""

    def __init__(self, layers: int = 4, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.ModuleList(
                [nn.LayerNorm(width), nn.Linear(width, width), nn.LayerNorm(width)]
                + [nn.Linear(width, width)]
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for ln1, a, ln2, b in self.blocks:  # type: ignore[misc]
            h = x + a(ln1(x))
            x = h + b(ln2(h))
        return x.square().sum()


def _no_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(passes, "TRANSIENT_MIN_BYTES", 1 << 62)


@pytest.fixture
def small_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the small float64 values of the exactness tests be transient."""
    monkeypatch.setattr(passes, "TRANSIENT_MIN_BYTES", 0)


@pytest.mark.usefixtures("small_values")
def test_residual_stream_is_exact_and_mid_values_run_per_use() -> None:
    model = Residual().double()
    x = leaf(8, 32)
    _, got = check(model, [x], save_matmuls)
    region = got.region
    assert region is not None
    mids = [n for n in region.nodes if n.info.name == "aten.add.Tensor" and n.realized > 1]
    # The value between the two halves of each block (x + attn) is transient; the block
    # outputs are not (their producer reads a transient value).
    assert len(mids) == 4
    assert all(n.realized == 3 for n in mids)  # ln2 output, ln2's saved input, the next add


def test_transient_values_lower_the_backward_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Residual(layers=6, width=256).float()
    x = torch.randn(64, 256, requires_grad=True)

    def step() -> None:
        with cg.save_recompute_policy(save_matmuls):
            loss = model(x)
        loss.backward()

    step()
    with_transient = measure(step).peak_bytes
    _no_transient(monkeypatch)
    without = measure(step).peak_bytes
    value = 64 * 256 * 4
    # Six mid-block values are no longer cached together at the start of backward.
    assert with_transient <= without - 5 * value, (with_transient, without)


def test_one_region_save_matmuls_is_not_above_torch_selective_per_block() -> None:
    """Issue 5's bar on a residual model: one region <= torch SAC applied per block."""
    model = Residual(layers=6, width=256).float()
    x = torch.randn(64, 256, requires_grad=True)
    keep = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}

    def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    def block_fn(blk: nn.ModuleList) -> Callable[[torch.Tensor], torch.Tensor]:
        ln1, a, ln2, b = blk

        def f(t: torch.Tensor) -> torch.Tensor:
            h = t + a(ln1(t))
            return h + b(ln2(h))

        return f

    def sac_step() -> None:
        t = x
        for blk in model.blocks:
            t = checkpoint(
                block_fn(blk),  # type: ignore[arg-type]
                t,
                use_reentrant=False,
                context_fn=lambda: create_selective_checkpoint_contexts(sac_policy),
            )
        t.square().sum().backward()

    def cg_step() -> None:
        with cg.save_recompute_policy(save_matmuls):
            loss = model(x)
        loss.backward()

    sac_step()
    cg_step()
    assert measure(cg_step).peak_bytes <= measure(sac_step).peak_bytes


@pytest.mark.usefixtures("small_values")
@pytest.mark.parametrize("mode", ["grad_subset", "retain_graph_twice"])
def test_partial_and_repeated_backward_stay_exact(mode: str) -> None:
    model = Residual().double()
    x = leaf(8, 32)
    ref_model = Residual().double()
    loss_ref = ref_model(x)
    with cg.save_recompute_policy(save_matmuls):
        loss = model(x)
    if mode == "grad_subset":
        (g_ref,) = torch.autograd.grad(loss_ref, [x])
        (g,) = torch.autograd.grad(loss, [x])
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
        return
    for _ in range(2):
        gs_ref = torch.autograd.grad(loss_ref, [x, *ref_model.parameters()], retain_graph=True)
        gs = torch.autograd.grad(loss, [x, *model.parameters()], retain_graph=True)
        for a, b in zip(gs, gs_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.usefixtures("small_values")
def test_pointwise_value_of_an_otherwise_dead_input_stays_cached() -> None:
    """``exp(sin(x))`` saved twice: running exp again would hold sin's output instead."""
    x = leaf(16, 8)
    _, got = check(lambda t: t.sin().exp().cos(), [x])
    assert got.region is not None
    assert [n.realized for n in got.region.nodes] == [1, 1, 0]


@pytest.mark.usefixtures("small_values")
def test_pointwise_of_kept_values_runs_per_use_and_frees_between() -> None:
    """gelu(kept) saved by two users: it is dropped after each use (nothing else to hold)."""
    w = leaf(32, 32, seed=1)
    x = leaf(16, 32, seed=2)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        g = torch.nn.functional.gelu(x @ w)
        return (g @ w).sin().sum() + g.square().sum()

    ref = run(f, [x, w])
    got = run(f, [x, w], save_matmuls)
    for a, b in zip(ref.grads, got.grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    region = got.region
    assert region is not None
    gelu = next(n for n in region.nodes if n.info.name == "aten.gelu.default")
    assert gelu.realized >= 2
    assert region.pass_state.peak_cached_bytes <= gelu.outputs[0].nbytes  # type: ignore[union-attr]


def test_small_values_stay_cached() -> None:
    """Below ``TRANSIENT_MIN_BYTES`` an extra run costs more than the value is worth."""
    model = Residual().double()  # 2 KiB values
    _, got = check(model, [leaf(8, 32)], save_matmuls)
    assert got.region is not None
    assert all(n.realized <= 1 for n in got.region.nodes)
