"""PyTorch Lightning: ``CheckpointCallback`` and the ``configure_model`` recipe train exactly.

See Note [Lightning callback] in ckpt_graph/integrations/lightning.py.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_graph as cg

pl = pytest.importorskip("pytorch_lightning", reason="needs pytorch_lightning")

from ckpt_graph.integrations.lightning import CheckpointCallback  # noqa: E402
from ckpt_graph.integrations.wrap import is_wrapped  # noqa: E402


class _Module(pl.LightningModule):  # type: ignore[misc]
    """Residual MLP blocks with dropout, trained with SGD on a fixed synthetic batch."""

    def __init__(self, recipe: bool = False) -> None:
        super().__init__()
        self.recipe = recipe
        torch.manual_seed(0)
        self.model = torch.nn.Module()
        self.model.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(32, 128),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(128, 32),
            )
            for _ in range(3)
        )
        self.head = torch.nn.Linear(32, 4)
        self.regions: list[object] = []  # the regions themselves: ids of dead ones are reused

    def configure_model(self) -> None:
        if self.recipe:  # the documented recipe, without a callback
            cg.wrap(self, policy=self._spy, match="model.blocks.*")

    def _spy(self, ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if not any(r is ctx.region for r in self.regions):
            self.regions.append(ctx.region)
        return cg.CheckpointPolicy.PREFER_RECOMPUTE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.model.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 32, generator=g), torch.randint(0, 4, (32,), generator=g)
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(module: _Module, tmp_path: Path, callbacks: list[Any]) -> None:
    pl.seed_everything(3, verbose=False)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
    )
    trainer.fit(module)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("how", ["callback", "configure_model"])
def test_fit_params_equal_to_no_checkpointing(how: str, tmp_path: Path) -> None:
    plain = _Module()
    _fit(plain, tmp_path / "plain", [])
    module = _Module(recipe=how == "configure_model")
    callbacks = []
    if how == "callback":
        callback = CheckpointCallback(policy=module._spy, match="model.blocks.*")
        assert isinstance(callback, pl.Callback)
        callbacks.append(callback)
    _fit(module, tmp_path / "cg", callbacks)
    assert len(module.regions) == 2 * 3  # 2 steps x 3 blocks, each its own region
    for name, value in _params(plain).items():
        torch.testing.assert_close(_params(module)[name], value, rtol=0, atol=0, msg=name)
    wrapped = any(is_wrapped(m) for m in module.modules())
    assert wrapped == (how == "configure_model")  # the callback unwraps after fit


def test_callback_repr_and_state_dict_keys(tmp_path: Path) -> None:
    module = _Module()
    keys = list(copy.deepcopy(module).state_dict())
    callback = CheckpointCallback(match="model.blocks.*")
    assert repr(callback) == "CheckpointCallback(policy='recompute_all', match='model.blocks.*')"
    _fit(module, tmp_path, [callback])
    assert list(module.state_dict()) == keys


def test_fit_says_in_lightnings_log_what_runs_in_regions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # See Note [Integrations say when they are active]: the line is in Lightning's own log.
    with caplog.at_level(logging.INFO, logger="ckpt_graph"):
        _fit(_Module(), tmp_path, [CheckpointCallback(match="model.blocks.*")])
    line = "wrap: 3 modules (Sequential x3) of _Module run in regions (policy='recompute_all')"
    assert [(r.name, r.getMessage()) for r in caplog.records if line in r.getMessage()] == [
        ("ckpt_graph", line),
        (pl.__name__, f"ckpt_graph: {line}"),
    ]
