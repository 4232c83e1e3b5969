"""The README's headline table is what ``python -m ckpt_graph compare`` measures (issue 21
item 17).

Peak memory (exact on CPU) and matmul FLOPs are deterministic, so the rows' figures are
checked against a run of the same command; CPU times are not (load), and are left to the
command's output. The run is the default embedded GPT: slow, run by CI after the quick suite.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckpt_graph.compare.runner import run_comparison

README = Path(__file__).resolve().parents[2] / "README.md"
ROWS = {  # strategy of the command -> the start of its README row
    "none": "| no checkpointing |",
    "torch-ckpt": "| `torch.utils.checkpoint` around each block",
    "cg-policy": "| `ckpt_graph`, one `recompute_all` region over the whole model",
    "cg-budget": "| `ckpt_graph` `memory_budget(0.5)`, one region |",
}


def _row(start: str) -> tuple[float, float]:
    """Peak MiB and matmul GFLOP of the README row starting with ``start`` (0 for none)."""
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith(start))
    cells = [c.strip() for c in line.strip("|").split("|")]
    peak = float(re.fullmatch(r"([\d.]+) MiB", cells[1])[1])  # type: ignore[index]
    flops = re.search(r"\(([\d.]+)", cells[2])
    return peak, float(flops[1]) if flops else 0.0


@pytest.mark.slow
def test_headline_rows_are_what_compare_measures() -> None:
    results = {
        r.strategy: r
        for r in run_comparison(
            model="gpt",
            strategies=list(ROWS),
            policy="recompute_all",
            repeat=1,
            threads=1,
        )
    }
    for strategy, start in ROWS.items():
        r = results[strategy]
        assert r.status == "ok" and r.max_grad_diff == 0, (strategy, r.note)
        peak, gflop = _row(start)
        assert round(r.peak_bytes / 2**20, 1) == peak, strategy
        assert round((r.extra_flops or 0) / 1e9, 1) == gflop, strategy
    one_region, torch_ckpt = results["cg-policy"], results["torch-ckpt"]
    ratio = one_region.extra_flops / torch_ckpt.extra_flops  # type: ignore[operator]
    assert f"{ratio:.1f}\u00d7 torch's" in README.read_text()  # the cost, next to its figure
