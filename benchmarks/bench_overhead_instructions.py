"""Recording overhead in instructions: callgrind counts per phase, one or more checkouts side by side.

``bench_overhead.py`` times the chain ``x = x * 1.0001 + sin(x)`` in CPU seconds, which on a
shared machine moves by 10-40% from run to run. This script runs the same chain under
valgrind's callgrind and counts the instructions executed in each phase of one
``save_recompute_policy`` region: *recording* (the forward's ops inside the block), *region
exit* (closing the block), *backward* (``y.sum().backward()``). The counts do not depend on
the machine's load, so a change of 1% is visible, and checkouts measured one after the
other compare directly.

How: a worker process runs the chain under ``valgrind --tool=callgrind --instr-atstart=no
--collect-atstart=no``; a tiny C library (built here with ``cc`` from valgrind's
``callgrind.h``, loaded with ``ctypes``) switches instrumentation and collection on just
before a phase and dumps the counts just after it, so each phase is one dump file whose
``totals`` line is the count. The chain runs twice unmeasured first (warm-up: op caches,
imports), then once measured, with ``gc.collect()`` before it as ``bench_overhead.py`` does
and the garbage collector on (its passes are part of the recording cost). Each worker
imports the checkout it was given (``PYTHONPATH``; checked through ``ckpt_graph.__file__``,
since the editable install may point at another checkout), and runs only the public API, so
the same script measures an older commit checked out with ``git worktree add``.

Prints a markdown table on stdout (million instructions per phase and checkout, and the
ratio of each checkout to the first), progress on stderr. Needs valgrind (with its headers)
and a C compiler; about 40 s per checkout and policy on the default chain.

Usage:
    python benchmarks/bench_overhead_instructions.py [--checkout NAME=PATH ...] [--ops 1500]
        [--policy recompute_all] [--policy function] [--keep DIR]

Example (the base commit against the working tree)::

    git worktree add /tmp/base abc1234
    python benchmarks/bench_overhead_instructions.py --checkout base=/tmp/base --checkout after=.
    git worktree remove /tmp/base
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

_CONTROL_C = r"""
#include <valgrind/callgrind.h>
void phase_start(void) {
    CALLGRIND_ZERO_STATS;
    CALLGRIND_START_INSTRUMENTATION;
    CALLGRIND_TOGGLE_COLLECT;
}
void phase_stop(void) {
    CALLGRIND_TOGGLE_COLLECT;
    CALLGRIND_DUMP_STATS;
    CALLGRIND_STOP_INSTRUMENTATION;
}
"""

PHASES = ("recording", "region exit", "backward")
POLICIES = ("recompute_all", "function")


def _build_control(directory: Path) -> Path:
    """Compile the phase switches into ``directory``; returns the library's path."""
    source = directory / "phase_control.c"
    library = directory / "phase_control.so"
    source.write_text(_CONTROL_C)
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    subprocess.run(
        [*cc.split()[:1], "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True
    )
    return library


def _worker(policy: str, ops: int, library: str, checkout: str) -> None:
    """Run the chain under callgrind: two warm-up runs, then one with each phase dumped."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    import ckpt_graph as cg

    where = Path(cg.__file__).resolve()
    if not where.is_relative_to(Path(checkout).resolve()):
        raise SystemExit(f"imported {where}, not the checkout {checkout}")
    control = ctypes.CDLL(library)
    start, stop = control.phase_start, control.phase_stop
    torch.set_num_threads(1)
    steps = max(1, ops // 3)

    def recompute_everything(
        ctx: object, out: object, op: object, *a: object, **k: object
    ) -> object:
        return CheckpointPolicy.PREFER_RECOMPUTE

    chosen = "recompute_all" if policy == "recompute_all" else recompute_everything
    x = torch.randn(16, requires_grad=True)

    def run(measure: bool) -> None:
        gc.collect()
        block = cg.save_recompute_policy(policy=chosen)
        if measure:
            start()
        block.__enter__()
        y = x
        for _ in range(steps):
            y = y * 1.0001 + torch.sin(y)
        if measure:
            stop()
            start()
        block.__exit__(None, None, None)
        if measure:
            stop()
            start()
        y.sum().backward()
        if measure:
            stop()
        x.grad = None

    run(False)
    run(False)
    run(True)


def _measure(
    name: str, checkout: Path, policy: str, ops: int, library: Path, out_dir: Path
) -> list[int]:
    """Instructions of each phase (``PHASES``) of one checkout under one policy."""
    prefix = out_dir / f"callgrind.{name}.{policy}"
    for old in out_dir.glob(prefix.name + ".*"):
        old.unlink()
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONHASHSEED="0")  # same hashes each run
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--callgrind-out-file={prefix}.%p",
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        policy,
        "--ops",
        str(ops),
        "--library",
        str(library),
        "--checkout",
        str(checkout),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({checkout}, {policy}):\n{done.stderr[-3000:]}")
    dumps = sorted((p for p in out_dir.glob(prefix.name + ".*.*")), key=lambda p: int(p.suffix[1:]))
    counts = []
    for dump in dumps:
        for line in dump.read_text().splitlines():
            if line.startswith("totals:"):
                counts.append(int(line.split()[1]))
    if len(counts) != len(PHASES):
        raise SystemExit(f"expected {len(PHASES)} dumps, found {len(counts)} in {out_dir}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        help="NAME=PATH of a checkout to measure (repeatable; the first is the reference); "
        "default: this checkout",
    )
    parser.add_argument("--ops", type=int, default=1500, help="aten ops in the forward chain")
    parser.add_argument(
        "--policy", action="append", choices=POLICIES, help="policies to measure (default: both)"
    )
    parser.add_argument("--keep", type=Path, help="keep callgrind's dump files in this folder")
    parser.add_argument("--worker", choices=POLICIES, help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.ops, args.library, args.checkout[0])
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    checkouts: list[tuple[str, Path]] = []
    for spec in args.checkout or [f"this={Path(__file__).resolve().parents[1]}"]:
        name, _, path = spec.rpartition("=")
        checkouts.append((name or Path(path).name, Path(path).resolve()))
    policies = args.policy or list(POLICIES)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        library = _build_control(Path(tmp))
        results: dict[tuple[str, str], list[int]] = {}
        for policy in policies:
            for name, path in checkouts:
                print(f"{name} ({path}), {policy}", file=sys.stderr)
                results[name, policy] = _measure(name, path, policy, args.ops, library, out_dir)
    names = [n for n, _ in checkouts]
    ratio_cols = [f"{n} / {names[0]}" for n in names[1:]]
    print(f"Million instructions (callgrind), chain of {args.ops} ops, one measured run:\n")
    print("| phase | " + " | ".join(names + ratio_cols) + " |")
    print("| --- |" + " ---: |" * (len(names) + len(ratio_cols)))
    for policy in policies:
        rows = [(p, [results[n, policy][i] for n in names]) for i, p in enumerate(PHASES)]
        by_name = {n: results[n, policy] for n in names}
        rows.append(("forward (recording + exit)", [by_name[n][0] + by_name[n][1] for n in names]))
        rows.append(("forward + backward", [sum(by_name[n]) for n in names]))
        for phase, values in rows:
            cells = [f"{v / 1e6:.1f}" for v in values]
            cells += [f"{v / values[0]:.3f}" for v in values[1:]]
            print(f"| {policy}: {phase} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
