"""Integrations say when they are active: INFO lines and ``Region.opened_by``.

See Note [Integrations say when they are active] in ckpt_graph/integrations/activity.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.checkpoint as tc
from models import RegionSpy

import ckpt_graph as cg


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))
        self.extra = torch.nn.ModuleList([torch.nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.extra[0](x)


def _messages(caplog: pytest.LogCaptureFixture, name: str = "ckpt_graph") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == logging.INFO]


def test_wrap_logs_what_it_installed_and_regions_say_who_opened_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _Net()
    spy = RegionSpy()
    with caplog.at_level(logging.INFO, logger="ckpt_graph"):
        cg.wrap(model, policy=spy)
    assert _messages(caplog) == [
        f"wrap: 4 modules (_Block x3, Linear x1) of _Net run in regions (policy={spy!r})"
    ]
    model(torch.randn(2, 8)).sum().backward()
    assert [r.opened_by for r in spy.regions] == [
        "ckpt_graph.wrap: layers.0 (_Block)",
        "ckpt_graph.wrap: layers.1 (_Block)",
        "ckpt_graph.wrap: layers.2 (_Block)",
        "ckpt_graph.wrap: extra.0 (Linear)",
    ]
    summary = spy.regions[1].summary()
    assert summary.opened_by == "ckpt_graph.wrap: layers.1 (_Block)"
    assert str(summary).splitlines()[1].split() == [
        "opened", "by", "ckpt_graph.wrap:", "layers.1", "(_Block)"
    ]  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckpt_graph"):
        cg.wrap(model, policy="must_save_all", match="layers.*")
    assert _messages(caplog) == [
        f"wrap: 4 modules (_Block x3, Linear x1) of _Net run in regions "
        f"(policy='must_save_all', {spy!r})"
    ]


def test_a_plain_block_has_no_label_and_a_nested_integration_keeps_it() -> None:
    block = _Block()
    cg.wrap(block, match=lambda name, m: name == "")
    with cg.save_recompute_policy("recompute_all") as region:
        block(torch.randn(2, 8, requires_grad=True))
    assert region.opened_by == "" and "opened by" not in str(region.summary())


def test_patch_logs_entry_and_calls(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(3, requires_grad=True)
    with (
        caplog.at_level(logging.INFO, logger="ckpt_graph"),
        cg.patch_torch_checkpoint("must_save_all"),
    ):
        tc.checkpoint(torch.sin, x, use_reentrant=False)
        tc.checkpoint(torch.cos, x, use_reentrant=False)
    assert _messages(caplog) == [
        "patch_torch_checkpoint: torch.utils.checkpoint calls run in ckpt_graph regions "
        "(policy='must_save_all')",
        "patch_torch_checkpoint: left; 2 torch.utils.checkpoint calls ran in ckpt_graph regions",
    ]


def test_hf_enable_check_and_regions_say_it(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("transformers")
    from ckpt_graph.integrations import transformers as cg_hf

    from .hf_models import batch, build, loss

    model = build("gpt2", layers=2)
    spy = RegionSpy()
    with caplog.at_level(logging.INFO, logger="ckpt_graph"):
        assert cg_hf.check(model)
        cg_hf.enable(model, policy=spy)
        assert cg_hf.check(model)
    ours = (
        f"transformers: GPT2LMHeadModel: 2 modules (GPT2Block x2) checkpoint through "
        f"ckpt_graph regions (policy={spy!r})"
    )
    assert _messages(caplog) == [
        "transformers: GPT2LMHeadModel: gradient checkpointing is off (no layer checkpoints)",
        ours,
        ours,
    ]
    assert cg_hf.describe(model) == ours
    loss(model, batch()).backward()
    assert [r.opened_by for r in spy.regions] == ["transformers.enable: GPT2Block"] * 2
    assert "transformers.enable: GPT2Block" in str(spy.regions[0].summary())
    model._set_gradient_checkpointing(True)  # torch's checkpoint replaces ckpt_graph's
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckpt_graph"), pytest.warns(UserWarning):
        assert not cg_hf.check(model)
    assert _messages(caplog) == [
        "transformers: GPT2LMHeadModel: 2 modules (GPT2Block x2) checkpoint with "
        "torch.utils.checkpoint.checkpoint, not ckpt_graph"
    ]
