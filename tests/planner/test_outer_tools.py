"""A ``memory_budget`` plan survives the tools users wrap around a training step (issue 25).

Each tool is entered outside the region for one step after the plan was made: a flop
counter (as MFU reporting does), the profiler with memory profiling, torch's debug dispatch
mode, a hand-written logging mode that issues ops of its own, ``MemTracker`` and anomaly
mode. The step under the tool must record the same graph, follow the same plan (same kept
values, same recompute) without a warning, and give the gradients of an eager step under
the same tool; the next normal step must follow the plan without planning again. See Note
[Tools outside a region] in ``ckpt_graph/engine/record.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_graph as cg
from ckpt_graph.compare.zoo import Workload, build_workload
from ckpt_graph.engine.region import Region
from ckpt_graph.planner.memory_budget import MemoryBudget, memory_budget


class _LoggingMode(TorchDispatchMode):
    """A debug mode as users write them: logs each op with a checksum of its output, which
    runs ops of its own (``sum``) below the region's recorder."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, float]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        checksum = 0.0
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            checksum = float(out.detach().double().sum())
        self.log.append((str(func), checksum))
        return out


def _flop_counter(w: Workload) -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def _profiler(w: Workload) -> Any:
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    )


def _debug_mode(w: Workload) -> Any:
    from torch.utils._debug_mode import DebugMode

    return DebugMode(record_torchfunction=True, record_nn_module=True, record_stack_trace=True)


def _mem_tracker(w: Workload) -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(w.model)
    return tracker


@contextlib.contextmanager
def _quiet_anomaly(w: Workload) -> Iterator[None]:
    with warnings.catch_warnings():  # torch warns that anomaly mode is slow
        warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")
        with torch.autograd.detect_anomaly():
            yield


TOOLS: dict[str, Callable[[Workload], Any]] = {
    "FlopCounterMode": _flop_counter,
    "profiler(profile_memory=True)": _profiler,
    "DebugMode": _debug_mode,
    "logging TorchDispatchMode": lambda w: _LoggingMode(),
    "MemTracker": _mem_tracker,
    "detect_anomaly": _quiet_anomaly,
}


def _workload() -> Workload:
    # the embedded GPT of the issue, narrow, with dropout so that RNG replay is covered
    return build_workload("gpt", layers=4, width=32, batch=2, seq_len=16, dropout=0.1)


def _grads(w: Workload) -> list[torch.Tensor]:
    return [p.grad.clone() for p in w.model.parameters() if p.grad is not None]


def _eager_step(w: Workload) -> list[torch.Tensor]:
    for p in w.model.parameters():
        p.grad = None
    torch.manual_seed(1)
    w.loss(w.model(*w.inputs)).backward()
    return _grads(w)


class _Step:
    """What a region step recorded, decided and recomputed."""

    def __init__(self, w: Workload, policy: MemoryBudget) -> None:
        for p in w.model.parameters():
            p.grad = None
        torch.manual_seed(1)
        with cg.save_recompute_policy(policy) as region:
            loss = w.loss(w.model(*w.inputs))
        self.ops = [
            (str(n.op), tuple(h.shape for h in n.outputs if h is not None)) for n in region.nodes
        ]
        self.kept = _kept(region)
        self.recompute_ops = region.summary().recompute_ops
        loss.backward()
        self.recomputed = region.summary().recomputed_ops_total
        self.grads = _grads(w)
        self.report = policy.report()


def _kept(region: Region) -> list[tuple[int, int]]:
    return [
        (n.index, i)
        for n in region.nodes
        for i, h in enumerate(n.outputs)
        if h is not None and h.kept
    ]


def _ckpt_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(c.message) for c in caught if str(c.message).startswith("ckpt_graph:")]


@pytest.mark.parametrize("tool", list(TOOLS))
def test_plan_followed_under_tool(tool: str) -> None:
    w = _workload()
    policy = memory_budget(0.6, flops_per_byte=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _Step(w, policy)  # records; the online heuristic decides
        planned = _Step(w, policy)  # follows the plan made when it started
        assert planned.report is not None
        reuses = planned.report.reuses
        with TOOLS[tool](w):
            under = _Step(w, policy)
        with TOOLS[tool](w):
            eager_under = _eager_step(w)
        after = _Step(w, policy)
    assert _ckpt_warnings(caught) == []
    assert under.ops == planned.ops
    assert under.kept == planned.kept and after.kept == planned.kept
    assert under.recompute_ops == planned.recompute_ops > 0
    assert under.recomputed == planned.recomputed == after.recomputed > 0
    # the same plan, reused by both steps: nothing was planned again
    assert under.report is not None and after.report is not None
    assert under.report.kept == after.report.kept == planned.report.kept
    assert after.report.reuses == reuses + 2
    for got, want in zip(under.grads, eager_under, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(after.grads, _eager_step(w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("tool", ["FlopCounterMode", "logging TorchDispatchMode"])
def test_plan_made_under_tool_is_followed_without_it(tool: str) -> None:
    """The step that records the graph (and the one that plans) may run under the tool."""
    w = _workload()
    policy = memory_budget(0.6, flops_per_byte=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TOOLS[tool](w):
            _Step(w, policy)
            planned = _Step(w, policy)
        after = _Step(w, policy)
    assert _ckpt_warnings(caught) == []
    assert after.ops == planned.ops and after.kept == planned.kept
    assert planned.report is not None and after.report is not None
    assert after.report.reuses == planned.report.reuses + 1
    for got, want in zip(after.grads, _eager_step(w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
