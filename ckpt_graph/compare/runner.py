"""Strategies and runs behind ``ckpt-graph compare``; :func:`run_comparison` is the entry point.

Example:
    >>> from ckpt_graph.compare.runner import run_comparison
    >>> results = run_comparison("mlp", layers=2, width=16, batch=4, repeat=1,
    ...                          strategies=["none", "torch-ckpt"])
    >>> [r.strategy for r in results]
    ['none', 'torch-ckpt']
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import sdpa_backward_flop_count

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.compare.strategies import (
    DEFAULT_BUDGET,
    DEFAULT_STRATEGIES,
    STRATEGIES,
    Forward,
    StrategySkipped,
    make_forward,
    policy_note,
    settling,
)
from ckpt_graph.compare.zoo import Workload, WorkloadError, build_workload
from ckpt_graph.engine.flops import estimate_flops

aten = torch.ops.aten
_log = logging.getLogger(__name__)  # "ckpt_graph.compare.runner": timings, at INFO (cli --verbose)
# Warm-up steps beyond the first while a policy's measured check wants them (memory_budget:
# the first plan's step, and the re-plan's): its profiler then meets neither our measure()
# nor the timed steps. See Note [Measured budget check].
_SETTLE = 4

__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "StrategyResult",
    "StrategySkipped",
    "WorkloadRun",
    "make_forward",
    "run_comparison",
]


@dataclass(frozen=True)
class StrategyResult:
    """Figures of one strategy on one workload; ratios are relative to ``none`` in the same run.

    Attributes:
        strategy: strategy name (a key of :data:`STRATEGIES`).
        status: ``"ok"``, ``"skipped"`` (not available here) or ``"failed"`` (raised).
        note: why it was skipped or failed, or a remark; ``""`` otherwise.
        peak_bytes: peak memory of one training step as measured by ``ckpt_graph.memory``.
        peak_ratio: ``peak_bytes`` / that of ``none``.
        step_time_s: median step time over the timed repeats (forward + backward).
        step_times_s: every timed step.
        time_ratio: ``step_time_s`` / that of ``none``.
        cpu_time_ratio: median process CPU time of a step / that of ``none``: steadier than
            wall time on a loaded machine (with one thread; with more it counts every thread).
        extra_ops: aten ops run in one step beyond those of ``none`` (the recomputed ops).
        extra_flops: FLOPs beyond those of ``none`` (the recompute FLOPs; matmuls, convolutions
            and attention only).
        max_grad_diff: max |grad - grad of none| over all parameters (0.0 means bitwise equal).
        max_buffer_diff: the same for buffers after the step (e.g. BatchNorm running stats).
        cpu_time_s: median process CPU time of a timed step.
        cpu_times_s: process CPU time of every timed step, in round order: round ``i`` of
            two strategies ran back to back, so their ratio per round shows the noise.
        flops: FLOPs of the whole counted step (forward + backward, matmuls, convolutions
            and attention only), to put ``extra_flops`` in proportion.
    """

    strategy: str
    status: str
    note: str = ""
    peak_bytes: int | None = None
    peak_ratio: float | None = None
    step_time_s: float | None = None
    step_times_s: tuple[float, ...] = ()
    time_ratio: float | None = None
    cpu_time_ratio: float | None = None
    extra_ops: int | None = None
    extra_flops: int | None = None
    max_grad_diff: float | None = None
    max_buffer_diff: float | None = None
    cpu_time_s: float | None = None
    flops: int | None = None
    cpu_times_s: tuple[float, ...] = ()

    def __str__(self) -> str:
        if self.status != "ok":
            return f"{self.strategy}: {self.status} ({self.note})"
        mib = "-" if self.peak_bytes is None else f"{self.peak_bytes / 2**20:.1f} MiB"
        ms = "-" if self.step_time_s is None else f"{self.step_time_s * 1e3:.1f} ms"
        return f"{self.strategy}: peak {mib}, step {ms}, max |grad diff| {self.max_grad_diff}"


def _step(w: Workload, forward: Forward) -> None:
    for p in w.model.parameters():
        p.grad = None
    w.loss(forward()).backward()


class _OpCounter(TorchDispatchMode):
    """Counts aten ops and their FLOPs (where torch's flop counter knows a formula)."""

    _FREE = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh.default})

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in self._FREE:
            self.ops += 1
        if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            # A backward kernel, which regions never record: outside the engine's estimator.
            self.flops += sdpa_backward_flop_count(*(a.shape for a in args[:4]))
        else:
            self.flops += estimate_flops(func, out, args, kwargs)
        return out


