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
#    backward]) is memory outside the plan's model. If the measured peak is over a byte budget, that difference
#    is taken off the budget the planner works with, the step is planned again once, and
#    the next planned step is measured too.
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
# 4. A fraction budget is relative to the step's own simulated peak without
#    checkpointing: it is not corrected, and ``"auto"`` does not measure it (``True``
#    does, for the report).
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
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

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
    """

    measured_bytes: int
    predicted_bytes: int
    param_grad_bytes: int
    kept_bytes: int
    rng_bytes: int

    @property
    def outside_bytes(self) -> int:
        """Measured less predicted: memory outside the plan's model (rule 2)."""
        return self.measured_bytes - self.predicted_bytes


class BudgetCheck:
    """State of the closed loop of one policy object. See Note [Measured budget check]."""

    def __init__(self, mode: Check = "auto", fraction: bool = False) -> None:
        # "auto" measures byte budgets only: a fraction is of the simulated peak (rule 4)
        self.mode: Check = mode
        self.on = mode is True or (mode == "auto" and not fraction)
        self.correction = 0  # bytes taken off a byte budget (rule 2)
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

    def note_region(self, region: Region) -> None:
        """At a region's exit: its device and the parameters (leaves needing a gradient)."""
        # Bookkeeping, not the program: user modes (a DebugMode that prints every storage it
        # sees) must not see these tensor calls. See Note [Tools outside a region].
        with torch._C.DisableTorchFunction():
            self._note_inputs(region)

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

    def start(self, predicted: int | None, ended: Callable[[], bool]) -> None:
        """Measure the step starting now, predicted at ``predicted`` bytes (rule 1);
        ``ended()`` says whether that step is over (a ``measure()`` of the program after
        it then keeps the probe's figure)."""
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
        if probe is not None:
            self._peak = probe.stop()
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
        self.last = Measured(peak + first.inputs, self._predicted, self._param_bytes, kept, rng)
        return self.last

    def status(self, budget: int | None) -> str:
        """What the check measured and did, for the reports (rule 6); ``budget``: a byte
        budget, None for a fraction."""
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
            return "measured (a fraction is not corrected)"
        over = m.measured_bytes - budget
        if over <= 0:
            return f"within the budget, {_mib(-over)} below it"
        text = f"{_mib(over)} over the budget"
        if self._warned:
            return text + " after one re-plan (warned)"
        text += f": planned again with {_mib(self.correction)} taken off"
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
        if self.correction == 0:
            self.correction = max(m.outside_bytes, 1)
            return True
        return False

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
