"""Setup shared by the bitwise gradient tests (``test_record_ops``, ``test_mutation``,
``test_replay``, ``test_torch_features``, ``test_api``).

Every case runs once eagerly and once inside ``save_recompute_policy`` (see ``models.run``) and
compares outputs, gradients, buffers, mutated inputs and RNG states with ``rtol=0, atol=0``. The
region's outputs go through ops that save them (``* w``, ``sin``) so that a wrong recompute shows up
in some gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import save_matmuls

from ckpt_graph.engine import passes


@pytest.fixture(autouse=True)
def _transient_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the small values of these cases be transient (see Note [Transient values]), so that
    every case also checks the engine's recompute-at-each-use path; the default path is what
    the other test modules run."""
    monkeypatch.setattr(passes, "TRANSIENT_MIN_BYTES", 0)


POLICIES = ["recompute_all", "must_save_all", save_matmuls]
Case = tuple[Callable[..., Any], list[Any]]


def _post(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Consume a value so that its recomputed copy is needed by backward (mul saves both)."""
    return (r * w).sin()
