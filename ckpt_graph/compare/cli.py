"""The ``ckpt-graph`` command: ``ckpt-graph compare`` (also ``python -m ckpt_graph compare``).

Runs one training step of an embedded model under every checkpointing strategy and prints peak
memory, step time, recompute work and the gradient difference against no checkpointing.

Example:
    $ python -m ckpt_graph compare
    $ python -m ckpt_graph compare --model cnn --strategies none,torch-ckpt,cg-block --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

import torch

import ckpt_graph
from ckpt_graph._errors import CkptGraphError, CkptGraphValueError
from ckpt_graph.compare.output import format_table, have_matplotlib, plot, write_json
from ckpt_graph.compare.runner import DEFAULT_STRATEGIES, STRATEGIES, run_comparison
from ckpt_graph.compare.strategies import DEFAULT_BUDGET
from ckpt_graph.compare.zoo import DEFAULTS, MODELS, WorkloadError, estimate_bytes
from ckpt_graph.engine.decisions import normalize_policy, policy_names
from ckpt_graph.planner.cost_model import parse_budget as _parse_budget

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class UsageError(CkptGraphValueError):
    """Bad command-line input: reported as one line on stderr with exit code 2.

    Always caught by :func:`main`; a ``CkptGraphError`` like every user error (see Note
    [Error types]).
    """


class _Parser(argparse.ArgumentParser):
    # Note [One-line usage errors]
    # argparse prints the whole usage block before its error; the command promises one line and
    # exit code 2 for any bad input, so parse errors are raised and reported like the others.
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ckpt-graph`` (subcommand ``compare``)."""
    parser = _Parser(prog="ckpt-graph", description="Activation checkpointing, compared.")
    version = f"ckpt-graph {ckpt_graph.__version__} (torch {torch.__version__})"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    cmp = sub.add_parser(
        "compare",
        help="compare checkpointing strategies on one training step",
        description="One training step (forward + backward) of an embedded model under each "
        "checkpointing strategy: peak memory, step time, recompute work and max |grad "
        "difference| against no checkpointing. Strategies: "
        + "; ".join(f"{k}: {v}" for k, v in STRATEGIES.items()),
    )
    # `ckpt-graph compare --version` too: the README documents --version among compare's options
    cmp.add_argument("--version", action="version", version=version)
    cmp.add_argument("--model", default="gpt", help=f"one of {', '.join(MODELS)} (default gpt)")
    for name, what in (
        ("layers", "number of blocks"),
        ("width", "hidden size (cnn: channels)"),
        ("batch", "batch size"),
        ("seq-len", "sequence length (cnn: image side; mlp: ignored)"),
    ):
        cmp.add_argument(f"--{name}", type=int, default=None, help=f"{what} (default per model)")
    cmp.add_argument(
        "--dropout", type=float, default=0.0, help="dropout probability (gpt, hf-*; default 0)"
    )
    cmp.add_argument("--dtype", default="float32", help=f"one of {', '.join(_DTYPES)}")
    cmp.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    cmp.add_argument("--repeat", type=int, default=3, help="timed steps per strategy (median)")
    cmp.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated list (default: all but cg-policy, which --policy adds); none is "
        "always run as the reference",
    )
    cmp.add_argument("--seed", type=int, default=0, help="seed for weights and batch")
    # Note [One thread by default]
    # Step times are compared as ratios measured side by side, so they must be steady rather
    # than short. With several OpenMP threads on a machine that is also busy with other work,
    # threads wait for each other and a step takes several times longer with a large spread
    # (see BENCHMARKS.md, "History from Notes"). One thread
    # also makes the process CPU-time ratio an exact figure. `--threads 0` keeps torch's default.
    cmp.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1, steady timings; 0: torch's default)",
    )
    cmp.add_argument(
        "--budget",
        default=None,
        help="memory budget of cg-budget, as memory_budget reads it: a fraction of the "
        f"activation memory in (0, 1] such as 0.5 or 1.0, or bytes such as 300000 or 64MiB "
        f"(default {DEFAULT_BUDGET})",
    )
    cmp.add_argument(
        "--policy",
        default=None,
        help=f"run strategy cg-policy: one region with the policy of this name, one of "
        f"{', '.join(policy_names())} (the names save_recompute_policy accepts)",
    )
    cmp.add_argument("--json", metavar="PATH", help="write all figures and machine info as JSON")
    cmp.add_argument(
        "--plot", metavar="PATH.png", help="plot peak memory vs step time (png, pdf, svg, ...)"
    )
    cmp.add_argument("--no-count", action="store_true", help="skip counting recomputed ops")
    cmp.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none when not a TTY)"
    )
    cmp.add_argument(
        "--verbose", action="store_true", help="log planner decisions and timings to stderr"
    )
    return parser


