"""A budget is a promise checked against measurement (issue 22 section 3).

``memory_budget(1.0)`` recomputes nothing; a byte budget is compared with the measured step
peak and planned again once (Note [Measured budget check]); a budget out of reach warns
once with its reasons; ``report()`` and ``step_report()`` print tables (Note [Budget
reports]). References are plain eager runs; ``flops_per_byte`` is pinned.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from models import blocks_step, gpt_loss_per_block, mlp_blocks
from torch import nn

import ckpt_graph as cg
from ckpt_graph.compare.architectures import GPT
from ckpt_graph.memory import measure
from ckpt_graph.planner.memory_budget import memory_budget

FPB = 4.0
MIB = 2**20


def _gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(64, 64, 3, 4, 32).train(), torch.randint(0, 64, (4, 32))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("per_layer", [False, True], ids=["one-region", "per-layer"])
def test_full_budget_recomputes_nothing(per_layer: bool) -> None:
    # Before: the plan kept every candidate but every view, transpose and split was
    # recomputed (`--budget 1` on the CLI's GPT: 154 ops); the first step recomputed more.
    model, x = _gpt()
    model.zero_grad()
    model(x).pow(2).mean().backward()
    ref = _grads(model)
    policy = memory_budget(1.0, flops_per_byte=FPB, check=True)
    for _ in range(3):
        model.zero_grad()
        regions: list[cg.Region] = []
        if per_layer:
            loss = gpt_loss_per_block(model, x, policy, regions)
        else:
            h = model.tok(x) + model.pos(torch.arange(x.shape[1]))
            with cg.save_recompute_policy(policy) as region:
                for block in model.blocks:
                    h = block(h)
            regions.append(region)
            loss = model.head(model.ln_f(h)).pow(2).mean()
        loss.backward()
        torch.testing.assert_close(_grads(model), ref, rtol=0, atol=0)
        assert [n.realized for r in regions for n in r.nodes if n.realized] == []
    report = policy.report()
    assert report is not None and report.recomputed_ops == 0
    assert report.predicted_recompute_flops == 0


def test_byte_budget_is_checked_against_the_measured_step_and_met() -> None:
    # Before: the plan met the budget with the region's activations only; the step
    # measured 26.5 MiB against "24MiB" (6 x 256->1024 blocks, batch 512), with no warning.
    blocks, x = mlp_blocks(), torch.randn(256, 128)
    plain = measure(blocks_step, blocks, None, x).peak_bytes
    budget = int(0.75 * plain)
    policy = memory_budget(budget, flops_per_byte=FPB, check=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            blocks_step(blocks, policy, x)
        report = policy.report()
        peak = measure(blocks_step, blocks, policy, x).peak_bytes
    assert [str(w.message) for w in caught] == []
    assert peak <= budget, (peak / MIB, budget / MIB)
    assert report is not None and report.feasible
    # The plan bounds the region's activations with its gradient buffers (rule 1 of Note
    # [Memory budget policy]): the first planned step meets the budget, no re-plan. (When
    # it bounded activations only, this step measured above the budget and was planned
    # again with the measured difference taken off; at 60% no plan reaches the budget:
    # test_budget_out_of_reach_warns_once_with_its_reasons.)
    assert report.correction_bytes == 0  # type: ignore[attr-defined]
    text = str(report)
    assert "measured step peak" in text and "MiB" in text
    for p, q in zip([p.grad for p in blocks.parameters()], _plain_grads(blocks, x), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _plain_grads(blocks: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    blocks_step(blocks, None, x)
    return [p.grad.clone() for p in blocks.parameters()]  # type: ignore[union-attr]


def test_budget_out_of_reach_warns_once_with_its_reasons() -> None:
    # Before: "8MiB" on an MLP whose parameters' gradients alone took 12 MiB: predicted
    # peak 8.000 MiB, measured 22.1 MiB, feasible=True, no warning.
    blocks, x = mlp_blocks(), torch.randn(256, 128)
    grads = sum(p.numel() * p.element_size() for p in blocks.parameters())
    budget = grads // 2
    policy = memory_budget(budget, flops_per_byte=FPB, check=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            blocks_step(blocks, policy, x)
    measured = [str(w.message) for w in caught if "the step measured" in str(w.message)]
    assert len(measured) == 1, [str(w.message) for w in caught]
    message = measured[0]
    assert message.startswith(f"ckpt_graph: memory_budget({budget}): the step measured ")
    assert f"parameters' gradients {grads / MIB:.3f} MiB" in message
    assert "over the budget of" in message and "generator states" in message


def test_step_report_is_a_table_of_every_region() -> None:
    # Before: report() printed "budget 35.528 MiB of 17.508 MiB" for one region of six, and
    # step_report() a dataclass in bytes.
    # A measured fraction is of the measured step (Note [Measured budget check] rule 4):
    # 0.5 of it is out of reach here, the parameters' gradients a third of the step.
    model, x = _gpt()
    policy = memory_budget(0.7, flops_per_byte=FPB, check=True)
    for _ in range(3):
        model.zero_grad()
        gpt_loss_per_block(model, x, policy).backward()
    step = policy.step_report()
    assert step is not None
    text = str(step)
    lines = text.splitlines()
    assert (
        lines[0] == "memory_budget(0.7): 3 regions per step, planned jointly (distinct graphs: 1): "
        f"predicted peak {step.predicted_peak_bytes / MIB:.3f} MiB, fits"
    )
    assert "70% of the step's peak without checkpointing as the measured step corrects" in text
    assert "measured step peak" in text  # measured at the first planned step
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert str(policy.report()) == text  # the last region's report shows its step
    assert f"{step.budget_bytes / MIB:.3f} MiB" in text
