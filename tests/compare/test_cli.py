"""Tests of ``ckpt-graph compare``: arguments, one-line errors, JSON schema, exact gradients."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_graph.compare import cli
from ckpt_graph.compare.runner import (
    DEFAULT_STRATEGIES,
    StrategyResult,
    make_forward,
    run_comparison,
)
from ckpt_graph.compare.zoo import MODELS, WorkloadError, build_workload

TINY = ["--layers", "2", "--width", "32", "--batch", "2", "--seq-len", "8", "--repeat", "1"]
REPO = Path(__file__).resolve().parents[2]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
HAVE_HF = importlib.util.find_spec("transformers") is not None


def _config(argv: list[str]) -> dict[str, object]:
    args = cli.build_parser().parse_args(argv)
    return cli.check_args(args)


def test_parse_defaults_fill_model_sizes() -> None:
    config = _config(["compare", "--model", "cnn", "--layers", "3"])
    assert config["model"] == "cnn"
    assert config["layers"] == 3
    assert config["width"] == 32 and config["seq_len"] == 64  # cnn defaults
    assert config["dtype"] is torch.float32
    assert config["device"] == "cpu"
    assert config["strategies"] == list(DEFAULT_STRATEGIES)
    assert config["repeat"] == 3 and config["count_ops"] is True
    assert config["threads"] == 1  # See Note [One thread by default]
    assert _config(["compare", "--threads", "0"])["threads"] is None


def test_parse_strategies_dtype_and_flags() -> None:
    config = _config(
        ["compare", "--strategies", " cg-block,torch-ckpt ", "--dtype", "float64", "--no-count"]
    )
    assert config["strategies"] == ["cg-block", "torch-ckpt"]
    assert config["dtype"] is torch.float64
    assert config["count_ops"] is False


def test_unknown_model_subprocess_one_line_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_graph", "compare", "--model", "nope"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines == ["ckpt-graph: error: unknown model 'nope'; choose from " + ", ".join(MODELS)]


BAD_INPUTS = [
    (["compare", "--strategies", "none,bogus"], "unknown strategy 'bogus'"),
    (["compare", "--strategies", ","], "unknown strategy ''"),
    (["compare", "--layers", "0"], "--layers must be a positive integer, got 0"),
    (["compare", "--batch", "-3"], "--batch must be a positive integer, got -3"),
    (["compare", "--width", "x"], "argument --width: invalid int value: 'x'"),
    (["compare", "--width", "100000000"], "lower --layers/--width/--batch/--seq-len"),
    (["compare", "--repeat", "0"], "--repeat must be at least 1, got 0"),
    (["compare", "--threads", "-1"], "--threads must be 0 (torch's default) or more, got -1"),
    (["compare", "--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    (["compare", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["compare", "--device", "meta"], "unsupported device 'meta'"),
    (["compare", "--device", "banana"], "unknown device 'banana'"),
    (["compare", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["compare", "--json", "/nonexistent/dir/x.json"], "directory /nonexistent/dir does not exist"),
    ([], "missing command"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS)
def test_bad_input_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("ckpt-graph: error: ")
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compare", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.skipif(HAVE_MPL, reason="matplotlib is installed")
def test_plot_without_matplotlib_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compare", *TINY, "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.skipif(HAVE_HF, reason="transformers is installed")
@pytest.mark.parametrize("model", ["hf-gpt2", "hf-llama"])
def test_hf_model_without_transformers(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkloadError, match="needs the 'transformers' package"):
        build_workload(model)
    assert cli.main(["compare", "--model", model, *TINY, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "transformers" in err


def test_json_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.json"
    argv = ["compare", *TINY, "--strategies", "none,torch-ckpt,cg-block", "--json", str(path)]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "torch-ckpt" in out and "cg-block" in out
    assert err == f"wrote {path}\n"  # no progress bar: stderr is not a terminal
    doc = json.loads(path.read_text())
    assert doc["schema"] == "ckpt_graph.compare/1"
    assert set(doc["machine"]) >= {"torch", "cpu_count", "platform", "date", "python"}
    assert doc["machine"]["torch"] == torch.__version__
    assert doc["config"] == {
        "model": "gpt",
        "layers": 2,
        "width": 32,
        "batch": 2,
        "seq_len": 8,
        "dtype": "float32",
        "device": "cpu",
        "dropout": 0.0,
        "strategies": ["none", "torch-ckpt", "cg-block"],
        "repeat": 1,
        "seed": 0,
        "count_ops": True,
        "threads": 1,
        "budget": 0.5,
        "policy": "save_matmuls",
    }
    assert [r["strategy"] for r in doc["results"]] == ["none", "torch-ckpt", "cg-block"]
    fields = {f for f in StrategyResult.__dataclass_fields__} | {"peak_mib"}
    for r in doc["results"]:
        assert set(r) == fields
        assert r["status"] == "ok", r["note"]
        assert isinstance(r["peak_bytes"], int) and r["peak_bytes"] > 0
        assert r["peak_mib"] == r["peak_bytes"] / 2**20
        assert len(r["step_times_s"]) == 1 and r["step_time_s"] == r["step_times_s"][0]
        assert r["max_grad_diff"] == 0.0
    none, ckpt, block = doc["results"]
    assert none["peak_ratio"] == 1.0 and none["time_ratio"] == 1.0
    assert none["extra_ops"] == 0 and none["extra_flops"] == 0
    # Recompute-all per block recomputes every block's matmuls once.
    assert ckpt["extra_flops"] > 0 and block["extra_flops"] > 0


@pytest.mark.parametrize(
    ("model", "dropout"), [("gpt", 0.0), ("gpt", 0.1), ("mlp", 0.0), ("cnn", 0.0)]
)
def test_every_strategy_exact_gradients(model: str, dropout: float) -> None:
    # With dropout, recompute must replay the forward's masks (torch preserves RNG state per
    # region; ckpt_graph replays each random op's generator state).
    results = run_comparison(
        model,
        layers=4,
        width=16,
        batch=2,
        seq_len=8,
        dropout=dropout,
        repeat=1,
        count_ops=False,
        threads=1,
    )
    assert [r.strategy for r in results] == list(DEFAULT_STRATEGIES)
    for r in results:
        if r.status == "skipped":
            # Only policies that are not written yet may be missing.
            assert r.strategy == "cg-budget" and "memory_budget" in r.note
            continue
        assert r.status == "ok", f"{r.strategy}: {r.note}"
        assert r.max_grad_diff == 0.0, r.strategy
        if r.strategy.startswith("cg-") or r.strategy == "none":
            # BatchNorm running stats are updated once, never again during recompute.
            assert r.max_buffer_diff == 0.0, r.strategy


def test_checkpointing_lowers_measured_peak() -> None:
    results = run_comparison(
        "gpt",
        layers=4,
        width=32,
        batch=2,
        seq_len=16,
        repeat=1,
        count_ops=False,
        threads=1,
        strategies=["none", "torch-ckpt", "cg-block", "cg-sqrt"],
    )
    peak = {r.strategy: r.peak_bytes for r in results}
    assert all(isinstance(v, int) for v in peak.values()), results
    assert peak["torch-ckpt"] < peak["none"]  # type: ignore[operator]
    assert peak["cg-sqrt"] < peak["none"]  # type: ignore[operator]
    # Performance bar: ckpt_graph per block needs no more than torch.utils.checkpoint per block.
    assert peak["cg-block"] <= peak["torch-ckpt"]  # type: ignore[operator]


def test_format_table_shows_every_strategy() -> None:
    results = [
        StrategyResult(
            "none",
            "ok",
            peak_bytes=2**20,
            peak_ratio=1.0,
            step_time_s=0.01,
            step_times_s=(0.01,),
            time_ratio=1.0,
            extra_ops=0,
            extra_flops=0,
            max_grad_diff=0.0,
            max_buffer_diff=0.0,
        ),
        StrategyResult("cg-budget", "skipped", "ckpt_graph.policies.memory_budget missing"),
    ]
    config = _config(["compare", "--layers", "2"])
    table = cli.format_table(results, config)
    assert "none" in table and "cg-budget" in table and "skipped" in table
    assert "memory_budget missing" in table
    assert "gpt: 2 layers" in table


def test_patched_forwards_are_restored() -> None:
    w = build_workload("gpt", layers=2, width=16, batch=1, seq_len=4)
    for name in ("torch-ckpt", "torch-sqrt", "cg-block", "cg-sqrt"):
        make_forward(name, w)()
        assert all("forward" not in vars(b) for b in w.blocks), name


def test_unknown_strategy_in_api() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        run_comparison("mlp", strategies=["nope"])


@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
def test_plot_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    assert (
        cli.main(
            [
                "compare",
                *TINY,
                "--strategies",
                "none,cg-block",
                "--plot",
                str(path),
                "--quiet",
                "--no-count",
            ]
        )
        == 0
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not HAVE_HF, reason="needs transformers")
@pytest.mark.parametrize("model", ["hf-gpt2", "hf-llama"])
def test_hf_models_exact_gradients(model: str) -> None:
    results = run_comparison(
        model,
        layers=2,
        width=32,
        batch=2,
        seq_len=8,
        repeat=1,
        count_ops=False,
        threads=1,
        strategies=["none", "torch-ckpt", "torch-sqrt", "cg-block", "cg-sqrt"],
    )
    # HF layers take keyword arguments: torch-sqrt groups them too (Note [Block chains]).
    for r in results:
        assert r.status == "ok", f"{r.strategy}: {r.note}"
        assert r.max_grad_diff == 0.0, r.strategy
