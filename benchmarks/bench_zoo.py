"""The zoo: ckpt_graph against torch's hand configurations on models nobody here wrote.

For each model of the third-party zoo (``ckpt_graph.compare.third_party`` plus transformers'
GPT-2 and Llama; ``python -m ckpt_graph compare --model NAME`` runs any of them), in one
process and one :class:`~ckpt_graph.compare.runner.WorkloadRun` (so step times are measured
side by side, round-robin):

- ``none``: no checkpointing (the reference of every ratio and gradient difference);
- torch's configurations: ``torch-ckpt`` (torch.utils.checkpoint per block), ``torch-sqrt``
  (over groups of round(sqrt(N)) consecutive blocks, see Note [Block chains]), ``torch-sac``
  (selective checkpointing per block, saving matmul / convolution / attention outputs);
- ``cg recompute_all``: one ckpt_graph region over the whole forward, ``recompute_all``;
- ``memory_budget @ T``: one region with ``cg.policies.memory_budget(B)`` where ``B`` is torch
  configuration ``T``'s measured step peak in bytes (what a user asking for "torch's memory"
  would pass), and ``memory_budget(f)`` at fractions 0.3 / 0.5 / 0.7. ``flops_per_byte`` is
  pinned (:data:`FLOPS_PER_BYTE`) so the plans do not depend on the machine's calibration;
  each budget forward plans on one step before it is measured.

``--check`` makes every ``memory_budget`` point ``memory_budget(..., check=True)`` (Note
[Measured budget check]): before it is measured, each runs :data:`CHECK_STEPS` steps, so that
its first planned step is measured, a byte budget it missed is planned again once with the
measured difference, and that step is measured and compared too. The rows are then measured
as every other row; a ``(w)`` marks a point whose policy warned.

Columns (the runner's measurements): measured step peak (``ckpt_graph.memory.measure``,
CPU allocator events), recomputed FLOPs (FLOPs of the step minus those of ``none``: matmuls,
convolutions, attention), median process CPU time of ``--repeat`` steps (one thread), max
|grad - grad of none|, and a verdict against torch: ``memory_budget @ T`` against ``T``,
``cg recompute_all`` against ``torch-ckpt``, a fraction against every torch configuration it
dominates (peak, FLOPs and time all <=) or is dominated by.

``--anchor`` adds the Megatron anchor: transformers' GPT-2 with eager attention and dropout,
4 layers, width 256, head size 32 and 64, 1024 tokens, one region; Megatron's selective
recompute (keep the linear layers' outputs) and ``memory_budget`` at 0.2 / 0.25 / 0.3, as
step peak / none and recompute % of the step's FLOPs. The goal: <= 0.30x for <= +2.7%.

Output: the markdown report (``--out``), and beside it the same rows as JSON (the ``--out``
path with ``.json``: the run's settings and, per row, the model, its sizes, every
:class:`~ckpt_graph.compare.runner.StrategyResult` field and whether the policy warned), which
``notebooks/07_zoo.ipynb`` plots.

``--extra`` runs the models beyond the zoo (``ckpt_graph.compare.beyond_zoo``, Note [Models
beyond the zoo]) instead of the zoo's, and adds a section on block boundaries: whether the
planner's block finder (Note [Block boundaries]) finds the blocks listed by hand (those that
torch's configurations checkpoint) and which hand seeds (Note [Hand seeds]) it gives. ``--models``
takes the names of either set.

Run: ``python benchmarks/bench_zoo.py [--models NAME ...] [--extra] [--quick] [--check]
[--anchor] [--out benchmarks/results_zoo.md]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ckpt_graph as cg
from ckpt_graph.compare.runner import StrategyResult, WorkloadRun
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import DEFAULTS, EXTRA, THIRD_PARTY, Workload, build_workload
from ckpt_graph.planner.blocks import find_blocks
from ckpt_graph.planner.from_region import from_region
from ckpt_graph.planner.hand_seeds import hand_seeds
from ckpt_graph.planner.solve import candidate_ops
from ckpt_graph.policies import memory_budget, save_ops

aten = torch.ops.aten

MODELS: tuple[str, ...] = ("hf-gpt2", "hf-llama", *THIRD_PARTY)
TORCH = ("torch-ckpt", "torch-sqrt", "torch-sac")
FRACTIONS = (0.3, 0.5, 0.7)
# Pinned FLOPs per byte moved by a memory-bound op (Note [Recompute cost model]): plans do not
# change with the machine's load or calibration.
FLOPS_PER_BYTE = 2.0
# Steps each budget runs before it is measured. Step 1 records and plans; step 2 is
# the first planned step, measured; step 3 starts by comparing it (planning again once if a
# byte budget was missed) and is measured if it was; step 4 starts by comparing that one
# (warning if the budget is still missed). See Note [Measured budget check].
CHECK_STEPS = 4
# --quick: a smoke run, each model at about a quarter of its default activations.
QUICK: dict[str, dict[str, int]] = {
    name: {"batch": max(1, DEFAULTS[name].batch // 2), "seq_len": DEFAULTS[name].seq_len // 2}
    for name in (*MODELS, *EXTRA)
}
for _name in ("hf-swin", "hf-resnet", "hf-convnext", "hf-efficientnet", "hf-mobilenetv2"):
    QUICK[_name] = {"batch": max(1, DEFAULTS[_name].batch // 4)}  # images keep their side
for _name in ("hf-segformer", "diffusers-vae"):
    QUICK[_name] = {"batch": 1}

ANCHOR_SIZES: dict[str, int] = dict(layers=4, width=256, batch=1, seq_len=1024)
ANCHOR_HEAD_SIZES = (32, 64)
ANCHOR_DROPOUT = 0.1
ANCHOR_BUDGETS = (0.2, 0.25, 0.3)


def one_region(w: Workload, policy: object) -> Callable[[], object]:
    """A forward of ``w`` under one ckpt_graph region with ``policy``."""

    def forward() -> object:
        with cg.save_recompute_policy(policy):
            return w.model(*w.inputs)

    return forward


@dataclass
class Said:
    """What the ``memory_budget`` points of one model said while they planned, by row key."""

    notes: dict[str, str] = field(default_factory=dict)
    reports: dict[str, object] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)


def planned(
    w: Workload, budget: float | int, key: str, said: Said, check: bool | str = "auto"
) -> Callable[[], object]:
    """A one-region ``memory_budget(budget, check=check)`` forward that already planned:
    :data:`CHECK_STEPS` steps run here (the heuristic's, the first plan's, measured by the
    check where it runs, and a re-plan's; Note [Measured budget check])."""
    policy = memory_budget(budget, flops_per_byte=FLOPS_PER_BYTE, check=check)
    forward = one_region(w, policy)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(CHECK_STEPS):  # the first: decided by the heuristic
            for p in w.model.parameters():
                p.grad = None
            w.loss(forward()).backward()
        report = policy.report()  # also stops a measured check still running
    said.reports[key] = report
    first = str(report).splitlines()[0] if report is not None else "no plan"
    steps = f"{CHECK_STEPS} steps, check={check!r}"
    # The last warning: with check=True, the verdict of the measured check.
    warned = f"; warned: {str(caught[-1].message)[:160]}" if caught else ""
    said.notes[key] = f"{first} ({steps} and plan {time.perf_counter() - t0:.1f} s){warned}"
    if caught:
        said.warned.add(key)
    return forward


@dataclass(frozen=True)
class Row:
    """One configuration of one model: the runner's result and a remark."""

    model: str
    result: StrategyResult
    note: str
    sizes: str
    warned: bool = False


def run_model(name: str, sizes: dict[str, int], repeat: int, check: bool = False) -> list[Row]:
    """Every configuration of the module docstring on one model, timed side by side;
    ``check``: every ``memory_budget`` point with ``check=True``."""
    torch.manual_seed(0)
    w = build_workload(name, **sizes)  # type: ignore[arg-type]
    run = WorkloadRun(w, seed=0)
    said = Said()

    def plan(budget: float | int, key: str, check: bool | str = True if check else "auto") -> None:
        run.add(key, lambda: planned(w, budget, key, said, check))

    def torch_config(t: str) -> None:
        run.add(t, lambda: make_forward(t, w))

    run.add("none", lambda: make_forward("none", w))
    for t in TORCH:
        torch_config(t)
    run.add("cg recompute_all", lambda: one_region(w, "recompute_all"))
    for t in TORCH:
        if (peak := run.peak_bytes(t)) is not None:
            plan(peak, f"memory_budget @ {t}")
    for f in FRACTIONS:
        plan(f, f"memory_budget({f})")
    # The same torch peaks as activation budgets: less what the step holds outside the region
    # (none's step peak minus the activations the region keeps without checkpointing).
    baseline = getattr(said.reports.get(f"memory_budget({FRACTIONS[0]})"), "baseline_bytes", None)
    none_peak = run.peak_bytes("none")
    for t in TORCH:
        peak = run.peak_bytes(t)
        if peak is None or none_peak is None or baseline is None:
            continue
        if (budget := peak - (none_peak - baseline)) >= 1024:
            # In the planner's own units (the measured check would take the outside off twice).
            plan(budget, f"memory_budget @ {t} less outside", check=False)
    results = run.results(repeat)
    sizes_text = ", ".join(f"{k} {v}" for k, v in w.sizes.items())
    return [
        Row(name, r, said.notes.get(r.strategy, r.note), sizes_text, r.strategy in said.warned)
        for r in results
    ]


def block_check(name: str, sizes: dict[str, int]) -> str:
    """One row of the block-boundaries section: what ``find_blocks`` finds on one recorded
    ``recompute_all`` forward of model ``name`` against its hand-listed blocks, and the
    hand seeds those blocks give."""
    torch.manual_seed(0)
    w = build_workload(name, **sizes)  # type: ignore[arg-type]
    with cg.save_recompute_policy("recompute_all") as region:
        out = w.model(*w.inputs)
    g = from_region(region, {j: 1 for j in range(len(region.nodes))}, [])
    found = find_blocks(region.nodes, g)
    w.loss(out).backward()
    listed = [id(b) for b in w.blocks]
    got = [c.module_id for c in found.calls]
    if got == listed:
        verdict = "yes: the listed blocks, in order"
    elif set(got) & set(listed):
        verdict = f"partly: {len(set(got) & set(listed))} of the {len(listed)} listed"
    else:
        verdict = "no"
    seeds = ", ".join(sorted(hand_seeds(g, candidate_ops(g), found.ids)))
    return f"| {name} | {len(listed)} | {found.count} | {found.source} | {verdict} | {seeds} |"


BLOCKS_HEADER = [
    "| model | blocks listed by hand | blocks found | found from | the listed ones? | hand seeds |",
    "|---|---:|---:|---|---|---|",
]


def _cmp(a: float, b: float) -> str:
    return "<=" if a <= b else ">"


def _against(r: StrategyResult, t: StrategyResult) -> str:
    """``peak <= (0.93x), FLOPs > (+0.12 G), time <= (0.97x)`` of ``r`` against ``t``."""
    assert r.peak_bytes and t.peak_bytes and r.cpu_time_ratio and t.cpu_time_ratio
    rf, tf = r.extra_flops or 0, t.extra_flops or 0
    time_ratio = r.cpu_time_ratio / t.cpu_time_ratio
    return (
        f"peak {_cmp(r.peak_bytes, t.peak_bytes)} ({r.peak_bytes / t.peak_bytes:.2f}x), "
        f"FLOPs {_cmp(rf, tf)} ({(rf - tf) / 1e9:+.3f} G), "
        f"time {_cmp(time_ratio, 1.0)} ({time_ratio:.2f}x)"
    )


def _dominates(a: StrategyResult, b: StrategyResult) -> bool:
    assert a.peak_bytes and b.peak_bytes and a.cpu_time_ratio and b.cpu_time_ratio
    return (
        a.peak_bytes <= b.peak_bytes
        and (a.extra_flops or 0) <= (b.extra_flops or 0)
        and a.cpu_time_ratio <= b.cpu_time_ratio
    )


def verdict(r: StrategyResult, by: dict[str, StrategyResult]) -> str:
    """The verdict column (see the module docstring)."""
    if r.status != "ok" or r.strategy == "none" or r.strategy in TORCH:
        return ""
    torch_ok = {t: by[t] for t in TORCH if t in by and by[t].status == "ok"}
    if r.strategy.startswith("memory_budget @ "):
        t = r.strategy.removeprefix("memory_budget @ ").removesuffix(" less outside")
        return f"vs {t}: {_against(r, torch_ok[t])}" if t in torch_ok else ""
    if r.strategy == "cg recompute_all":
        return f"vs torch-ckpt: {_against(r, torch_ok['torch-ckpt'])}" if torch_ok else ""
    wins = [t for t, x in torch_ok.items() if _dominates(r, x)]
    losses = [t for t, x in torch_ok.items() if _dominates(x, r)]
    parts = [f"dominates {', '.join(wins)}"] if wins else []
    parts += [f"dominated by {', '.join(losses)}"] if losses else []
    return "; ".join(parts) or "no torch configuration dominates or is dominated"


def table(rows: list[Row]) -> str:
    """Markdown table of every row."""
    mib = 2.0**20
    out = [
        "| model | configuration | peak MiB | peak / none | recompute GFLOP | CPU ms / step "
        "| time / none | max abs grad diff | verdict vs torch | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        by = {r.result.strategy: r.result for r in mine}
        for row in mine:
            r = row.result
            if r.status != "ok":
                out.append(f"| {model} | {r.strategy} | {r.status} | | | | | | | {row.note} |")
                continue
            assert r.peak_bytes is not None and r.peak_ratio is not None
            cpu_ms = (r.cpu_time_s or 0) * 1e3
            out.append(
                f"| {model} | {r.strategy} | {r.peak_bytes / mib:.2f} | {r.peak_ratio:.3f} "
                f"| {(r.extra_flops or 0) / 1e9:.3f} | {cpu_ms:.0f} | {r.cpu_time_ratio:.2f} "
                f"| {r.max_grad_diff:.3g} | {verdict(r, by)} | {row.note} |"
            )
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    """Per model: how many ckpt_graph points meet torch on peak, FLOPs and time."""
    out = [
        "| model | sizes | none MiB | recompute_all vs torch-ckpt peak | memory_budget @ torch "
        "peak: met (peak, FLOPs, time all <=) | @ torch peak less outside: met "
        "| fractions dominating a torch config |",
        "|---|---|---:|---|---|---|---|",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        by = {r.result.strategy: r.result for r in rows if r.model == model}
        none, ckpt = by["none"], by.get("torch-ckpt")
        ra = by.get("cg recompute_all")
        ra_text = "-"
        if ra and ckpt and ra.status == ckpt.status == "ok":
            assert ra.peak_bytes and ckpt.peak_bytes
            ra_text = f"{ra.peak_bytes / ckpt.peak_bytes:.2f}x"
        met_text = []
        for suffix in ("", " less outside"):
            at = [(t, by.get(f"memory_budget @ {t}{suffix}"), by.get(t)) for t in TORCH]
            ok = [(t, r, x) for t, r, x in at if r and x and r.status == x.status == "ok"]
            met = [t for t, r, x in ok if _dominates(r, x)]
            met_text.append(f"{len(met)}/{len(ok)}" + (f" ({', '.join(met)})" if met else ""))
        fr = [
            f"{f}"
            for f in FRACTIONS
            if (r := by.get(f"memory_budget({f})")) is not None
            and r.status == "ok"
            and any(_dominates(r, by[t]) for t in TORCH if by.get(t) and by[t].status == "ok")
        ]
        sizes = next(r.sizes for r in rows if r.model == model)
        assert none.peak_bytes is not None
        out.append(
            f"| {model} | {sizes} | {none.peak_bytes / 2**20:.1f} | {ra_text} "
            f"| {met_text[0]} | {met_text[1]} | {', '.join(fr) or 'none'} |"
        )
    return "\n".join(out)


def _flops_vs(r: StrategyResult, t: StrategyResult) -> str:
    """Recomputed FLOPs of ``r`` / those of ``t``; ``0`` when both recompute nothing,
    ``+x G`` when only ``r`` does."""
    rf, tf = r.extra_flops or 0, t.extra_flops or 0
    if tf > 0:
        return f"{rf / tf:.2f}x"
    return "0" if rf == 0 else f"+{rf / 1e9:.3f}G"


def _at_cell(mine: dict[str, Row], key: str, t: str, with_torch: bool) -> str:
    """One cell of :func:`at_torch`: row ``key`` against torch configuration ``t``."""
    row, x = mine.get(key), mine.get(t)
    if row is None or x is None or row.result.status != "ok" or x.result.status != "ok":
        return "-"
    r, tr = row.result, x.result
    assert r.peak_bytes and tr.peak_bytes
    text = f"{r.peak_bytes / tr.peak_bytes:.2f}x, {_flops_vs(r, tr)}"
    text += " (w)" if row.warned else ""
    return f"{tr.peak_bytes / 2**20:.1f}: {text}" if with_torch else text


def at_torch(rows: list[Row]) -> str:
    """Per model, each ``memory_budget`` point set at a torch configuration's peak against that
    configuration: step peak / torch's and recomputed FLOPs / torch's (``(w)``: warned)."""
    out = [
        "| model | none MiB | "
        + " | ".join(f"@ {t}: torch MiB: peak, FLOPs vs torch" for t in TORCH)
        + " | "
        + " | ".join(f"@ {t} less outside" for t in TORCH)
        + " | one region `recompute_all` vs torch-ckpt |",
        "|---|---:|" + "---|" * (2 * len(TORCH) + 1),
    ]
    for model in dict.fromkeys(r.model for r in rows):
        mine = {r.result.strategy: r for r in rows if r.model == model}
        none = mine["none"].result
        assert none.peak_bytes is not None
        cells = [_at_cell(mine, f"memory_budget @ {t}", t, True) for t in TORCH]
        cells += [_at_cell(mine, f"memory_budget @ {t} less outside", t, False) for t in TORCH]
        cells.append(_at_cell(mine, "cg recompute_all", "torch-ckpt", False))
        out.append(f"| {model} | {none.peak_bytes / 2**20:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def as_json(rows: list[Row], settings: dict[str, Any]) -> str:
    """The run's ``settings`` and every row (each :class:`StrategyResult` field) as JSON."""
    return json.dumps(
        {
            **settings,
            "rows": [
                {
                    "model": row.model,
                    "sizes": row.sizes,
                    **dataclasses.asdict(row.result),
                    "note": row.note,
                    "warned": row.warned,
                }
                for row in rows
            ],
        },
        indent=1,
    )


def anchor(repeat: int) -> str:
    """The Megatron anchor (see the module docstring) as a markdown table."""
    out = [
        "| head size | configuration | peak MiB | peak / none | recompute % of step FLOPs "
        "| time / none | max abs grad diff | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for head in ANCHOR_HEAD_SIZES:
        out += anchor_rows(head, repeat)
    return "\n".join(out)


def anchor_rows(head: int, repeat: int) -> list[str]:
    """The anchor's rows at one head size."""
    torch.manual_seed(0)
    w = build_workload(
        "hf-gpt2",
        **ANCHOR_SIZES,  # type: ignore[arg-type]
        heads=ANCHOR_SIZES["width"] // head,
        dropout=ANCHOR_DROPOUT,
        eager_attention=True,
    )
    run = WorkloadRun(w, seed=0)
    said = Said()

    def plan(budget: float, key: str) -> None:
        run.add(key, lambda: planned(w, budget, key, said))

    run.add("none", lambda: make_forward("none", w))
    run.add("torch-sac", lambda: make_forward("torch-sac", w))
    run.add("megatron (keep addmm/mm)", lambda: one_region(w, save_ops(aten.addmm, aten.mm)))
    for b in ANCHOR_BUDGETS:
        plan(b, f"memory_budget({b})")
    results = run.results(repeat)
    base = results[0]
    out = []
    for r in results:
        if r.status != "ok":
            out.append(f"| {head} | {r.strategy} | {r.status} | | | | | {r.note} |")
            continue
        assert r.peak_bytes and r.peak_ratio and base.flops
        out.append(
            f"| {head} | {r.strategy} | {r.peak_bytes / 2**20:.1f} | {r.peak_ratio:.3f} "
            f"| {100 * (r.extra_flops or 0) / base.flops:+.2f}% | {r.cpu_time_ratio:.2f} "
            f"| {r.max_grad_diff:.3g} | {said.notes.get(r.strategy, r.note)} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None, choices=[*MODELS, *EXTRA])
    parser.add_argument(
        "--extra", action="store_true", help="the models beyond the zoo instead of the zoo's"
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, 2 timed steps")
    parser.add_argument("--repeat", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"memory_budget(..., check=True) at every budget point ({CHECK_STEPS} steps each)",
    )
    parser.add_argument("--anchor", action="store_true", help="add the Megatron anchor")
    parser.add_argument("--no-zoo", action="store_true", help="only the anchor")
    parser.add_argument("--out", help="write the markdown report here, and the rows as .json")
    args = parser.parse_args()
    models = args.models if args.models is not None else list(EXTRA if args.extra else MODELS)
    repeat = args.repeat or (2 if args.quick else 5)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*should be kept in float32.*")
    t0 = time.perf_counter()
    load = os.getloadavg()[0]

    started = datetime.datetime.now(datetime.UTC)
    check = "memory_budget(..., check=True); " if args.check else ""

    def report(sections: list[str], rows: list[Row]) -> str:
        head = (
            f"bench_zoo: {started:%Y-%m-%d %H:%M} UTC, torch "
            f"{torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, 1 thread, load "
            f"{load:.1f} at start, {os.getloadavg()[0]:.1f} now; {repeat} timed steps; "
            f"flops_per_byte={FLOPS_PER_BYTE}; {check}{'--quick; ' if args.quick else ''}"
            f"{time.perf_counter() - t0:.0f} s so far\n"
        )
        text = head + "\n" + "\n".join(sections) + "\n"
        if args.out:  # after every model, so that a run cut short keeps what it measured
            Path(args.out).write_text(text)
            settings = {
                "started_utc": f"{started:%Y-%m-%d %H:%M}",
                "torch": torch.__version__,
                "repeat": repeat,
                "check": args.check,
                "quick": args.quick,
                "flops_per_byte": FLOPS_PER_BYTE,
                "seconds": round(time.perf_counter() - t0),
            }
            Path(args.out).with_suffix(".json").write_text(as_json(rows, settings) + "\n")
        return text

    sections: list[str] = []
    rows: list[Row] = []
    blocks: list[str] = []
    if not args.no_zoo:
        for m in models:
            sizes = dict(QUICK[m]) if args.quick else {}
            t = time.perf_counter()
            if args.extra:
                blocks.append(block_check(m, sizes))
            rows += run_model(m, sizes, repeat, args.check)
            print(f"{m} done ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
            sections = ["## Summary", "", summary(rows), ""]
            sections += ["## memory_budget at torch's peaks", "", at_torch(rows), ""]
            if blocks:
                sections += ["## Block boundaries", "", *BLOCKS_HEADER, *blocks, ""]
            sections += ["## Every configuration", "", table(rows)]
            report(sections, rows)
    if args.anchor:
        sections += ["", "## Megatron anchor", "", anchor(max(2, repeat // 2))]
    print(report(sections, rows))


if __name__ == "__main__":
    main()