def parse_budget(text: str) -> float | int:
    """``--budget``: the text as ``memory_budget`` reads it (one parser, one rule: see Note
    [Budget argument]): a fraction in (0, 1] (``"0.5"``, ``"40%"``) or bytes (``"300000"``,
    ``"64MiB"``); ``"1"`` is one byte and refused, ``"1.0"`` is 100%.

    Raises:
        UsageError: anything else, with ``memory_budget``'s explanation.

    Example:
        >>> parse_budget("0.25"), parse_budget("2KiB")
        (0.25, 2048)
    """
    try:
        return _parse_budget(text)
    except CkptGraphError as e:
        raise UsageError(f"--budget {text!r}: {str(e).removeprefix('ckpt_graph: ')}") from None


def _check_output_path(option: str, path: str | None, formats: Sequence[str] = ()) -> None:
    """Fail before anything runs if ``path`` cannot be written (or has an unknown format)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if formats and ext not in formats:
        raise UsageError(
            f"{option} {path}: unknown format {ext or '(no extension)'!r}; use one of "
            f"{', '.join(sorted(formats))}"
        )


def _plot_formats() -> list[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return list(FigureCanvasBase.get_supported_filetypes())


def check_args(args: argparse.Namespace) -> dict[str, object]:
    """The comparison's configuration from parsed arguments, validated as far as it can be
    before a model is built.

    Raises:
        UsageError: an argument is out of range or names nothing known.
    """
    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}; choose from {', '.join(MODELS)}")
    if args.dtype not in _DTYPES:
        raise UsageError(f"unknown dtype {args.dtype!r}; choose from {', '.join(_DTYPES)}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"unknown device {args.device!r}; use cpu or cuda[:N]") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: only {torch.cuda.device_count()} GPU(s)")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {args.device!r}; use cpu or cuda[:N]")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise UsageError(
            f"unknown strategy {(unknown or [''])[0]!r}; choose from {', '.join(STRATEGIES)}"
        )
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {args.repeat}")
    if not 0.0 <= args.dropout < 1.0:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.threads < 0:
        raise UsageError(f"--threads must be 0 (torch's default) or more, got {args.threads}")
    d = DEFAULTS[args.model]
    sizes = {
        "layers": d.layers if args.layers is None else args.layers,
        "width": d.width if args.width is None else args.width,
        "batch": d.batch if args.batch is None else args.batch,
        "seq_len": d.seq_len if args.seq_len is None else args.seq_len,
    }
    for key, value in sizes.items():
        if value < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
    itemsize = torch.empty((), dtype=_DTYPES[args.dtype]).element_size()
    need = estimate_bytes(args.model, **sizes) * itemsize // 4
    have = _available_bytes(device)
    if have is not None and need > have:
        raise UsageError(
            f"this size needs about {need / 2**30:.1f} GiB but {device.type} has "
            f"{have / 2**30:.1f} GiB available; lower --layers/--width/--batch/--seq-len"
        )
    if args.plot and not have_matplotlib():
        raise UsageError("--plot needs matplotlib (pip install matplotlib)")
    _check_output_path("--json", args.json)
    _check_output_path("--plot", args.plot, _plot_formats() if args.plot else ())
    if args.policy is not None:
        _check_policy(args.policy)
        if "cg-policy" not in strategies:
            strategies.append("cg-policy")
    elif "cg-policy" in strategies:
        raise UsageError("strategy cg-policy needs --policy NAME")
    budget: float | int = DEFAULT_BUDGET
    if args.budget is not None:
        budget = parse_budget(args.budget)
        if "cg-budget" not in strategies:
            raise UsageError(
                "--budget applies to strategy cg-budget; add cg-budget to --strategies"
            )
    return {
        "model": args.model,
        **sizes,
        "dtype": _DTYPES[args.dtype],
        "device": str(device),
        "dropout": args.dropout,
        "strategies": strategies,
        "repeat": args.repeat,
        "seed": args.seed,
        "count_ops": not args.no_count,
        "threads": args.threads or None,
        "budget": budget,
        "policy": args.policy or "save_matmuls",
    }


def _check_policy(name: str) -> None:
    """``--policy``: a name ``save_recompute_policy`` accepts (one table: Note [Policy names])."""
    if name == "memory_budget":  # takes a budget: the cg-budget strategy is that policy
        raise UsageError(
            "--policy 'memory_budget': memory_budget takes a budget, so it has no name; run "
            "strategy cg-budget instead (in --strategies, the default) with --budget"
        )
    try:
        normalize_policy(name)
    except CkptGraphError as e:
        raise UsageError(f"--policy {name!r}: {str(e).removeprefix('ckpt_graph: ')}") from None


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _log_to_stderr() -> None:
    """Show the ``ckpt_graph`` logger's INFO records (planner decisions, timings) on stderr."""
    logger = logging.getLogger("ckpt_graph")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _fail(message: str) -> int:
    print(f"ckpt-graph: error: {message}", file=sys.stderr)
    return 2


