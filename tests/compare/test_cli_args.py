"""``ckpt-graph compare`` arguments: checked before anything runs, --version, --budget, --policy,
threads reported, progress bar and logging. Tiny sizes only.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_graph
from ckpt_graph.compare import cli

TINY = ["--model", "mlp", "--layers", "2", "--width", "16", "--batch", "2", "--repeat", "1"]


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the comparison (any model) would run."""

    def run_comparison(**kwargs: Any) -> Any:
        raise AssertionError("the comparison ran before the arguments were checked")

    monkeypatch.setattr(cli, "run_comparison", run_comparison)


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ckpt-graph: error: ")
    return err


@pytest.mark.parametrize("argv", [["--version"], ["compare", "--version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"ckpt-graph {ckpt_graph.__version__} (torch {torch.__version__})"
    )


@pytest.mark.usefixtures("no_run")
@pytest.mark.parametrize(
    ("option", "path", "message"),
    [
        ("--json", "{tmp}", "is a directory; give a file name"),
        ("--json", "{tmp}/missing/out.json", "does not exist"),
        ("--plot", "{tmp}", "is a directory"),
        ("--plot", "{tmp}/out.xyz", "unknown format 'xyz'; use one of"),
        ("--plot", "{tmp}/out", "unknown format '(no extension)'"),
    ],
)
def test_bad_output_paths_fail_before_running(
    option: str, path: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if option == "--plot":
        pytest.importorskip("matplotlib")
    err = _error(["compare", *TINY, option, path.format(tmp=tmp_path)], capsys)
    assert message in err


@pytest.mark.usefixtures("no_run")
@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_output_fails_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path.chmod(0o500)
    try:
        assert "not writable" in _error(["compare", "--json", str(tmp_path / "o.json")], capsys)
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0.5", 0.5),
        ("1.0", 1.0),
        ("2e-1", 0.2),
        ("300000", 300000),
        ("64MiB", 64 * 2**20),
        ("1.5KB", 1500),
        ("2 gib", 2 * 2**30),
    ],
)
def test_parse_budget(text: str, value: float) -> None:
    got = cli.parse_budget(text)
    assert got == value and type(got) is type(value)


@pytest.mark.usefixtures("no_run")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--budget", "0"],
            "--budget '0': memory_budget(0) is 0 bytes: an int budget is bytes and must be at least 1 KiB",
        ),
        (
            ["--budget", "1.5"],
            "--budget '1.5': memory_budget(1.5): a float is a fraction of the activation memory and must be in (0, 1]",
        ),
        (["--budget", "ten"], "--budget 'ten': memory_budget('ten') is not a size"),
        (["--budget", "3PB"], "is not a size: use a number and a unit"),
        (["--budget", "0.5", "--strategies", "none,cg-block"], "add cg-budget to --strategies"),
        (
            ["--policy", "save_all"],
            "--policy 'save_all': unknown policy 'save_all'; valid names are 'recompute_all', "
            "'must_save_all', 'save_matmuls', or pass a callable",
        ),
        (["--strategies", "none,cg-policy"], "strategy cg-policy needs --policy NAME"),
        (["--device", "cuda:3"], "--device cuda:3"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_bad_arguments_fail_before_running(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if argv[:2] == ["--device", "cuda:3"] and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    assert message in _error(["compare", *TINY, *argv], capsys)


def test_policy_and_budget_reach_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "out.json"
    argv = ["compare", *TINY, "--strategies", "none,cg-budget", "--policy", "must_save_all"]
    assert cli.main([*argv, "--budget", "2KiB", "--json", str(path), "--no-count"]) == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["strategies"] == ["none", "cg-budget", "cg-policy"]
    assert doc["config"]["budget"] == 2048 and doc["config"]["policy"] == "must_save_all"
    results = {r["strategy"]: r for r in doc["results"]}
    assert results["cg-budget"]["note"].startswith("memory_budget(2048):")
    assert results["cg-policy"]["status"] == "ok" and results["cg-policy"]["max_grad_diff"] == 0
    # must_save_all keeps every value: the peak of no checkpointing or more
    assert results["cg-policy"]["peak_bytes"] >= results["none"]["peak_bytes"]


def test_json_reports_the_threads_the_run_used(tmp_path: Path) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        path = tmp_path / "out.json"
        argv = ["compare", *TINY, "--strategies", "none", "--threads", "1", "--no-count"]
        assert cli.main([*argv, "--json", str(path), "--quiet"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
    assert json.loads(path.read_text())["machine"]["torch_threads"] == 1


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_with_eta_on_a_terminal_only() -> None:
    terminal = _Terminal()
    progress = cli.Progress(terminal, mininterval=0)
    for done in range(1, 4):
        progress(done, 3, f"none: step {done}")
    text = terminal.getvalue()
    progress.close()
    assert "3/3" in text and "<" in text and "none: step 3" in text  # tqdm: elapsed<remaining
    pipe = io.StringIO()
    quiet = cli.Progress(pipe)
    quiet(1, 3, "none: step 1")
    quiet.close()
    assert pipe.getvalue() == ""


def test_verbose_logs_timings_to_the_ckpt_graph_logger(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logger = logging.getLogger("ckpt_graph")
    handlers, level = list(logger.handlers), logger.level
    try:
        argv = ["compare", *TINY, "--strategies", "none", "--no-count", "--verbose"]
        assert cli.main(argv) == 0
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    err = capsys.readouterr().err
    assert "ckpt_graph.compare.runner: none: timed step 1/1:" in err
    assert "ckpt_graph.compare.runner: none: measured step, peak" in err


def test_command_silences_torch_numpy_warning_library_does_not(tmp_path: Path) -> None:
    # A NumPy that fails to import, as in a fresh venv without it: torch warns at import.
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError('No module named numpy', name='numpy')\n"
    )
    repo = Path(ckpt_graph.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"}

    def stderr(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300
        )
        return done.stderr

    assert stderr("-m", "ckpt_graph", "--version") == ""
    assert "Failed to initialize NumPy" in stderr("-c", "import ckpt_graph")
