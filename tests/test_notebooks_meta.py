"""Notebooks in notebooks/ are committed with their outputs and a python3 kernel.

``tests/test_notebooks.py`` executes them; these checks only read the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
EXPECTED = {
    "01_quickstart.ipynb",
    "02_policies.ipynb",
    "03_budget.ipynb",
    "04_transformers.ipynb",
    "05_flat_grads.ipynb",
    "06_inplace_abn.ipynb",
    "07_zoo.ipynb",
}


def _load(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        nb: dict[str, Any] = json.load(f)
    return nb


def test_every_notebook_is_present() -> None:
    assert {p.name for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_outputs_in_order(path: Path) -> None:
    nb = _load(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{path.name} has no code cell"
    counts = [cell.get("execution_count") for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: not executed top to bottom in one run; run notebooks/execute.py --write"
    )
    assert any(cell.get("outputs") for cell in code), f"{path.name} has no outputs"
    for i, cell in enumerate(code):
        errors = [o for o in cell.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, f"{path.name}: code cell {i} was committed with an error"
        stderr = [o for o in cell.get("outputs", []) if o.get("name") == "stderr"]
        assert not stderr, f"{path.name}: code cell {i} has stderr (machine paths, warnings)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_listed_in_readme(path: Path) -> None:
    readme = (path.parent / "README.md").read_text(encoding="utf-8")
    assert f"`{path.name}`" in readme, f"notebooks/README.md does not describe {path.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_kernel_is_python3(path: Path) -> None:
    assert _load(path)["metadata"]["kernelspec"]["name"] == "python3"
