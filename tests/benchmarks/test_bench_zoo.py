"""``benchmarks/bench_zoo.py``: ``--check`` runs a ``memory_budget`` point with the measured
check before the runner measures it, and the JSON rows beside the report carry the figures
``notebooks/07_zoo.ipynb`` plots. On the embedded MLP at a small size, so no third-party model
runs here."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import warnings
from types import ModuleType

import pytest

from ckpt_graph.compare.runner import WorkloadRun
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import build_workload

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench_zoo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_zoo", ROOT / "benchmarks/bench_zoo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_zoo"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_checked_point_is_measured_after_its_check_and_written_as_json() -> None:
    bench = _bench_zoo()
    w = build_workload("mlp", layers=4, width=64, batch=32)
    run = WorkloadRun(w, seed=0)
    run.add("none", lambda: make_forward("none", w))
    run.add("torch-ckpt", lambda: make_forward("torch-ckpt", w))
    peak = run.peak_bytes("torch-ckpt")
    assert peak is not None
    said = bench.Said()
    key = "memory_budget @ torch-ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget the MLP cannot meet warns; the row says so
        run.add(key, lambda: bench.planned(w, peak, key, said, check=True))
        results = run.results(1)
    rows = [
        bench.Row("mlp", r, said.notes.get(r.strategy, r.note), "small", r.strategy in said.warned)
        for r in results
    ]
    assert [r.result.strategy for r in rows] == ["none", "torch-ckpt", key]
    for row in rows:  # the probe of the check is over before the runner measures
        assert row.result.status == "ok", (row.result.strategy, row.note)
        assert row.result.max_grad_diff == 0.0 and row.result.peak_bytes
    assert f"{bench.CHECK_STEPS} steps, check=True" in rows[2].note

    data = json.loads(bench.as_json(rows, {"check": True}))
    assert data["check"] is True
    assert [(r["model"], r["strategy"]) for r in data["rows"]] == [
        ("mlp", "none"),
        ("mlp", "torch-ckpt"),
        ("mlp", key),
    ]
    for row, got in zip(rows, data["rows"], strict=True):
        assert got["peak_bytes"] == row.result.peak_bytes
        assert got["extra_flops"] == row.result.extra_flops
        assert got["warned"] is row.warned and got["note"] == row.note

    table = bench.at_torch(rows).splitlines()
    assert len(table) == 3 and table[2].startswith("| mlp | ")
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    mine, torch_ckpt = rows[2].result, rows[1].result
    text = f"{torch_ckpt.peak_bytes / 2**20:.1f}: {mine.peak_bytes / torch_ckpt.peak_bytes:.2f}x, "
    assert cells[2].startswith(text)
    assert cells[3] == cells[4] == "-"  # torch-sqrt and torch-sac did not run
