"""``benchmarks/gpu_check.py --dry-run``: the GPU check's code runs on CPU, so it cannot rot
while no GPU is at hand (issue 23, section 2). The CUDA tests it also runs are part of the
suite already (``tests/cuda/test_cuda.py``), so the dry run here leaves them out."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ckpt_graph. memory_budget")
def test_gpu_check_dry_run_writes_its_report(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--dry-run", "--no-tests", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu_check.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| small")]
    strategies = [r[1].strip() for r in rows]
    assert strategies == [
        "none",
        "torch-ckpt",
        "torch-sac",
        "cg-block",
        "memory_budget @ torch-ckpt",
        "memory_budget @ torch-sac",
        "cg per block, matmuls kept",
        "offload (per block)",
    ]
    peaks = {r[1].strip(): float(r[2]) for r in rows}
    for r in rows:
        assert float(r[6]) == 0.0, r  # every strategy: the gradients of no checkpointing
        assert int(r[7]) > 0  # recorded ops counted
        assert peaks[r[1].strip()] <= peaks["none"], r
    assert re.search(r"budget 0\.\d+", text)
    assert re.search(r"step \d+\.\d+x matmuls kept on the device", text)