def _max_diff(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return math.inf
            continue
        if x.is_floating_point():
            d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        else:
            d = float((x != y).any().item())
        worst = max(worst, d)
    return worst


def run_comparison(
    model: str = "gpt",
    *,
    layers: int | None = None,
    width: int | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    dropout: float = 0.0,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    repeat: int = 3,
    seed: int = 0,
    count_ops: bool = True,
    threads: int | None = None,
    budget: float | int = DEFAULT_BUDGET,
    policy: str = "save_matmuls",
    measure: Callable[..., Any] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[StrategyResult]:
    """Run one training step of a workload under each strategy and compare them with ``none``.

    Every strategy runs the same model and weights (state restored before each measured step)
    with the same seed: one warm-up step, one step under ``measure`` (peak memory, gradients,
    buffers), optionally one step under an op counter, then ``repeat`` timed steps interleaved
    round-robin across strategies so that time ratios are measured side by side.

    Args:
        model, layers, width, batch, seq_len, dtype, device, dropout: the workload (see
            :func:`ckpt_graph.compare.zoo.build_workload`).
        strategies: names from :data:`STRATEGIES`; ``none`` is always run first as the reference.
        repeat: timed steps per strategy (the median is reported).
        seed: seed for weights, batch and every step.
        count_ops: also count the aten ops and FLOPs of one step (extra_ops / extra_flops).
        threads: torch intra-op threads during the run (restored after); None keeps torch's.
        budget: memory_budget of cg-budget (fraction of the activation memory, or bytes).
        policy: the policy name of cg-policy (see Note [Policy names]).
        measure: ``measure(fn, device=device) -> report`` with ``report.peak_bytes``; default
            ``ckpt_graph.memory.measure`` (peak memory is left out when it is not importable).
        progress: called as ``progress(done, total, label)`` while running.

    Returns:
        One :class:`StrategyResult` per strategy, ``none`` first.

    Raises:
        ValueError: unknown strategy or repeat < 1.
        ckpt_graph.compare.zoo.WorkloadError: the workload cannot be built.
    """
    names = ["none", *(s for s in dict.fromkeys(strategies) if s != "none")]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise CkptGraphValueError(
            f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}"
        )
    if repeat < 1:
        raise CkptGraphValueError(f"--repeat must be at least 1, got {repeat}")
    if threads is not None and threads < 1:
        raise CkptGraphValueError(f"--threads must be at least 1, got {threads}")
    saved_threads = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        return _run(
            model,
            dict(
                layers=layers,
                width=width,
                batch=batch,
                seq_len=seq_len,
                dtype=dtype,
                device=device,
                dropout=dropout,
                seed=seed,
            ),
            names,
            repeat,
            seed,
            count_ops,
            measure,
            progress,
            {"budget": budget, "policy_name": policy},
        )
    finally:
        torch.set_num_threads(saved_threads)


def _run(
    model: str,
    build: dict[str, Any],
    names: list[str],
    repeat: int,
    seed: int,
    count_ops: bool,
    measure: Callable[..., Any] | None,
    progress: Callable[[int, int, str], None] | None,
    options: dict[str, Any],
) -> list[StrategyResult]:
    w = build_workload(model, **build)
    total = len(names) * (3 if count_ops else 2) + len(names) * repeat
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    run = WorkloadRun(
        w, seed=seed, count_ops=count_ops, measure=measure, device=build["device"], tick=tick
    )
    for name in names:
        ok = run.add(name, functools.partial(make_forward, name, w, **options))
        if not ok:
            done += (2 if count_ops else 1) + repeat
    return run.results(repeat)


class WorkloadRun:
    """Strategies of one workload, measured one at a time, then timed side by side.

    :func:`run_comparison` adds every strategy by name; a benchmark may add forwards that
    depend on figures already measured (e.g. a budget at another strategy's measured peak)
    and still get step times measured side by side with the others. The first one added is
    the reference (``none``): ratios, extra ops and gradient differences are relative to it.

    Example:
        >>> from ckpt_graph.compare.zoo import build_workload
        >>> w = build_workload("mlp", layers=2, width=16, batch=4)
        >>> run = WorkloadRun(w)
        >>> run.add("none", lambda: make_forward("none", w))
        True
        >>> run.add("torch-ckpt", lambda: make_forward("torch-ckpt", w))
        True
        >>> run.peak_bytes("torch-ckpt") is not None
        True
        >>> [r.strategy for r in run.results(repeat=1)]
        ['none', 'torch-ckpt']
    """

    def __init__(
        self,
        w: Workload,
        *,
        seed: int = 0,
        count_ops: bool = True,
        measure: Callable[..., Any] | None = None,
        device: str = "cpu",
        tick: Callable[[str], None] | None = None,
    ) -> None:
        if measure is None:
            try:
                from ckpt_graph import memory

                measure = memory.measure
            except ImportError:
                measure = None
        self.w = w
        self.seed = seed
        self.count_ops = count_ops
        self.measure = measure
        self.device = device
        self._tick = tick or (lambda label: None)
        self._initial = {k: v.clone() for k, v in w.model.state_dict().items()}
        self._params = list(w.model.parameters())
        self._forwards: dict[str, Forward] = {}
        self._figures: dict[str, dict[str, Any]] = {}
        self._ref: dict[str, Any] = {}

    def peak_bytes(self, name: str) -> int | None:
        """Measured step peak of an added strategy (None: not measured, skipped or failed)."""
        fig = self._figures.get(name, {})
        return fig.get("peak_bytes") if fig.get("status") == "ok" else None

    def add(self, name: str, make: Callable[[], Forward]) -> bool:
        """Build a forward with ``make()`` and measure one step of it under ``name``.

        One warm-up step (more while the policy's measured check wants them), one step
        under ``measure`` (peak memory, gradients, buffers), one
        under the op counter if ``count_ops``; the model's state is restored before each.
        Returns whether it ran: :class:`StrategySkipped` from ``make`` marks it skipped, any
        other exception failed (the reference's own failure raises ``WorkloadError``).
        """
        w = self.w
        fig: dict[str, Any] = {"strategy": name, "status": "ok"}
        self._figures[name] = fig
        try:
            forward = make()
            _step(w, forward)  # warm-up
            for _ in range(_SETTLE):  # a policy's own measured steps, before ours
                if not settling(forward):
                    break
                _step(w, forward)
            self._tick(f"{name}: warm-up")
            w.model.load_state_dict(self._initial)
            gc.collect()
            torch.manual_seed(self.seed)
            if self.measure is not None:
                report = self.measure(functools.partial(_step, w, forward), device=self.device)
                fig["peak_bytes"] = int(report.peak_bytes)
            else:
                _step(w, forward)
                fig["note"] = "ckpt_graph.memory not importable: no peak memory"
            self._tick(f"{name}: measured step")
            grads = [None if p.grad is None else p.grad.detach().clone() for p in self._params]
            buffers = [b.detach().clone() for b in w.model.buffers()]
            if not self._ref:
                self._ref.update(grads=grads, buffers=buffers)
            fig["max_grad_diff"] = _max_diff(grads, self._ref["grads"])
            fig["max_buffer_diff"] = _max_diff(buffers, self._ref["buffers"])
            _log.info("%s: measured step, peak %s bytes", name, fig.get("peak_bytes", "?"))
            if note := policy_note(forward):
                fig["note"] = note
                _log.info("%s: %s", name, note)
            if self.count_ops:
                w.model.load_state_dict(self._initial)
                torch.manual_seed(self.seed)
                counter = _OpCounter()
                with counter:
                    _step(w, forward)
                fig["ops"], fig["flops"] = counter.ops, counter.flops
                self._tick(f"{name}: counting ops")
            self._forwards[name] = forward
        except StrategySkipped as e:
            fig.update(status="skipped", note=str(e))
        except Exception as e:  # a failing strategy is reported, not fatal
            if len(self._figures) == 1:
                # The reference itself does not run: a dtype/device the model does not support.
                raise WorkloadError(
                    f"{w.name} does not run here even without checkpointing: {type(e).__name__}: "
                    + (str(e).strip().splitlines() or [""])[0][:200]
                ) from e
            first = (str(e).strip().splitlines() or [""])[0]
            fig.update(status="failed", note=f"{type(e).__name__}: {first}"[:300])
        return name in self._forwards

    def results(self, repeat: int) -> list[StrategyResult]:
        """Time ``repeat`` steps of every strategy that ran, round-robin; all figures."""
        cuda = torch.device(self.device).type == "cuda"

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(self.device)

        forwards = self._forwards
        times: dict[str, list[float]] = {n: [] for n in forwards}
        cpu: dict[str, list[float]] = {n: [] for n in forwards}
        for r in range(repeat):
            for name, forward in forwards.items():
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                _step(self.w, forward)
                sync()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                _log.info(
                    "%s: timed step %d/%d: %.1f ms", name, r + 1, repeat, 1e3 * times[name][-1]
                )
                self._tick(f"{name}: timed step {r + 1}/{repeat}")
        for p in self._params:
            p.grad = None
        for name in forwards:
            self._figures[name]["cpu"] = statistics.median(cpu[name])
            self._figures[name]["cpu_times"] = tuple(cpu[name])
        ref = next(iter(self._figures))
        return [
            _finish(fig, times.get(n, []), self._figures[ref], times[ref])
            for n, fig in self._figures.items()
        ]


def _finish(
    fig: dict[str, Any], times: list[float], none: dict[str, Any], none_times: list[float]
) -> StrategyResult:
    if fig["status"] != "ok":
        return StrategyResult(fig["strategy"], fig["status"], fig.get("note", ""))
    med = statistics.median(times)
    peak = fig.get("peak_bytes")
    peak_none = none.get("peak_bytes")
    extra_ops = extra_flops = None
    if "ops" in fig:
        extra_ops = fig["ops"] - none["ops"]
        extra_flops = fig["flops"] - none["flops"]
    return StrategyResult(
        strategy=fig["strategy"],
        status="ok",
        note=fig.get("note", ""),
        peak_bytes=peak,
        peak_ratio=peak / peak_none if peak is not None and peak_none else None,
        step_time_s=med,
        step_times_s=tuple(times),
        time_ratio=med / statistics.median(none_times),
        cpu_time_ratio=fig["cpu"] / none["cpu"] if none["cpu"] > 0 else None,
        extra_ops=extra_ops,
        extra_flops=extra_flops,
        max_grad_diff=fig["max_grad_diff"],
        max_buffer_diff=fig["max_buffer_diff"],
        cpu_time_s=fig["cpu"],
        flops=fig.get("flops"),
        cpu_times_s=fig["cpu_times"],
    )
