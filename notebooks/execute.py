"""Execute the notebooks: write their outputs, or check that the committed outputs are current.

The notebooks are committed *with* their outputs, so that figures and tables are visible where
the repository is browsed. Each notebook asserts its own claims in its cells, so executing it
checks them. Figures and measured numbers drift from run to run (a shared machine, timing,
allocator state); what must not drift is everything else the outputs say.

Usage:
    python notebooks/execute.py --write            # execute all, store the outputs in place
    python notebooks/execute.py --check            # execute all, compare with the committed ones
    python notebooks/execute.py --check 01_quickstart.ipynb

``--check`` fails when a cell raises (a claim no longer holds), or when a committed output is
stale in a way that matters: a cell's outputs differ from the fresh ones in kind (text, image,
table) or in their text once numbers and spacing are normalised (see :func:`normalise`). It is
what the test suite runs (``tests/test_notebooks.py``).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 600

_NUMBER = re.compile(r"0x[0-9a-fA-F]+|[-+]?(?:\d[\d_,]*)?\.?\d+(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"[ \t]+")


def normalise(text: str) -> str:
    """Text with every number replaced by ``#`` and runs of spaces folded.

    Tables keep their rows, labels and units; the measured figures in them may drift.
    """
    return "\n".join(_SPACE.sub(" ", _NUMBER.sub("#", line)).rstrip() for line in text.splitlines())


def _shape(output: dict[str, Any]) -> tuple[str, ...]:
    """What a reader sees of one output, up to drifting numbers."""
    kind = output["output_type"]
    if kind == "stream":
        return ("stream", output["name"], normalise(output["text"]))
    if kind == "error":
        return ("error", output["ename"])
    data = output.get("data", {})
    if "image/png" in data or "image/svg+xml" in data:
        return ("image",)
    if "text/html" in data:
        return ("html",)
    return (kind, normalise(str(data.get("text/plain", ""))))


def _joined_streams(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``outputs`` with each run of consecutive stream outputs of one name joined into one.

    The kernel sends what a cell prints in messages cut by time, not by ``print`` calls, so
    two lines may come as one stream output on one run and as two on another (a loaded
    machine); what a reader sees is the same text.
    """
    joined: list[dict[str, Any]] = []
    for o in outputs:
        last = joined[-1] if joined else None
        if (
            o["output_type"] == "stream"
            and last is not None
            and last["output_type"] == "stream"
            and last["name"] == o["name"]
        ):
            joined[-1] = {**last, "text": last["text"] + o["text"]}
        else:
            joined.append(o)
    return joined


def signature(nb: Any) -> list[list[tuple[str, ...]]]:
    """Per code cell, the shapes of its outputs; stderr (warnings, progress) is left out and
    consecutive stream outputs are joined (see ``_joined_streams``)."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = [
            o
            for o in cell.get("outputs", [])
            if not (o["output_type"] == "stream" and o["name"] == "stderr")
        ]
        cells.append([_shape(o) for o in _joined_streams(outputs)])
    return cells


def strip_stderr(nb: Any) -> Any:
    """``nb`` without stderr outputs: warnings and progress bars name files of the machine
    that ran it and drift from run to run; the committed notebook keeps what it shows."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [
                o
                for o in cell.get("outputs", [])
                if not (o["output_type"] == "stream" and o["name"] == "stderr")
            ]
    return nb


def execute(path: Path) -> Any:
    """The notebook at ``path`` executed in its own directory (raises if a cell raises)."""
    nb = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(nb)
    # Figures are part of the outputs: the kernel draws inline whatever MPLBACKEND the
    # caller has (CI sets Agg, which would show no figure).
    backend = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    try:
        NotebookClient(
            fresh,
            timeout=TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(HERE)}},
        ).execute()
    finally:
        if backend is None:
            del os.environ["MPLBACKEND"]
        else:
            os.environ["MPLBACKEND"] = backend
    return fresh


def stale_cells(committed: Any, fresh: Any) -> list[str]:
    """Descriptions of the code cells whose committed outputs differ from the fresh ones."""
    old, new = signature(committed), signature(fresh)
    if len(old) != len(new):
        return [f"{len(old)} code cells committed, {len(new)} executed"]
    problems = []
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a != b:
            problems.append(f"code cell {i}: committed {a!r}\n    fresh {b!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="store fresh outputs in place")
    mode.add_argument("--check", action="store_true", help="fail if committed outputs are stale")
    parser.add_argument("notebooks", nargs="*", help="file names (default: every *.ipynb here)")
    args = parser.parse_args(argv)
    paths = [HERE / n for n in args.notebooks] or sorted(HERE.glob("*.ipynb"))
    failed = False
    for path in paths:
        fresh = execute(path)
        if args.write:
            nbformat.write(strip_stderr(fresh), path)
            print(f"wrote {path.name}")
            continue
        problems = stale_cells(nbformat.read(path, as_version=4), fresh)
        if problems:
            failed = True
            print(f"{path.name}: committed outputs are stale; run notebooks/execute.py --write")
            for p in problems:
                print("  " + p)
        else:
            print(f"{path.name}: outputs current")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