class Progress:
    """A progress bar with an ETA (tqdm) on a terminal stream; nothing on other streams.

    Example:
        >>> progress = Progress(sys.stderr)
        >>> progress(1, 10, "gpt: none warm-up"); progress.close()
    """

    def __init__(self, stream: TextIO, mininterval: float = 0.5) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.mininterval = mininterval  # seconds between redraws
        self._bar: Any = None

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.tty:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                file=self.stream,
                leave=False,
                unit="step",
                mininterval=self.mininterval,
            )
        self._bar.set_description_str(label[:40], refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ckpt-graph``; returns the exit code.

    Exit codes: 0 success; 1 a strategy failed or an exact strategy's gradients differ from
    ``none``; 2 bad input (one line on stderr, no traceback).

    Example:
        >>> main(["compare", "--model", "mlp", "--layers", "2", "--width", "16",
        ...       "--strategies", "none,torch-ckpt", "--quiet"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError("missing command; try: ckpt-graph compare --help")
        config = check_args(args)
    except UsageError as e:
        return _fail(str(e))
    if args.verbose:
        _log_to_stderr()
    progress = None if args.quiet else Progress(sys.stderr)
    try:
        results = run_comparison(
            progress=progress,
            **config,  # type: ignore[arg-type]
        )
    except (WorkloadError, ValueError) as e:
        return _fail(str(e))
    finally:
        if progress is not None:
            progress.close()
    use_rich = sys.stdout.isatty() and importlib.util.find_spec("rich") is not None
    print(format_table(results, config, rich=use_rich))
    try:  # the paths were checked before the run; this catches what changed since
        if args.json:
            write_json(args.json, results, config)
            print(f"wrote {args.json}", file=sys.stderr)
        if args.plot:
            plot(args.plot, results, config)
            print(f"wrote {args.plot}", file=sys.stderr)
    except OSError as e:
        return _fail(f"cannot write {e.filename}: {e.strerror}")
    bad = [r.strategy for r in results if r.status == "failed" or (r.max_grad_diff or 0) != 0]
    if bad:
        print(f"ckpt-graph: {', '.join(bad)} failed or changed the gradients", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
