"""Measure the memory a function allocates: peak, end level and a timeline by phase.

Example:
    >>> import torch
    >>> from ckpt_graph.memory import measure
    >>> report = measure(torch.empty, 2**20, dtype=torch.uint8)
    >>> report.peak_bytes, report.end_bytes
    (1048576, 1048576)
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ckpt_graph._errors import CkptGraphError, CkptGraphImportError, CkptGraphValueError

__all__ = [
    "MemoryPoint",
    "MemoryReport",
    "StepProbe",
    "busy",
    "measure",
    "measure_with_result",
]

T = TypeVar("T")
Phase = Literal["forward", "backward", "recompute"]

_MIB = float(2**20)
_MARKER = "ckpt_graph::measure"
_MARK = "ckpt_graph::mark::"  # StepProbe.mark: a zero-length range named after the mark
# Range-name prefixes that set the phase of the allocations they contain (innermost wins).
_PHASE_PREFIXES: tuple[tuple[str, Phase], ...] = (
    ("autograd::engine::evaluate_function:", "backward"),
    ("ckpt_graph::recompute", "recompute"),
)
_PHASE_COLOURS: dict[str, str] = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "recompute": "tab:green",
}
# One measure() at a time in the process: two profiler sessions started from two threads crash
# torch, and the CUDA peak statistic is process-wide.
_MEASURE_LOCK = threading.Lock()
# The running StepProbe, if any: measure() abandons it (one at a time, under _MEASURE_LOCK),
# and so does the interpreter's exit (a profiler still running then crashes it).
_PROBES: list[StepProbe] = []


@atexit.register
def _abandon_probes() -> None:
    for probe in list(_PROBES):
        probe.abandon()


_BUSY = (
    "ckpt_graph: measure() cannot run while another measure() (nested, or in another thread) "
    "or a torch.profiler.profile is running; measure the outer call only, or run the "
    "measurements one after the other"
)

# Note [Measuring CPU memory]
# 1. CPU memory is measured by replaying the allocator's own events: `measure` runs `fn` under
#    `torch.profiler.profile(activities=[CPU], profile_memory=True)` (no shapes, no stacks) inside
#    a `ckpt_graph::measure` range, and reads the event tree of the result. Every allocation and
#    free of torch's CPU allocator is an event with its pointer, its size (negative on free) and
#    a time; ranges (aten ops, autograd engine functions, `record_function` blocks) are events
#    with a start and an end.
# 2. The level starts at 0 and only tracks blocks allocated inside the range: a free whose
#    pointer was not allocated in the range (a tensor created before the call and released
#    during it) is ignored, so the level never goes below 0 and such frees never hide a peak.
#    `end_bytes` is the level when `fn` returned, while its result was still referenced.
# 3. Sizes are the bytes torch asked for (storage `nbytes`), not what the system allocator
#    reserved: a 4-byte scalar counts 4, not its 64-byte aligned block. Peaks are therefore
#    exact in storage bytes and independent of malloc's rounding and fragmentation.
# 4. Phases are assigned by time containment in the ranges named in `_PHASE_PREFIXES`: the
#    autograd engine opens `autograd::engine::evaluate_function: ...` for each backward node,
#    and the realize step opens `ckpt_graph::recompute::<op>` around every recomputed op while
#    the profiler is on. Ranges are swept in start order with a heap (O(n log n)), so an event
#    gets the innermost range covering it; nothing covering it means "forward" (so frees made
#    between engine functions or after `backward()` returns are "forward" too).
# 5. `op` is the outermost `aten::` op enclosing the event on its own thread (the op the user,
#    an autograd formula or the recompute called); the innermost one is nearly always a factory
#    such as `aten::empty_strided`, which says nothing.
# Known limitations: memory not obtained from torch's allocator is invisible (numpy arrays,
# Python objects, buffers that libraries such as oneDNN allocate for themselves). Allocations
# made by other threads during the call are counted (the allocator is process-wide) and get
# their phase by time only. The profiler is process-wide too, so measure() cannot run while
# another profiler or measure() is active, in any thread: that raises CkptGraphError. Every op
# is recorded, so the call runs several times slower (measured in BENCHMARKS.md, "History from
# Notes").


@dataclass(frozen=True)
class MemoryPoint:
    """One allocation or free seen during a measured call.

    Attributes:
        time_us: microseconds since the call started.
        allocated_bytes: bytes allocated during the call and still live after this event.
        delta_bytes: size of the block, positive for an allocation, negative for a free.
        phase: "forward", "backward" or "recompute". See Note [Measuring CPU memory].
        op: name of the aten op that allocated or freed the block, or "".
    """

    time_us: float
    allocated_bytes: int
    delta_bytes: int
    phase: Phase
    op: str


@dataclass(frozen=True)
class MemoryReport:
    """Memory allocated by one call, relative to the level when the call started.

    Holds no tensor: only numbers and strings.

    Attributes:
        peak_bytes: highest level reached while the call ran.
        end_bytes: level when the call returned (its result included).
        timeline: one point per allocation or free, in time order; empty on CUDA.
        device: "cpu" or the CUDA device measured, e.g. "cuda:0".

    Example:
        >>> report = measure(lambda: [torch.empty(1024, dtype=torch.uint8) for _ in "ab"][1])
        >>> print(report.peak_bytes, report.end_bytes, [p.delta_bytes for p in report.timeline])
        2048 1024 [1024, 1024, -1024]
    """

    peak_bytes: int
    end_bytes: int
    timeline: tuple[MemoryPoint, ...]
    device: str = "cpu"

    @property
    def peak_by_phase(self) -> dict[str, int]:
        """Highest level reached at an event of each phase present in the timeline."""
        peaks: dict[str, int] = {}
        for p in self.timeline:
            peaks[p.phase] = max(peaks.get(p.phase, 0), p.allocated_bytes)
        return peaks

    def __str__(self) -> str:
        rows = [("peak", self.peak_bytes), ("end", self.end_bytes)]
        rows += [(f"peak in {phase}", peak) for phase, peak in self.peak_by_phase.items()]
        lines = [f"MemoryReport on {self.device}, {len(self.timeline)} timeline points"]
        lines += [f"  {name:<18} {n / _MIB:>10.3f} MiB {n:>14,d} B" for name, n in rows]
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw allocated memory over time to an image file, phases shaded.

        Needs matplotlib (`pip install matplotlib`, or `pip install -e ".[viz]"` in a
        checkout); draws without a display.

        Example:
            >>> measure(torch.ones, 1000).plot("memory.png")  # doctest: +SKIP
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise CkptGraphImportError(
                "ckpt_graph: MemoryReport.plot needs matplotlib; "
                "install it with `pip install matplotlib` (or `pip install -e '.[viz]'` in a "
                "checkout of ckpt_graph)"
            ) from e
        fig = Figure(figsize=(8, 4))
        FigureCanvasAgg(fig)  # headless: attaches an Agg canvas, no global backend change
        ax = fig.add_subplot()
        times = [0.0] + [p.time_us / 1000 for p in self.timeline]
        levels = [0.0] + [p.allocated_bytes / _MIB for p in self.timeline]
        ax.step(times, levels, where="post", color="black", linewidth=1)
        labelled: set[str] = set()
        for phase, start, end in _phase_spans(self.timeline):
            label = None if phase in labelled else phase
            labelled.add(phase)
            ax.axvspan(
                start / 1000, end / 1000, color=_PHASE_COLOURS[phase], alpha=0.2, label=label
            )
        ax.axhline(self.peak_bytes / _MIB, color="red", linestyle="--", linewidth=0.8, label="peak")
        ax.set_xlabel("time (ms)")
        ax.set_ylabel(f"allocated on {self.device} (MiB)")
        ax.legend(loc="best", fontsize="small")
        fig.savefig(os.fspath(path))


def _phase_spans(timeline: tuple[MemoryPoint, ...]) -> Iterator[tuple[str, float, float]]:
    """Yields (phase, start_us, end_us) for each run of consecutive points in one phase."""
    if not timeline:
        return
    phase, start = timeline[0].phase, timeline[0].time_us
    for p in timeline[1:]:
        if p.phase != phase:
            yield phase, start, p.time_us
            phase, start = p.phase, p.time_us
    yield phase, start, timeline[-1].time_us


def busy() -> bool:
    """Whether a :func:`measure`, a :class:`StepProbe` or a profiler runs now, in any thread:
    a :func:`measure` started now would raise, or abandon the probe.

    Example:
        >>> busy()
        False
    """
    return (
        _MEASURE_LOCK.locked()
        or bool(torch.autograd.profiler._is_profiler_enabled)
        or bool(torch._C._autograd._profiler_enabled())
    )


def measure(
    fn: Callable[..., Any], *args: Any, device: str | torch.device = "cpu", **kwargs: Any
) -> MemoryReport:
    """Runs `fn(*args, **kwargs)` and reports the memory it allocated; its result is dropped.

    `device="cpu"` replays the allocator's events (exact, with a timeline, see
    Note [Measuring CPU memory]); a CUDA device uses `torch.cuda` statistics. `device` is
    taken by `measure` itself: pass a `device=` meant for `fn` through a lambda.

    Raises:
        CkptGraphError: if another measure (nested or in another thread) or a profiler is
            running, or CUDA is asked for and not available.
        ValueError: for a device that is neither CPU nor CUDA.

    Known limitations:
        On CUDA the report comes from the caching allocator's counters: sizes are its rounded
        blocks (multiples of 512 bytes), frees of tensors allocated before the call count (so
        `end_bytes` can be negative and a peak can hide behind them), the peak statistic is
        reset for the whole process, and the timeline is empty.

    Example:
        >>> def step():
        ...     tmp = torch.empty(4096, dtype=torch.uint8)
        ...     return torch.empty(1024, dtype=torch.uint8)
        >>> r = measure(step)
        >>> (r.peak_bytes, r.end_bytes)
        (5120, 1024)
    """
    return measure_with_result(fn, *args, device=device, **kwargs)[1]


def measure_with_result(
    fn: Callable[..., T], *args: Any, device: str | torch.device = "cpu", **kwargs: Any
) -> tuple[T, MemoryReport]:
    """Like `measure`, but also returns `fn`'s result: `(result, report)`.

    Example:
        >>> out, r = measure_with_result(torch.zeros, 256, dtype=torch.uint8)
        >>> out.shape, r.end_bytes
        (torch.Size([256]), 256)
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise CkptGraphValueError(
            f"ckpt_graph: measure: device must be 'cpu' or a CUDA device, got {device!r}"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CkptGraphError(
            f"ckpt_graph: measure(device={str(dev)!r}) needs CUDA, which is not available; "
            "use device='cpu'"
        )
    for probe in list(_PROBES):  # a measurement asked for explicitly wins over a probe
        probe.abandon()
    if not _MEASURE_LOCK.acquire(blocking=False):
        raise CkptGraphError(_BUSY)
    try:
        if dev.type == "cuda":
            return _measure_cuda(fn, args, kwargs, dev)
        if torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled():
            raise CkptGraphError(_BUSY)
        return _measure_cpu(fn, args, kwargs)
    finally:
        _MEASURE_LOCK.release()


def _measure_cpu(
    fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[T, MemoryReport]:
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    primer = torch.empty(1, dtype=torch.uint8)
    with _quiet_stderr():
        prof.start()
        # The allocator warns once per process about freeing a block allocated before the
        # profiler started; spend that warning here, where stderr is silenced.
        del primer
    try:
        with record_function(_MARKER):
            result = fn(*args, **kwargs)
    finally:
        with _quiet_stderr():
            prof.stop()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise CkptGraphError("ckpt_graph: measure() got no results from the PyTorch profiler")
    return result, _replay(results.experimental_event_tree())


def _measure_cuda(
    fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], dev: torch.device
) -> tuple[T, MemoryReport]:
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)
    torch.cuda.reset_peak_memory_stats(index)
    start = torch.cuda.memory_allocated(index)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(index)
    peak = torch.cuda.max_memory_allocated(index) - start
    end = torch.cuda.memory_allocated(index) - start
    return result, MemoryReport(peak, end, (), f"cuda:{index}")


