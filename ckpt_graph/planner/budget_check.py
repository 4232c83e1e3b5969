"""A budget checked against measurement: the closed loop of ``memory_budget``.

# Note [Measured budget check]
# The planner predicts a step's peak from its regions' graphs (Note [Step budget across
# regions]); what the step measures also holds memory no region records: parameters'
# gradients, the loss and head outside the regions, the optimizer, the simulator's error.
# On an MLP ``memory_budget("8MiB")`` predicted 8.000 MiB, measured 22.1 MiB, and said
# nothing. So a budget in bytes is a promise about the *measured* step peak, and the
# check is on by default (``check="auto"``):
# 1. The first step that follows a plan is measured (``memory.StepProbe``: the allocator's
#    events on CPU, ``torch.cuda.max_memory_allocated`` on CUDA) from its first region's
#    entry until the policy next gets control after the step ended: the next region
#    entered (a ``no_grad`` one too), ``report()``, or a ``measure()`` of the program (it
#    keeps the probe's figure rather than abandoning it once the step has ended), plus
#    the activation inputs of that first region (allocated before it). (Stopping the
#    profiler from an autograd callback at the end of the backward pass left it enabled
#    on the calling thread.) A probe still running when the interpreter exits is stopped
#    then. A step that left its plans (the heuristic decided part of it) is not compared.
# 2. The difference between the measured peak and the prediction of what the budget bounds
#    (the step's predicted peak; one region: its peak with gradient buffers, the
#    parameters' gradients the step makes included: Note [Parameters' gradients in
#    backward]) is memory outside the plan's model. If the measured peak is over a byte
#    budget, that difference is taken off the budget the planner works with, the step is
#    planned again once, and the next planned step is measured too. The difference is
#    measured per phase of the step, the loss's backward outside the regions apart (Note
#    [Phases of a measured step]); one constant only when the phases cannot be told apart.
# 3. If that step is still over the budget, the policy warns once: by how much, what the
#    plan predicted, what it cannot decide (values kept whatever the plan: tags, other
#    policies, activation inputs; generator states), the parameters' gradients the step
#    made (in the prediction since they are modelled), what lies outside its model (memory
#    outside the regions and the simulator's error), and
#    whether the plan is the lowest-peak one the planner found. The re-plan's own "no
#    plan found" (a prediction with the correction) waits for the next step and is given
#    only if that step cannot be measured: a measured step settles it (within the
#    budget: no warning), so a budget the correction puts out of reach warns once. A
#    first plan that does not fit even the planner's model warns at once, as without
#    the check (the measured verdict follows, with its figures).
# 4. Fractions. A fraction budget is of the step's peak without checkpointing (Note
#    [Step budget across regions] rule 1). ``"auto"`` and ``False`` do not measure it: it
#    is of the simulated peak, which leaves out the memory outside the regions (the
#    default zoo's fraction rows are of that figure). ``True`` measures it: the first
#    planned step learns the two terms of Note [Phases of a measured step] whether or not
#    it missed (``BudgetCheck.learn``), and the reference becomes what no checkpointing
#    would measure with them, ``max(P0 + D, Q0 + B)`` = ``D + max(P0, Q0 + (B - D))``,
#    where P0 and Q0 are the simulated peak and boundary of keeping every candidate
#    (``step_budget.reference_bytes``): the outside memory D throughout the step, the
#    loss's backward B on top of every value no checkpointing keeps at the boundary. The
#    budget is the fraction of that; the step that learnt them is compared with it, and
#    planned again once with both terms (rule 2) if it missed, as a byte budget is. The
#    reports give both references and the re-plan (Note [Budget reports]). Measured
#    (tests/planner/test_budget_fraction_measured.py: MLP blocks, the cross-entropy's
#    6 MiB outside the region): the corrected reference is no checkpointing's measured
#    step peak to the byte (21.30 MiB; simulated 17.67); at 0.4 / 0.5 the first plans
#    measured 0.49x / 0.58x of it and the re-plans 0.40x / 0.49x. The same terms are
#    assumed for the step without checkpointing: its own simulator error and a loss
#    whose buffers depend on the plan are not measured (no step runs without the plan).
#    A measured fraction's graphs count the parameters' gradients and the ops' workspaces,
#    as a byte budget's (Note [Parameters' gradients in backward] rule 5): left out, the
#    gradients came into D as a constant over the step, and on the test suite's tiny GPT
#    (three wrapped blocks, the gradients a third of the step) the re-plan at 0.5
#    measured 1.125 MiB, 0.119 over; modelled, the planner says at once that no plan
#    reaches 0.5 and its lowest-peak plan measures 0.966 MiB.
# 5. When. ``"auto"`` measures a byte budget when it can: not while a profiler or a
#    ``measure()`` runs at the step's start, nor on a device other than CPU and CUDA;
#    ``report()`` then says why, and the next planned step tries again (``_TRIES``
#    probes per policy). A profiler the program starts while a probe runs takes the
#    session over (torch keeps one per process): the probe gives no figure and says so;
#    a program's profiler stopped before the policy's next region gets its events.
#    ``False`` never measures: the budget then
#    bounds the plan's model only (the step's regions, activations and their gradients).
#    ``MemoryBudget.checking`` says whether the check still wants steps: a harness that
#    measures or times steps (``compare``'s runner) runs them first.
# 6. Reports. ``report()`` and ``step_report()`` show the measured peak and what the check
#    did (within the budget; over it and planned again; over after the re-plan, warned)
#    or why no step was measured; a plan predicted to fit a byte budget whose step
#    measured over it is not said to "fit" (Note [Budget reports]).
# 7. Cost. On CPU a measured step runs under the profiler with memory events, once, or
#    twice after a re-plan, per policy, at the second and third steps of training: its
#    CPU time is 1.19-1.30x the same step unmeasured on the zoo's GPT-2, ConvNeXt, ResNet
#    and loop model (``benchmarks/bench_budget_check.py``, side by side). On CUDA it
#    synchronizes twice and resets the process's peak statistic.
# Known limitations: a program that measures every step itself (a profiler or
# ``measure()`` running at each step's start) is not checked. A profiler the program starts
# inside a probed step and keeps running past the policy's next region entry loses its
# events: the probe's stop ends the one session torch keeps, and no public torch API tells
# the two sessions apart (a profiling schedule whose recording starts at the second or third
# step of a policy's life; ``check=False`` avoids it). A probe runs until the policy
# next gets control after its step: work after the step outside any region (a long
# evaluation without regions) runs under the profiler until then. On CUDA a program reading
# ``torch.cuda.max_memory_allocated`` over the first steps sees it reset.

# Note [Phases of a measured step]
# 1. Why. Memory outside the regions is not one constant over a step. A loss (and a head)
#    computed after the regions runs its backward after their forward and before their
#    backward: on top of every value they keep and every activation input. Their own
#    backward then runs with the loss's buffers freed. BERT at torch per-block
#    checkpointing's peak (bench_zoo): predicted 22.64 MiB, measured 28.13 MiB, the peak in
#    ``_log_softmax_backward_data`` on 20.1 MiB of kept values plus 8 MiB of the loss's
#    gradients. Taken off the budget as one 5.49 MiB constant, the difference tightened the
#    regions' backward too, which did not need it, and the re-plan could only take the
#    lowest-peak plan: 1.96x torch's recomputed FLOPs.
# 2. Marks. While a step is measured, ``memory.StepProbe.mark`` splits it: at each region's
#    exit ("exit"), and at the first backward op of a region ("backward": at its exit, a
#    prehook on the autograd node of every live output of the region's ops; the first to
#    run marks, all are removed when the probe stops). The *boundary* stretch runs from the
#    last exit before the backward mark to it (the head and the loss, forward and backward);
#    the *rest* is the other stretches (the regions' forwards and backwards). On CPU the
#    marks are zero-length profiler ranges replayed with the allocator's events; on CUDA a
#    mark reads ``max_memory_allocated`` and resets it (host-side counters: no sync).
# 3. Terms. The plan predicts the step's peak P (Note [Step budget across regions] rule 1;
#    one region: its simulated peak with gradients) and what it holds at the boundary, Q:
#    the regions' kept values and activation inputs (``StepPlan.predicted_boundary_bytes``;
#    one region ``SimResult.kept_bytes`` plus its inputs). From the measured step:
#    ``B = boundary - Q`` (the loss's buffers and whatever else lives then) and
#    ``D = max(rest - P, 0)`` (outside memory in the rest, with the simulator's error;
#    its over-predictions are not learnt). A missed budget is planned again with every
#    term of the step's model within ``budget - D`` (``BudgetCheck.correction``, as rule 2
#    of Note [Measured budget check]) and with ``Q + B`` within the budget: the boundary
#    term ``B - D`` (``BudgetCheck.before_backward``) on top of the kept values within the
#    same ``budget - D``. One region: ``SimGraph.before_backward_bytes`` makes the simulator
#    add that point when backward starts (``liveness.simulate``), so every solver sees it;
#    several regions: the DP's last prefix plus the term (Note [Step budget across regions]
#    rule 6). Q changes with the plan, B does not: the loss's buffers are the loss's.
#    A fraction measured (``check=True``) learns both terms at its first measured step
#    and its reference with them (Note [Measured budget check] rule 4).
# 4. No backward mark (the probe was stopped before a region's backward ran, or no output
#    of a region was alive at its exit): one constant for the step, as before.
# 5. Without a measurement (``check=False``, a fraction with ``"auto"``) there is no
#    term: the loss's ops are outside every region, so none is recorded, and CPU has no
#    allocator statistic outside the profiler. The one figure known before backward, the gradients of the
#    regions' outputs, is a lower bound, not an estimate (on
#    tests/planner/test_budget_loss_outside.py's model 4 of the 12 MiB the cross-entropy's
#    backward holds: its saved log-softmax, its input gradient and the logits' gradient):
#    that case stays a strict xfail; the loss inside the region is planned exactly.
# Measured (tests/planner/test_budget_loss_outside.py: one region, a vocabulary head, the
# loss outside, at torch per block's peak of 13.26 MB): the first planned step measured
# 17.97 MB, 12 MiB of it the cross-entropy's buffers at the boundary; the re-plan measured
# 13.24 MB (predicted within 8 bytes). With a 32768-row input table, whose gradient sets
# the region's backward peak whatever the plan, one constant left only the lowest-peak
# plan (1.25x the loss-inside plan's recomputed FLOPs); the two terms give that plan's.
# Known limitations: memory outside the regions during their forward is folded into D;
# the terms are learnt from one step and held for the policy's life (a loss that changes
# size later is not followed); a step whose regions' backwards start, stop and start again
# (a second loss computed inside a backward hook) is split at the first.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ckpt_graph.memory import StepProbe
from ckpt_graph.planner.records import Seen

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["BudgetCheck", "Check", "Measured"]

Check = bool | Literal["auto"]  # ``memory_budget(check=...)``: See Note [Measured budget check].

_MIB = float(2**20)


def _mib(n: int) -> str:
    return f"{n / _MIB:.3f} MiB"


_CHECKS = 2  # measured steps per policy: the first planned one, and one after a re-plan
_TRIES = 4  # probes started per policy (a measure() of the program abandons one)


@dataclass(frozen=True)
class Measured:
    """One measured step against its prediction. See Note [Measured budget check].

    Attributes:
        measured_bytes: the step's measured peak (rule 1).
        predicted_bytes: what the plan predicted for what the budget bounds.
        param_grad_bytes: gradients of the parameters the step's regions read that the step
            made (``.grad`` was ``None`` at the region's exit): in the prediction.
        kept_bytes: values kept whatever the plan (tags, other policies, activation inputs).
        rng_bytes: generator states random ops hold.
        boundary_bytes: the measured peak from the last region's exit to the first backward
            op of a region (the loss and head, forward and backward, outside the regions),
            or None when the probe saw no such op (Note [Phases of a measured step]).
        predicted_boundary_bytes: what the plan holds at that point: the regions' kept
            values and activation inputs.
        rest_bytes: the measured peak of the rest of the step (the regions' forward and
            backward), the whole step's when ``boundary_bytes`` is None.
    """

    measured_bytes: int
    predicted_bytes: int
    param_grad_bytes: int
    kept_bytes: int
    rng_bytes: int
    boundary_bytes: int | None = None
    predicted_boundary_bytes: int = 0
    rest_bytes: int = 0

    @property
    def outside_bytes(self) -> int:
        """Measured less predicted: memory outside the plan's model (rule 2)."""
        return self.measured_bytes - self.predicted_bytes

    @property
    def before_backward_bytes(self) -> int | None:
        """Measured at the boundary less the plan's kept values there: the loss's backward
        outside the regions and what else lives then (Note [Phases of a measured step])."""
        if self.boundary_bytes is None:
            return None
        return self.boundary_bytes - self.predicted_boundary_bytes

    @property
    def rest_outside_bytes(self) -> int:
        """Measured less predicted for the rest of the step (Note [Phases of a measured
        step])."""
        return self.rest_bytes - self.predicted_bytes


class BudgetCheck:
    """State of the closed loop of one policy object. See Note [Measured budget check]."""

    def __init__(self, mode: Check = "auto", fraction: bool = False) -> None:
        # "auto" measures byte budgets only: an unmeasured fraction is of the simulated
        # peak (rule 4)
        self.mode: Check = mode
        self.on = mode is True or (mode == "auto" and not fraction)
        self.correction = 0  # bytes taken off a byte budget (rule 2)
        # bytes the outside memory before the regions' backward lies above the correction
        # (Note [Phases of a measured step]); None: not measured apart
        self.before_backward: int | None = None
        self.learnt = False  # the two terms above are set (a miss; a fraction: measured)
        self.corrected = False  # a miss planned the step again
        self.last: Measured | None = None
        self.why = ""  # why no step was measured (rule 5)
        self._probe: StepProbe | None = None
        self._predicted = 0
        self._checks = 0
        self._tries = 0
        self._peak: int | None = None
        self._warned = False
        self._device = torch.device("cpu")
        self._params: set[int] = set()
        self._param_bytes = 0
        self._boundary = 0  # the plan's predicted boundary (Note [Phases of a measured step])
        self._windows: tuple[tuple[str, int], ...] = ()
        self._hooks: list[Any] = []  # prehooks marking the regions' first backward op
        self._marked = False

    def note_region(self, region: Region) -> None:
        """At a region's exit: its device and the parameters (leaves needing a gradient);
        while a step is measured, the exit is marked and so will be the first backward op of
        the region (Note [Phases of a measured step])."""
        # Bookkeeping, not the program: user modes (a DebugMode that prints every storage it
        # sees) must not see these tensor calls. See Note [Tools outside a region].
        with torch._C.DisableTorchFunction():
            self._note_inputs(region)
            probe = self._probe
            if probe is not None and not self._marked:
                state = region.recording
                recording, state.on = state.on, False  # the mark: not the region's ops
                try:
                    probe.mark("exit")
                finally:
                    state.on = recording
                self._hook_backward(region, probe)

    def _hook_backward(self, region: Region, probe: StepProbe) -> None:
        """A prehook on the autograd node of each live output of ``region``'s ops: the first
        to run marks the probe (the regions' backward starts there)."""
        ref = weakref.ref(self)

        def first(*_: object) -> None:
            check = ref()
            if check is not None and not check._marked and check._probe is probe:
                check._marked = True
                probe.mark("backward")

        nodes: dict[int, Any] = {}
        for node in region.nodes:
            for h in node.outputs:
                t = h.ref() if h is not None and h.ref is not None else None
                if t is None or not t.requires_grad:
                    continue
                try:  # a view whose base was written since raises (issue 21 item 2)
                    fn = t.grad_fn
                except RuntimeError:
                    continue
                if fn is not None:
                    nodes.setdefault(id(fn), fn)
        self._hooks += [fn.register_prehook(first) for fn in nodes.values()]

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _note_inputs(self, region: Region) -> None:
        for h in region.inputs:
            t = h.ref() if h.ref is not None else None
            if t is None:
                continue
            self._device = t.device
            # a leaf needing a gradient; a view's grad_fn is not read (it raises for an
            # unbind output whose base was written since: issue 21 item 2)
            if t.requires_grad and not t._is_view() and t.grad_fn is None:
                try:
                    key = t.untyped_storage().data_ptr()
                except (RuntimeError, NotImplementedError):
                    continue
                if key not in self._params and t.grad is None:
                    self._params.add(key)
                    self._param_bytes += t.untyped_storage().nbytes()

    def start(self, predicted: int | None, ended: Callable[[], bool], boundary: int = 0) -> None:
        """Measure the step starting now, predicted at ``predicted`` bytes (rule 1), at
        ``boundary`` bytes when the regions' backward starts (Note [Phases of a measured
        step]); ``ended()`` says whether that step is over (a ``measure()`` of the program
        after it then keeps the probe's figure)."""
        self._params, self._param_bytes = set(), 0
        if not self.on or predicted is None or self._checks >= _CHECKS:
            return
        if self._probe is not None:
            return
        if self._tries >= _TRIES:  # the program measures its steps itself (rule 5)
            self.why = f"{_TRIES} steps could not be measured; the policy stopped trying"
            return
        self._tries += 1
        if self._device.type not in ("cpu", "cuda"):
            self.why = f"memory on {self._device.type} cannot be measured"
            return
        probe = StepProbe(self._device, ended)
        if probe.start():
            self._probe = probe
            self._predicted = predicted
            self._boundary = boundary
            self._marked = False
            self._peak = None
            weakref.finalize(self, probe.abandon)  # the policy dropped: the profiler too
        else:
            self.why = probe.why

    @property
    def pending(self) -> bool:
        """Whether the check still wants steps: a probe runs, or a planned step is still
        to be measured (rule 1; at most ``_CHECKS`` measured and ``_TRIES`` tried)."""
        if not self.on:
            return False
        return self._probe is not None or (self._checks < _CHECKS and self._tries < _TRIES)

    @property
    def measuring(self) -> bool:
        """Whether a probe is running (or holds a figure not yet compared)."""
        return self._probe is not None

    def finish(self) -> None:
        """Stop the measurement now and keep its peak for :meth:`stop`."""
        probe, self._probe = self._probe, None
        self._unhook()
        if probe is not None:
            self._peak = probe.stop()
            self._windows = probe.windows
            if self._peak is None:
                self.why = probe.why or "the measured step was abandoned"

    def stop(self, seen: list[Seen], followed: bool) -> Measured | None:
        """The measurement of the step that just ended, if one ran and it followed its plans."""
        self.finish()
        peak, self._peak = self._peak, None
        if peak is None or not seen:
            return None
        if not followed:
            self.why = "the measured step left its plans (its graph changed)"
            return None
        self.why = ""
        self._checks += 1
        first = min(seen, key=lambda s: s.ordinal)
        kept = rng = 0
        for s in seen:
            g = s.graph.g
            kept += s.inputs + sum(
                g.values[v].nbytes
                for v in g.fixed
                if g.values[v].storage == v and g.values[v].producer >= 0
            )
            rng += sum(g.rng_bytes)
        boundary, rest = _phases(self._windows, peak)
        self.last = Measured(
            peak + first.inputs,
            self._predicted,
            self._param_bytes,
            kept,
            rng,
            None if boundary is None else boundary + first.inputs,
            self._boundary,
            rest + first.inputs,
        )
        return self.last

    def status(self, budget: int | None) -> str:
        """What the check measured and did, for the reports (rule 6); ``budget``: a byte
        budget, or a measured fraction's of its corrected reference; None for a fraction
        not measured."""
        m = self.last
        if m is None:
            if not self.on:
                if self.mode is False:
                    return "not measured (check=False)"
                return "not measured: a fraction is of the simulated peak (check=True measures it)"
            if self._probe is not None:
                return "not measured yet: the step running now is measured"
            if self.why:
                return f"not measured: {self.why}"
            return "not measured yet: the first step that follows a plan is"
        if budget is None:
            return "measured"
        over = m.measured_bytes - budget
        if over <= 0:
            return f"within the budget, {_mib(-over)} below it"
        text = f"{_mib(over)} over the budget"
        if self._warned:
            return text + " after one re-plan (warned)"
        text += f": planned again with {_mib(self.correction)} taken off"
        if self.before_backward is not None:
            text += (
                f" and {_mib(self.correction + self.before_backward)} measured outside the "
                "regions on top of their kept values before their backward"
            )
        if self._probe is not None:
            return text + "; the step running now is measured"
        if self.why:
            return text + f"; the re-planned step was not measured: {self.why}"
        return text

    def over(self, m: Measured, budget: int) -> bool:
        """Whether ``m`` missed ``budget``; the first miss sets the correction (rule 2)."""
        if m.measured_bytes <= budget:
            self._checks = _CHECKS  # met: nothing more to check
            return False
        if self.corrected:
            return False
        self.corrected = True
        if not self.learnt:
            self.learn(m)
        return True

    def learn(self, m: Measured) -> None:
        """Set the correction and the boundary term from ``m`` (rule 2; Note [Phases of a
        measured step]): at a byte budget's first miss, at a fraction's first measured step
        (rule 4: its reference needs them whether or not the step missed)."""
        self.learnt = True
        before = m.before_backward_bytes
        if before is None:  # one term for the whole step (rule 2)
            self.correction = max(m.outside_bytes, 0)
            return
        # See Note [Phases of a measured step].
        self.correction = max(m.rest_outside_bytes, 0)
        self.before_backward = max(before - self.correction, 0)

    def warn(self, name: str, m: Measured, budget: int, lowest: bool) -> None:
        """Warn once that ``budget`` is missed, and why (rule 3); ``lowest``: the plan is
        the lowest-peak one found (the budget is out of the planner's reach)."""
        if self._warned or m.measured_bytes <= budget:
            return
        self._warned = True
        self._checks = _CHECKS
        warnings.warn(
            f"ckpt_graph: {name}: the step measured {m.measured_bytes / _MIB:.3f} MiB, "
            f"{(m.measured_bytes - budget) / _MIB:.3f} MiB over the budget of "
            f"{budget / _MIB:.3f} MiB after one re-plan. The plan predicted "
            f"{m.predicted_bytes / _MIB:.3f} MiB for its regions, of which "
            f"{m.kept_bytes / _MIB:.3f} MiB are values kept whatever the plan (tags, other "
            f"policies, activation inputs), {m.rng_bytes / _MIB:.3f} MiB generator "
            f"states and parameters' gradients {m.param_grad_bytes / _MIB:.3f} MiB made by "
            f"the step; {m.outside_bytes / _MIB:.3f} MiB are outside its model: memory "
            "outside the regions (and the simulator's error)"
            + (", and the plan is the lowest-peak one the planner found" if lowest else "")
            + " (warned once per policy)",
            stacklevel=4,
        )


def _phases(windows: tuple[tuple[str, int], ...], peak: int) -> tuple[int | None, int]:
    """The probe's peak from the last region exit to the first backward op of a region, and
    the peak of the rest of the step (Note [Phases of a measured step]); (None, ``peak``)
    when no backward op was marked."""
    names = [n for n, _ in windows]
    if "backward" not in names:
        return None, peak
    b = names.index("backward")
    exits = [k for k in range(b) if names[k] == "exit"]
    e = exits[-1] if exits else 0
    peaks = [p for _, p in windows]
    return max(peaks[e:b]), max(peaks[:e] + peaks[b:])
