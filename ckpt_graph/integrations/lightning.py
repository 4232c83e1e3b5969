"""PyTorch Lightning: a ``Callback`` that runs a LightningModule's blocks in ckpt_graph regions.

# Note [Lightning callback]
# ``CheckpointCallback(policy, match)`` calls ``ckpt_graph.wrap(pl_module, policy, match)`` in
# ``on_fit_start`` and ``unwrap`` in ``teardown`` of the fit stage. ``on_fit_start`` runs after
# ``configure_model`` (modules built there exist) and after the strategy moved the model; the
# LightningModule itself is wrapped, never the strategy's DDP/FSDP wrapper, so ``match`` names
# are relative to the LightningModule (``"model.layers.*"``). ``wrap`` replaces no module, so
# checkpoints saved during fit have the keys of an unwrapped module. The Lightning package is
# imported when ``CheckpointCallback`` is first looked up (a module ``__getattr__``), so that
# ``ckpt_graph.integrations.lightning`` imports without it; the class derives from the
# ``Callback`` of ``pytorch_lightning`` if installed, else of ``lightning.pytorch`` (a Trainer
# of the other package would not accept it: Lightning checks ``isinstance``). At fit start the
# callback logs what ``wrap`` installed on Lightning's logger as well as on ``ckpt_graph``'s
# (See Note [Integrations say when they are active]).
#
# Without the callback, the same is one line in ``configure_model``:
#     def configure_model(self):
#         ckpt_graph.wrap(self, policy=ckpt_graph.policies.save_matmuls(), match="model.layers.*")
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ckpt_graph._errors import CkptGraphImportError
from ckpt_graph.integrations.wrap import describe_wrapped, unwrap, wrap

__all__ = ["CheckpointCallback"]  # noqa: F822  (built by the module __getattr__)


def _lightning_callback_base() -> tuple[type, str]:
    """Lightning's ``Callback`` class and the name of its package's logger."""
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        base: type = module.Callback
        return base, name
    raise CkptGraphImportError(
        "ckpt_graph: integrations.lightning.CheckpointCallback needs PyTorch Lightning "
        "(pip install pytorch_lightning, or lightning); without it call "
        "ckpt_graph.wrap(model) on the modules you train"
    )


def _callback_class() -> type:
    base, logger_name = _lightning_callback_base()

    class CheckpointCallback(base):  # type: ignore[misc,valid-type]
        """Wrap the LightningModule's blocks in ckpt_graph regions for ``Trainer.fit``.

        See Note [Lightning callback].

        Args:
            policy: each region's policy, as for ``ckpt_graph.save_recompute_policy``.
            match: which modules, as for ``ckpt_graph.wrap`` (default: the children of every
                ``nn.ModuleList``), with names relative to the LightningModule.

        Example:
            >>> from ckpt_graph.integrations.lightning import CheckpointCallback
            >>> trainer = pl.Trainer(callbacks=[CheckpointCallback(match="model.blocks.*")])
        """

        def __init__(self, policy: Any = "recompute_all", match: Any = None) -> None:
            super().__init__()
            self.policy = policy
            self.match = match

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            wrap(pl_module, policy=self.policy, match=self.match)
            if getattr(trainer, "is_global_zero", True):
                logging.getLogger(logger_name).info("ckpt_graph: %s", describe_wrapped(pl_module))

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                unwrap(pl_module)

        def __repr__(self) -> str:
            return f"CheckpointCallback(policy={self.policy!r}, match={self.match!r})"

    return CheckpointCallback


def __getattr__(name: str) -> Any:
    if name == "CheckpointCallback":
        cls = _callback_class()
        globals()[name] = cls  # built once: Lightning's isinstance checks need one class
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
