"""Notebooks in notebooks/ are committed with outputs stripped and a python3 kernel.

CI executes them with ``pytest --nbmake notebooks/``; these checks only read the JSON, so they
run in the ordinary test suite without a kernel.
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
}


def _load(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        nb: dict[str, Any] = json.load(f)
    return nb


def test_every_notebook_is_present() -> None:
    assert {p.name for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_are_stripped(path: Path) -> None:
    nb = _load(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{path.name} has no code cell"
    for i, cell in enumerate(code):
        assert cell.get("outputs") == [], f"{path.name}: code cell {i} has outputs"
        assert cell.get("execution_count") is None, f"{path.name}: code cell {i} was executed"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_listed_in_readme(path: Path) -> None:
    readme = (path.parent / "README.md").read_text(encoding="utf-8")
    assert f"`{path.name}`" in readme, f"notebooks/README.md does not describe {path.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_kernel_is_python3(path: Path) -> None:
    assert _load(path)["metadata"]["kernelspec"]["name"] == "python3"
