"""Run every benchmark and print one markdown report (machine, torch version, date first).

Runs ``python -m ckpt_graph compare`` on the default model (as a markdown table) and then every
``benchmarks/bench_*.py`` script, each in its own process, collecting the markdown it prints on
stdout. Progress and the scripts' stderr go to stderr.

Usage:
    python benchmarks/run_all.py                       # everything, markdown on stdout
    python benchmarks/run_all.py --out BENCH_RUN.md    # also write it to a file
    python benchmarks/run_all.py --only compare --out BENCH_RUN.md
    python benchmarks/run_all.py --only overhead --out BENCH_RUN.md
    python benchmarks/run_all.py --only compare --compare-args "" --compare-args "--model cnn"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
X = "\u00d7"  # multiplication sign


def machine_header() -> str:
    """Markdown lines naming the machine, library versions, load and date."""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        rev = ""
    return (
        f"Commit: {rev or '?'}. "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}"
        f"{', CUDA ' + str(torch.version.cuda) if torch.cuda.is_available() else ''}. "
        f"Load average at start: {load}. Date: {date}."
    )


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or isinstance(value, str) else format(value, spec)


def compare_markdown(doc: dict[str, Any], command: str) -> str:
    """The ``compare --json`` document as a markdown section."""
    c = doc["config"]
    m = doc["machine"]
    lines = [
        f"## Strategy comparison (`ckpt-graph compare`, model {c['model']})",
        "",
        f"Command: `{command}`. Model {c['model']}: {c['layers']} layers, width {c['width']}, "
        f"batch {c['batch']}, seq-len {c['seq_len']}, {c['dtype']}, {c['device']}, "
        f"{c['threads'] or m['torch_threads']} torch threads; torch {m['torch']}, {m['cpu_count']} CPUs, {m['date']}. "
        f"One training step (forward + backward) each; time is the median of {c['repeat']} "
        "interleaved steps; ratios are against `none` in the same run (CPU = process CPU time, "
        f"steadier than wall time on a loaded machine). Load average: {_load(m)}.",
        "",
        f"| strategy | peak MiB | {X} none | step ms | {X} none | CPU {X} none | extra ops "
        "| extra GFLOP | max \\|grad diff\\| |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    for r in doc["results"]:
        name = r["strategy"]
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} | | | | | | | |")
            notes.append(f"- {name}: {r['note']}")
            continue
        peak = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        ms = None if r["step_time_s"] is None else r["step_time_s"] * 1e3
        gflop = None if r["extra_flops"] is None else r["extra_flops"] / 1e9
        lines.append(
            f"| {name} | {_fmt(peak, '.1f')} | {_fmt(r['peak_ratio'], '.2f')} | {_fmt(ms, '.1f')}"
            f" | {_fmt(r['time_ratio'], '.2f')} | {_fmt(r.get('cpu_time_ratio'), '.2f')} "
            f"| {_fmt(r['extra_ops'], 'd')} "
            f"| {_fmt(gflop, '.3f')} | {_fmt(r['max_grad_diff'], '.3g')} |"
        )
        if r["note"]:
            notes.append(f"- {name}: {r['note']}")
        if r["max_buffer_diff"]:
            notes.append(
                f"- {name}: buffers differ from `none` by up to {r['max_buffer_diff']:.3g} after "
                "one step (BatchNorm running stats updated again during the recompute)"
            )
    lines += ["", "Strategies:", ""]
    lines += [f"- `{k}`: {v}" for k, v in doc["strategies"].items()]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines)


def _load(machine: dict[str, Any]) -> str:
    load = machine.get("load_average")
    return "?" if not load else ", ".join(f"{v:.1f}" for v in load)


def _run(cmd: list[str]) -> tuple[int, str, float]:
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return proc.returncode, proc.stdout, time.perf_counter() - t0


def run_compare(extra: str) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "compare.json"
        cmd = [sys.executable, "-m", "ckpt_graph", "compare", *shlex.split(extra)]
        code, _, seconds = _run([*cmd, "--json", str(path)])
        shown = shlex.join(["python", *cmd[1:]])
        if not path.exists():
            return code, f"## Strategy comparison\n\n`{shown}` failed with exit code {code}."
        doc = json.loads(path.read_text())
    text = compare_markdown(doc, shown) + f"\n\nWall time of the whole command: {seconds:.1f} s."
    return code, text


def run_script(script: Path) -> tuple[int, str]:
    code, out, seconds = _run([sys.executable, str(script)])
    body = "\n".join(line for line in out.rstrip().splitlines() if not line.startswith("wrote "))
    if code:
        body += f"\n\n`{script.name}` failed with exit code {code}."
    return code, body + f"\n\n(`{script.name}`: {seconds:.1f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument(
        "--only",
        help="comma list of names to run: 'compare' and/or bench script names without the "
        "bench_ prefix (e.g. overhead,grads)",
    )
    parser.add_argument(
        "--compare-args",
        action="append",
        help="extra arguments for compare; repeat the option for several runs (default: one "
        "run on the default model)",
    )
    args = parser.parse_args(argv)
    scripts = sorted(HERE.glob("bench_*.py"))
    wanted = None if args.only is None else {s.strip() for s in args.only.split(",")}
    known = {"compare"} | {s.stem.removeprefix("bench_") for s in scripts}
    if wanted is not None and wanted - known:
        parser.error(f"unknown benchmark {sorted(wanted - known)[0]!r}; known: {sorted(known)}")
    sections = ["# ckpt_graph benchmarks", "", machine_header()]
    failed = 0
    if wanted is None or "compare" in wanted:
        for extra in args.compare_args or [""]:
            code, text = run_compare(extra)
            failed += code != 0
            sections += ["", text]
    for script in scripts:
        if wanted is not None and script.stem.removeprefix("bench_") not in wanted:
            continue
        code, text = run_script(script)
        failed += code != 0
        sections += ["", text]
    report = "\n".join(sections) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
