from __future__ import annotations

import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.memory import MemoryReport, measure, measure_with_result

MIB = 2**20


def _block(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.empty(nbytes // dtype.itemsize, dtype=dtype)


def _check_consistent(report: MemoryReport) -> None:
    level = 0
    for point in report.timeline:
        level += point.delta_bytes
        assert point.allocated_bytes == level >= 0
    assert [p.time_us for p in report.timeline] == sorted(p.time_us for p in report.timeline)
    assert level == report.end_bytes
    assert max((p.allocated_bytes for p in report.timeline), default=0) == report.peak_bytes


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64])
def test_three_blocks_free_one_allocate_one(dtype: torch.dtype) -> None:
    def fn() -> torch.Tensor:
        a, b, c = _block(MIB, dtype), _block(MIB, dtype), _block(MIB, dtype)
        del b
        d = _block(MIB, dtype)
        del c, d
        return a

    report = measure(fn)
    assert report.peak_bytes == 3 * MIB
    assert report.end_bytes == MIB
    assert [p.delta_bytes for p in report.timeline] == [MIB, MIB, MIB, -MIB, MIB, -MIB, -MIB]
    assert {p.phase for p in report.timeline} == {"forward"}
    _check_consistent(report)


def test_temporary_counts_in_peak_not_in_end() -> None:
    x = torch.randn(MIB // 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        tmp = x * x
        return tmp.sum()

    out, report = measure_with_result(fn, x)
    # sum may use scratch space of its own: it counts too, on top of the live temporary.
    sum_peak = measure(torch.sum, x * x).peak_bytes
    assert sum_peak >= out.nbytes
    assert report.peak_bytes == x.nbytes + sum_peak
    assert report.end_bytes == out.nbytes
    torch.testing.assert_close(out, fn(x), rtol=0, atol=0)
    _check_consistent(report)


def test_small_sizes_count_requested_bytes() -> None:
    # The allocator reports storage bytes, not its 64-byte aligned blocks.
    # See Note [Measuring CPU memory].
    report = measure(lambda: [_block(3), _block(5), _block(100)])
    assert report.peak_bytes == report.end_bytes == 108


def test_blocks_allocated_before_the_call_are_ignored() -> None:
    # One block from plain eager code, one allocated under an earlier measure(): the profiler
    # remembers the size of the latter and reports its free.
    early = [torch.empty(2 * MIB, dtype=torch.uint8)]
    early.append(measure_with_result(_block, 2 * MIB)[0])

    def fn() -> torch.Tensor:
        early.clear()
        return _block(MIB)

    report = measure(fn)
    assert report.peak_bytes == MIB
    assert report.end_bytes == MIB
    assert [p.delta_bytes for p in report.timeline] == [MIB]
    _check_consistent(report)


def test_end_counts_result_and_report_keeps_no_tensor() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn() -> torch.Tensor:
        t = _block(MIB)
        refs.append(weakref.ref(t))
        return t

    report = measure(fn)
    assert report.end_bytes == report.peak_bytes == MIB
    assert refs[0]() is None


def _sin_mul(x: torch.Tensor) -> None:
    (x.sin() * x).sum().backward()


def test_forward_and_backward_phases() -> None:
    x = torch.randn(256, requires_grad=True)
    report = measure(_sin_mul, x)
    phases = {p.phase for p in report.timeline}
    assert phases == {"forward", "backward"}
    backward_ops = {p.op for p in report.timeline if p.phase == "backward"}
    assert "aten::cos" in backward_ops
    assert report.peak_by_phase.keys() == {"forward", "backward"}
    assert max(report.peak_by_phase.values()) == report.peak_bytes
    assert report.end_bytes == x.nbytes  # x.grad
    _check_consistent(report)


class _RecomputeInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        with record_function("ckpt_graph::recompute::aten.empty"):
            _block(MIB)
        return grad


def test_recompute_phase_is_innermost_range() -> None:
    x = torch.randn(16, requires_grad=True)

    def fn() -> None:
        with record_function("ckpt_graph::recompute::aten.empty"):
            _block(MIB)
        _RecomputeInBackward.apply(x).sum().backward()

    report = measure(fn)
    recomputed = [p for p in report.timeline if p.phase == "recompute" and p.delta_bytes > 0]
    assert [(p.delta_bytes, p.op) for p in recomputed] == [(MIB, "aten::empty")] * 2
    assert {p.phase for p in report.timeline} == {"forward", "backward", "recompute"}
    assert report.peak_by_phase["recompute"] == report.peak_bytes


def test_op_is_outermost_aten_op() -> None:
    x = torch.randn(64)
    # aten::to calls aten::_to_copy, which calls aten::empty_strided to allocate.
    report = measure(lambda: x.to(torch.float64))
    assert [(p.delta_bytes, p.op) for p in report.timeline] == [(x.nbytes * 2, "aten::to")]


def test_nested_measure_raises_and_outer_still_works() -> None:
    def inner() -> torch.Tensor:
        return _block(MIB)

    def outer() -> torch.Tensor:
        with pytest.raises(CkptGraphError, match=r"^ckpt_graph: measure\(\) cannot run while"):
            measure(inner)
        return inner()

    report = measure(outer)
    assert report.peak_bytes == report.end_bytes == MIB
    with (
        profile(activities=[ProfilerActivity.CPU]),
        pytest.raises(CkptGraphError, match=r"or a torch\.profiler\.profile is running"),
    ):
        measure(inner)


def test_concurrent_measure_in_another_thread_raises() -> None:
    # Two profiler sessions started from two threads crash the process: the second must refuse.
    started, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        started.wait(timeout=30)
        try:
            measure(_block, MIB)
        except CkptGraphError as e:
            errors.append(e)
        finally:
            done.set()

    def fn() -> torch.Tensor:
        out = _block(MIB)
        started.set()
        done.wait(timeout=30)
        return out

    thread = threading.Thread(target=other)
    thread.start()
    report = measure(fn)
    thread.join()
    assert len(errors) == 1
    assert "another measure() (nested, or in another thread)" in str(errors[0])
    assert report.peak_bytes == report.end_bytes == MIB


def test_exception_in_fn_propagates_and_profiler_stops() -> None:
    def boom() -> None:
        _block(MIB)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        measure(boom)
    assert not torch._C._autograd._profiler_enabled()
    assert measure(_block, MIB).peak_bytes == MIB


def test_profiler_output_is_silenced(capfd: pytest.CaptureFixture[str]) -> None:
    early = [_block(MIB)]
    measure(early.clear)
    captured = capfd.readouterr()
    assert "profiler" not in captured.err + captured.out
    assert "Memory block" not in captured.err + captured.out


def test_bad_device_raises() -> None:
    with pytest.raises(ValueError, match="device must be 'cpu' or a CUDA device"):
        measure(_block, MIB, device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_raises() -> None:
    with pytest.raises(CkptGraphError, match=r"^ckpt_graph: measure\(device='cuda'\) needs CUDA"):
        measure(_block, MIB, device="cuda")


class _FakeCudaAllocator:
    """Stands in for torch.cuda's counters, to check measure's CUDA arithmetic without a GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allocated: int) -> None:
        self.allocated = self.peak = allocated
        for name, value in {
            "is_available": lambda: True,
            "current_device": lambda: 0,
            "synchronize": lambda index: None,
            "reset_peak_memory_stats": self.reset,
            "memory_allocated": lambda index: self.allocated,
            "max_memory_allocated": lambda index: self.peak,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def reset(self, index: int) -> None:
        self.peak = self.allocated

    def add(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)


def test_cuda_arithmetic_with_fake_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCudaAllocator(monkeypatch, allocated=5 * MIB)
    fake.peak = 9 * MIB  # an earlier peak: must be reset, not reported

    def fn() -> None:
        fake.add(2 * MIB)
        fake.add(-MIB)
        with pytest.raises(CkptGraphError, match=r"^ckpt_graph: measure\(\) cannot run while"):
            measure(fn, device="cuda")

    report = measure(fn, device="cuda")
    assert (report.peak_bytes, report.end_bytes, report.device) == (2 * MIB, MIB, "cuda:0")
    assert report.timeline == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_statistics() -> None:
    def fn() -> torch.Tensor:
        a, b = _block(MIB).cuda(), _block(MIB).cuda()
        del b
        return a

    report = measure(fn, device="cuda")
    assert report.peak_bytes == 2 * MIB
    assert report.end_bytes == MIB
    assert report.device == f"cuda:{torch.cuda.current_device()}"


def test_str_shows_mib_and_points() -> None:
    report = measure(lambda: [_block(3 * MIB // 2), _block(MIB // 2)][1])
    text = str(report)
    assert "2.000 MiB" in text  # peak
    assert "0.500 MiB" in text  # end
    assert f"{len(report.timeline)} timeline points" in text


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    x = torch.randn(256, requires_grad=True)
    path = tmp_path / "memory.png"
    measure(_sin_mul, x).plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        measure(_block, 8).plot(tmp_path / "never.png")
    assert not (tmp_path / "never.png").exists()
