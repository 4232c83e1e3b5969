"""What ``ckpt-graph compare`` prints and writes: the table, the JSON file and the plot.

Example:
    >>> from ckpt_graph.compare.runner import run_comparison
    >>> from ckpt_graph.compare.output import format_table
    >>> config = dict(model="mlp", layers=2, width=16, batch=4, seq_len=1, dtype="float32",
    ...               device="cpu", repeat=1)
    >>> results = run_comparison(**config, strategies=["none", "torch-ckpt"])
    >>> print(format_table(results, config))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ckpt_graph.compare.runner import STRATEGIES, StrategyResult

__all__ = ["format_table", "have_matplotlib", "machine_info", "plot", "write_json"]


def machine_info() -> dict[str, Any]:
    """Machine, library versions and date, as recorded next to every figure."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _describe(config: Mapping[str, Any]) -> str:
    dtype = str(config["dtype"]).removeprefix("torch.")
    return (
        f"{config['model']}: {config['layers']} layers, width {config['width']}, batch "
        f"{config['batch']}, seq-len {config['seq_len']}, {dtype}, {config['device']}"
        + (f", dropout {config['dropout']}" if config.get("dropout") else "")
    )


_COLUMNS = (
    "strategy",
    "peak MiB",
    "x none",
    "step ms",
    "x none",
    "cpu x none",
    "extra ops",
    "extra GFLOP",
    "max|dgrad|",
)


def _rows(results: Sequence[StrategyResult]) -> list[list[str]]:
    rows = []
    for r in results:
        if r.status != "ok":
            rows.append([r.strategy, r.status, *["-"] * (len(_COLUMNS) - 2)])
            continue
        mib = None if r.peak_bytes is None else r.peak_bytes / 2**20
        ms = None if r.step_time_s is None else r.step_time_s * 1e3
        gflop = None if r.extra_flops is None else r.extra_flops / 1e9
        rows.append(
            [
                r.strategy,
                _fmt(mib, ".3f" if mib is not None and mib < 1 else ".1f"),
                _fmt(r.peak_ratio, ".2f"),
                _fmt(ms, ".1f"),
                _fmt(r.time_ratio, ".2f"),
                _fmt(r.cpu_time_ratio, ".2f"),
                _fmt(r.extra_ops, "d"),
                _fmt(gflop, ".3f"),
                _fmt(r.max_grad_diff, ".3g"),
            ]
        )
    return rows


def _notes(results: Sequence[StrategyResult]) -> list[str]:
    notes = []
    for r in results:
        if r.note:
            notes.append(f"{r.strategy}: {r.note}")
        if r.max_buffer_diff:
            notes.append(
                f"{r.strategy}: buffers (e.g. BatchNorm running stats) differ from none by up "
                f"to {r.max_buffer_diff:.3g} after one step"
            )
    return notes


def format_table(
    results: Sequence[StrategyResult], config: Mapping[str, Any], *, rich: bool = False
) -> str:
    """The comparison as a table with header lines and notes; ``rich=True`` draws it with rich.

    Example:
        >>> print(format_table(run_comparison("mlp", layers=2, width=8, batch=2), cfg))  # doctest: +SKIP
    """
    rows = _rows(results)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]
    line = "  ".join

    def cells(row: Sequence[str]) -> str:
        return line(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    info = machine_info()
    load = info["load_average"]
    head = [
        f"ckpt-graph compare: {_describe(config)}",
        f"torch {info['torch']}, {info['cpu_count']} CPUs, "
        f"{config['threads'] or torch.get_num_threads()} threads, "
        f"load {'?' if load is None else f'{load[0]:.1f}'}, {info['date']}; "
        f"one training step each, time = median of {config['repeat']}",
    ]
    notes = _notes(results)
    tail = [
        "x none: wall time ratio; cpu x none: process CPU time ratio (steadier under load); "
        "extra ops / GFLOP: aten ops and matmul/conv/attention FLOPs run beyond 'none' (the "
        "recompute); max|dgrad|: max |grad - grad of none| over all parameters."
    ]
    if rich:
        return _rich_table(head, rows, [*notes, *tail])
    out = [*head, "", cells(_COLUMNS), line("-" * w for w in widths), *(cells(r) for r in rows)]
    if notes:
        out += ["", *notes]
    return "\n".join([*out, "", *tail])


def _rich_table(head: list[str], rows: list[list[str]], notes: list[str]) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(title="\n".join(head), title_justify="left")
    for i, column in enumerate(_COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    console.print(table)
    for note in notes:
        console.print(note, highlight=False)
    return buf.getvalue().rstrip("\n")


def write_json(path: str, results: Sequence[StrategyResult], config: Mapping[str, Any]) -> None:
    """Write every figure, the configuration and the machine info to ``path`` as JSON."""
    doc = {
        "schema": "ckpt_graph.compare/1",
        # the threads the run used (it restores torch's setting when it ends)
        "machine": {
            **machine_info(),
            "torch_threads": config["threads"] or torch.get_num_threads(),
        },
        "config": {**config, "dtype": str(config["dtype"]).removeprefix("torch.")},
        "strategies": {r.strategy: STRATEGIES[r.strategy] for r in results},
        "results": [
            {
                **dataclasses.asdict(r),
                "step_times_s": list(r.step_times_s),
                "peak_mib": None if r.peak_bytes is None else r.peak_bytes / 2**20,
            }
            for r in results
        ],
    }
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=2, default=str, allow_nan=False)
        f.write("\n")


def _finite(value: Any) -> Any:
    """Strict JSON: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot(path: str, results: Sequence[StrategyResult], config: Mapping[str, Any]) -> None:
    """Scatter plot of peak memory against step time, one labelled point per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for r in results:
        if r.status != "ok" or r.peak_bytes is None or r.step_time_s is None:
            continue
        marker = "*" if r.strategy == "none" else "s" if r.strategy.startswith("torch") else "o"
        ax.scatter(
            [r.step_time_s * 1e3], [r.peak_bytes / 2**20], s=70, marker=marker, label=r.strategy
        )
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best")
    ax.set_xlabel("step time (ms, median)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(_describe(config), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