class StepProbe:
    """The peak of a stretch of a program that no single call encloses, started and stopped
    from hooks (``memory_budget`` measures one training step with it).

    Same figures as :func:`measure` (Note [Measuring CPU memory]; the CUDA counters on
    CUDA), relative to the level at :meth:`start`.

    Args:
        device: the device whose memory is measured.
        ended: says whether the stretch measured is over; a :func:`measure` started after
            it ended stops the probe and keeps its peak for :meth:`stop` instead of
            abandoning it (a program measuring its step right after the probed one).

    Known limitations:
        A probe cannot start while a :func:`measure`, a profiler or another probe runs
        (``start`` then returns False); a :func:`measure` started while it runs and before
        ``ended()`` abandons it (``stop`` then returns None, ``why`` says so), and so does a
        profiler the program starts and stops while it runs (the profiler takes over the
        session; a profiler still running at :meth:`stop` is stopped with it: torch keeps
        one session per process). On CPU the profiler records every op while it runs,
        which slows that stretch several times; on CUDA it resets the process's peak
        statistic.

    Example:
        >>> probe = StepProbe("cpu")
        >>> probe.start()
        True
        >>> keep = torch.empty(4096, dtype=torch.uint8)
        >>> probe.stop()
        4096
    """

    def __init__(
        self, device: str | torch.device = "cpu", ended: Callable[[], bool] | None = None
    ) -> None:
        self.device = torch.device(device)
        self.why = ""  # why the last start or stop gave no figure ("" when it did)
        self._ended = ended
        self._prof: profile | None = None
        self._range: Any = None
        self._start = 0
        self._abandoned = False
        self._early: int | None = None  # the peak kept when a measure() stopped it
        self._marks: list[tuple[str, int]] = []  # on CUDA: each mark, the peak before it
        # the peak of each stretch between marks, named after the mark that starts it
        # ("start" for the first), from the last stop that gave a peak
        self.windows: tuple[tuple[str, int], ...] = ()

    @property
    def running(self) -> bool:
        """Whether :meth:`start` succeeded and :meth:`stop` was not called since."""
        return self._range is not None

    def start(self) -> bool:
        """Start measuring; False (and nothing started) when another measurement runs."""
        if self.running:
            return False
        if not _MEASURE_LOCK.acquire(blocking=False):
            self.why = "a measure() or another probe was running"
            return False
        self.why = ""
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else 0
            torch.cuda.synchronize(index)
            torch.cuda.reset_peak_memory_stats(index)
            self._start = torch.cuda.memory_allocated(index)
            self._range = index
            _PROBES.append(self)
            return True
        if torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled():
            _MEASURE_LOCK.release()
            self.why = "a profiler was running"
            return False
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        primer = torch.empty(1, dtype=torch.uint8)
        with _quiet_stderr():
            self._prof.start()
            del primer  # See _measure_cpu.
        self._range = record_function(_MARKER)
        self._range.__enter__()
        _PROBES.append(self)
        return True

    def mark(self, name: str) -> None:
        """Split the stretch measured here: :attr:`windows` gets the peak before and after
        this point separately (nothing when not running).

        On CPU a zero-length profiler range named ``ckpt_graph::mark::<name>`` marks the
        time; on CUDA the peak statistic so far is read and reset.
        """
        if not self.running:
            return
        if self.device.type == "cuda":
            index = self._range
            self._marks.append((name, int(torch.cuda.max_memory_allocated(index) - self._start)))
            torch.cuda.reset_peak_memory_stats(index)
            return
        with record_function(_MARK + name):
            pass

    def abandon(self) -> None:
        """Stop without a result (:func:`measure` was asked for while the probe ran, or the
        interpreter exits), unless the stretch had ended: its peak is then kept."""
        if not self.running:
            return
        if self._ended is not None and self._ended():
            self._early = self.stop()
            return
        self._abandoned = True
        self.stop()
        self.why = "a measure() started during the measured step"

    def stop(self) -> int | None:
        """The peak since :meth:`start` in bytes (None if not running, or if it was
        abandoned: ``why`` says why); after a :func:`measure` stopped an ended probe, the
        peak it kept (once)."""
        if not self.running:
            early, self._early = self._early, None
            return early
        abandoned, self._abandoned = self._abandoned, False
        self.windows = ()
        try:
            if self.device.type == "cuda":
                index = self._range
                torch.cuda.synchronize(index)
                last = int(torch.cuda.max_memory_allocated(index) - self._start)
                names = ["start"] + [n for n, _ in self._marks]
                peaks = [p for _, p in self._marks] + [last]
                self.windows = tuple(zip(names, peaks, strict=True))
                return max(peaks)
            # A profiler the program started meanwhile took the session over (torch keeps
            # one): if it has stopped, none is enabled now, and ours recorded nothing since.
            lost = not torch._C._autograd._profiler_enabled()
            self._range.__exit__(None, None, None)
            prof = self._prof
            assert prof is not None
            with _quiet_stderr():
                prof.stop()
            results = prof.profiler.kineto_results if prof.profiler is not None else None
            if lost:
                self.why = "a profiler the program started took over the measured step"
                return None
            if results is None or abandoned:
                return None
            try:
                marks: list[tuple[float, str]] = []
                report = _replay(results.experimental_event_tree(), marks)
                self.windows = _windows(report.timeline, marks)
                return report.peak_bytes
            except CkptGraphError:  # no events: another session took them
                self.why = "a profiler the program started took over the measured step"
                return None
        finally:
            self._range = None
            self._prof = None
            self._marks = []
            if self in _PROBES:
                _PROBES.remove(self)
            _MEASURE_LOCK.release()


