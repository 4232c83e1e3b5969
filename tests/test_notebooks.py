"""The notebooks run, their claims hold, and their committed outputs are current.

Each notebook is executed (its cells assert their own claims) and its fresh outputs are
compared with the committed ones by ``notebooks/execute.py``: numbers may drift, nothing else.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def _execute_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nb_execute", NOTEBOOKS_DIR / "execute.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("nb_execute", module)
    spec.loader.exec_module(module)
    return module


nb_execute = _execute_module()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_outputs_are_current(path: Path) -> None:
    import nbformat

    fresh = nb_execute.execute(path)  # raises CellExecutionError if a claim fails
    problems = nb_execute.stale_cells(nbformat.read(path, as_version=4), fresh)
    assert not problems, (
        f"{path.name}: committed outputs are stale; run python notebooks/execute.py --write "
        + path.name
        + "\n"
        + "\n".join(problems)
    )


def test_normalise_keeps_words_and_drops_figures() -> None:
    a = nb_execute.normalise("peak   12.5 MiB  (0.31x), step 1,024 ms at 0x7f00ab")
    b = nb_execute.normalise("peak 9.75 MiB (1.2x), step 998 ms at 0x5a")
    assert a == b == "peak # MiB (#x), step # ms at #"
    assert nb_execute.normalise("peak 3 MiB") != nb_execute.normalise("peak 3 GiB")


def test_stale_cells_names_the_cell() -> None:
    import nbformat

    def nb(text: str) -> object:
        cell = nbformat.v4.new_code_cell("print()")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        return nbformat.v4.new_notebook(cells=[cell])

    assert nb_execute.stale_cells(nb("kept 4 MiB\n"), nb("kept 5 MiB\n")) == []
    problems = nb_execute.stale_cells(nb("kept 4 MiB\n"), nb("recomputed 4 MiB\n"))
    assert len(problems) == 1 and problems[0].startswith("code cell 0")


def test_stream_outputs_cut_differently_are_the_same() -> None:
    import nbformat

    def nb(*texts: str) -> object:
        cell = nbformat.v4.new_code_cell("print()")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in texts]
        return nbformat.v4.new_notebook(cells=[cell])

    one = nb("difference: 2.97e-08\nmatch\n")
    two = nb("difference: 3.1e-08\n", "match\n")
    assert nb_execute.stale_cells(one, two) == []
    assert nb_execute.stale_cells(one, nb("difference: 1e-3\n", "mismatch\n")) != []
