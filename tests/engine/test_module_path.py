"""What ``ctx.module_path`` is, as the README says (issue 21 item 15).

Names are relative to the outermost module called inside the region (Note [Module path
tracking]): blocks called one by one in a loop are each their own outermost module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ckpt_graph as cg


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)  # the add is the block's own op


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


def _seen(run: Any) -> list[tuple[str, str, nn.Module | None]]:
    seen: list[tuple[str, str, nn.Module | None]] = []

    def record(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        seen.append((str(op.overloadpacket.__name__), ctx.module_path, ctx.module))

    with cg.save_recompute_policy(record):
        run()
    return seen


def test_model_called_in_the_region_gives_paths_from_the_model() -> None:
    model, x = Model(), torch.randn(3, 4)
    seen = _seen(lambda: model(x))
    gelus = [(path, m) for op, path, m in seen if op == "gelu"]
    adds = [path for op, path, _ in seen if op == "add"]
    assert gelus == [
        ("blocks.0.mlp.1", model.blocks[0].mlp[1]),
        ("blocks.1.mlp.1", model.blocks[1].mlp[1]),
    ]
    assert adds == ["blocks.0", "blocks.1"]
    x.sum()  # outside any region: nothing recorded
    assert _seen(lambda: x * 2) == [("mul", "", None)]


def test_blocks_called_in_a_loop_each_start_from_an_empty_path() -> None:
    model, x = Model(), torch.randn(3, 4)

    def loop() -> None:
        h = x
        for block in model.blocks:
            h = block(h)

    seen = _seen(loop)
    adds = [(path, m) for op, path, m in seen if op == "add"]
    gelus = [path for op, path, _ in seen if op == "gelu"]
    assert adds == [("", model.blocks[0]), ("", model.blocks[1])]  # told apart by ctx.module
    assert gelus == ["mlp.1", "mlp.1"]