def _windows(
    timeline: tuple[MemoryPoint, ...], marks: list[tuple[float, str]]
) -> tuple[tuple[str, int], ...]:
    """The peak level of each stretch of ``timeline`` between ``marks`` (time, name), named
    after the mark that starts it ("start" for the first). The level when a stretch starts
    counts in it: what was live then still is."""
    names = ["start"] + [n for _, n in marks]
    peaks = [0] * len(names)
    k = level = 0
    for p in timeline:
        while k < len(marks) and marks[k][0] <= p.time_us:
            k += 1
            peaks[k] = level
        level = p.allocated_bytes
        peaks[k] = max(peaks[k], level)
    while k < len(marks):
        k += 1
        peaks[k] = level
    return tuple(zip(names, peaks, strict=True))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silences file descriptor 2, where the profiler's C++ side prints start/stop lines."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _replay(roots: list[Any], marks: list[tuple[float, str]] | None = None) -> MemoryReport:
    """Replays the CPU allocation events inside the marker range. See Note [Measuring CPU memory].

    ``marks``, if given, gets the ``StepProbe.mark`` ranges inside it: (microseconds since
    the start, name), in time order.
    """
    found: list[tuple[int, str]] = []
    allocs: list[tuple[int, int, int, str]] = []  # (time_ns, ptr, signed size, op)
    ranges: list[tuple[int, int, Phase]] = []  # (start_ns, end_ns, phase)
    window: tuple[int, int] | None = None
    stack: list[tuple[Any, str]] = [(e, "") for e in reversed(roots)]
    allocation = torch._C._profiler._ExtraFields_Allocation
    cpu = torch.device("cpu")
    prefixes = tuple(prefix for prefix, _ in _PHASE_PREFIXES)
    while stack:
        event, op = stack.pop()
        fields = event.extra_fields
        if type(fields) is allocation:
            if fields.alloc_size != 0 and fields.device == cpu:
                allocs.append((event.start_time_ns, fields.ptr, fields.alloc_size, op))
            continue
        name: str = event.name
        if name.startswith(prefixes):
            kind = next(p for prefix, p in _PHASE_PREFIXES if name.startswith(prefix))
            ranges.append((event.start_time_ns, event.end_time_ns, kind))
        elif name == _MARKER and window is None:
            window = (event.start_time_ns, event.end_time_ns)
        elif name.startswith(_MARK):
            found.append((event.start_time_ns, name[len(_MARK) :]))
        if not op and name.startswith("aten::"):
            op = name
        # Pre-order, so that events with equal times keep their order through the stable sort.
        children = event.children
        if children:
            stack.extend((child, op) for child in reversed(children))
    if window is None:
        raise CkptGraphError("ckpt_graph: measure() found no events from the profiler")
    start_ns, end_ns = window
    if marks is not None:
        marks.extend(
            sorted(((t - start_ns) / 1000, n) for t, n in found if start_ns <= t <= end_ns)
        )
    allocs = sorted((a for a in allocs if start_ns <= a[0] <= end_ns), key=lambda a: a[0])
    ranges.sort()

    live: dict[int, int] = {}
    level = peak = 0
    points: list[MemoryPoint] = []
    active: list[tuple[int, int, Phase]] = []  # heap keyed on -start: innermost range on top
    next_range = 0
    for time_ns, ptr, size, op in allocs:
        if size > 0:
            level -= live.get(ptr, 0)  # a reused pointer whose free was not reported
            live[ptr] = size
        else:
            known = live.pop(ptr, None)
            if known is None:
                continue  # allocated before the call: ignored
            size = -known
        level += size
        peak = max(peak, level)
        while next_range < len(ranges) and ranges[next_range][0] <= time_ns:
            r_start, r_end, r_phase = ranges[next_range]
            heapq.heappush(active, (-r_start, r_end, r_phase))
            next_range += 1
        while active and active[0][1] < time_ns:
            heapq.heappop(active)
        phase: Phase = active[0][2] if active else "forward"
        points.append(MemoryPoint((time_ns - start_ns) / 1000, level, size, phase, op))
    return MemoryReport(peak, level, tuple(points), "cpu")
