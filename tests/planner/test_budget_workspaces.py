"""Byte budgets planned with the ops' measured workspaces (issue 22 §3).

Note [Workspaces in budget planning]: a byte budget's graph gets what each op's formulas
allocate beyond their results, measured once per op signature when the step is planned,
outside the step the measured check measures, and never for a fraction. The model is a
ConvNeXt-style stack in plain PyTorch, channels last: the backward of a depthwise 7x7
convolution allocates far more than its input to form its weight's gradient on CPU. The
budget is ``torch.utils.checkpoint`` per block's measured step peak, as a user asking for
"torch's memory" would give it; references are plain eager runs; ``flops_per_byte`` is
pinned.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ckpt_graph as cg
from ckpt_graph.memory import busy, measure
from ckpt_graph.planner import budget_planner, region_graph, workspaces
from ckpt_graph.planner.memory_budget import MemoryBudget, memory_budget

pytestmark = pytest.mark.usefixtures("one_thread")

FPB = 2.0
CHANNELS = 64
STEPS = 4  # record; first plan, measured; re-plan once if missed, measured; follow it
OVER = re.compile(r"the step measured [0-9.]+ MiB, [0-9.]+ MiB over the budget")
DEPTHWISE = "aten.convolution.default"


@pytest.fixture
def fresh_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workspaces not yet measured in this process (Note [Measuring op workspaces] rule 2)."""
    monkeypatch.setattr(workspaces, "MEASURED", {})


class Block(nn.Module):
    """Depthwise 7x7 convolution, batch norm, a 1x1 MLP in channels last with dropout,
    and a residual add."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.BatchNorm2d(c)
        self.pw1 = nn.Linear(c, 4 * c)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.pw2 = nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dw(x)).permute(0, 2, 3, 1)
        h = self.pw2(self.drop(self.act(self.pw1(h))))
        return x + h.permute(0, 3, 1, 2)


class Setup:
    """The model, its batch (channels last, requiring a gradient) and its first state."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(*[Block(CHANNELS) for _ in range(3)]).train()
        x = torch.randn(8, CHANNELS, 8, 8).contiguous(memory_format=torch.channels_last)
        self.x = x.requires_grad_()
        self.state = {k: v.clone() for k, v in self.model.state_dict().items()}

    def reset(self) -> None:
        self.model.load_state_dict(self.state)

    def step(self, forward: Callable[[], torch.Tensor]) -> None:
        for p in self.model.parameters():
            p.grad = None
        self.x.grad = None
        forward().sum().backward()

    def eager(self) -> torch.Tensor:
        return self.model(self.x)

    def per_block(self) -> torch.Tensor:
        h = self.x
        for block in self.model:
            h = checkpoint(block, h, use_reentrant=False)
        return h

    def region(self, policy: object) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            with cg.save_recompute_policy(policy):  # type: ignore[arg-type]
                return self.model(self.x)

        return forward

    def grads(self) -> list[torch.Tensor]:
        out = [p.grad.clone() for p in self.model.parameters() if p.grad is not None]
        assert self.x.grad is not None
        return [*out, self.x.grad.clone()]

    def buffers(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.model.buffers()]

    def torch_peak(self) -> int:
        """``torch.utils.checkpoint`` per block's measured step peak."""
        self.reset()
        self.step(self.per_block)
        self.reset()
        return measure(self.step, self.per_block).peak_bytes


def _planned(s: Setup, budget: int | float, **kw: Any) -> tuple[MemoryBudget, list[str]]:
    """A policy after ``STEPS`` steps from the first state, and what it warned."""
    s.reset()
    policy = memory_budget(budget, flops_per_byte=FPB, **kw)
    forward = s.region(policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            s.step(forward)
        policy.report()
    return policy, [str(w.message) for w in caught]


def _largest_workspace(policy: MemoryBudget) -> int:
    plan = policy.planner.plan(0)
    assert plan is not None and plan.graph is not None
    return max(op.workspace for op in plan.graph.g.ops)


def _without_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget planner as before: byte budgets planned without measured workspaces."""
    build = budget_planner.region_graph

    def unmeasured(
        region: Any, run: Any, costs: Any, workspaces: bool = False, param_grads: bool = True
    ) -> Any:
        return build(region, run, costs, False, param_grads)

    monkeypatch.setattr(budget_planner, "region_graph", unmeasured)


def test_byte_budget_is_missed_without_workspaces_and_met_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = Setup()
    budget = s.torch_peak()
    policy, said = _planned(s, budget)
    largest = _largest_workspace(policy)
    if largest <= s.x.nbytes:
        pytest.skip("this CPU backend's depthwise convolution backward allocates no workspace")
    s.reset()
    peak = measure(s.step, s.region(policy)).peak_bytes
    assert peak <= budget, (peak, budget)
    assert not said, said

    # Without them, a budget 10% above torch's is missed. (At torch's own, the step peaks
    # at the first block's convolution whatever the plan, 5 KB under the budget: the plans
    # the simulator picks without workspaces fit there too, now that it counts the
    # parameters' gradients; before, it kept the first convolution's output and missed.)
    above = budget * 11 // 10
    s.reset()
    policy, said = _planned(s, above)
    s.reset()
    peak = measure(s.step, s.region(policy)).peak_bytes
    assert peak <= above, (peak, above)
    assert not said, said
    _without_workspaces(monkeypatch)
    before, said_before = _planned(s, above)
    assert _largest_workspace(before) == 0
    s.reset()
    missed = measure(s.step, s.region(before)).peak_bytes
    assert missed > above, (missed, above)  # what the simulator did not see
    assert any(OVER.search(m) for m in said_before), said_before


def test_gradients_buffers_and_random_stream_are_those_of_eager(fresh_memo: None) -> None:
    s = Setup()
    budget = s.torch_peak()
    policy = memory_budget(budget, flops_per_byte=FPB)
    runs = []
    for forward in (s.eager, s.region(policy)):
        s.reset()
        torch.manual_seed(1)
        per_step = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(STEPS + 1):  # the workspaces are measured at the second's start
                s.step(forward)
                per_step.append((s.grads(), s.buffers(), torch.get_rng_state()))
        runs.append(per_step)
    assert _largest_workspace(policy) > 0
    eager, budgeted = runs
    for (grads, buffers, rng), (ref_grads, ref_buffers, ref_rng) in zip(
        budgeted, eager, strict=True
    ):
        torch.testing.assert_close(grads, ref_grads, rtol=0, atol=0)
        torch.testing.assert_close(buffers, ref_buffers, rtol=0, atol=0)
        assert torch.equal(rng, ref_rng)


def test_measuring_workspaces_touches_no_tensor_of_the_program(fresh_memo: None) -> None:
    s = Setup()
    s.step(s.eager)  # parameters with gradients, running statistics moved
    with cg.save_recompute_policy("recompute_all") as region:
        out = s.model(s.x)
    grads = {p: (p.grad, p.grad.clone()) for p in s.model.parameters() if p.grad is not None}
    buffers = s.buffers()
    params = [p.detach().clone() for p in s.model.parameters()]
    torch.manual_seed(3)
    rng = torch.get_rng_state()

    signatures = workspaces.OpSignatures(region)
    assert signatures.calls and signatures.known() is None
    measured = signatures.measure()

    assert measured is not None and max(w.backward for w in measured.values()) > 0
    assert torch.equal(torch.get_rng_state(), rng)
    torch.testing.assert_close(s.buffers(), buffers, rtol=0, atol=0)
    torch.testing.assert_close([p.detach() for p in s.model.parameters()], params, rtol=0, atol=0)
    for p, (grad, copy) in grads.items():
        assert p.grad is grad  # the same tensor, not accumulated into
        torch.testing.assert_close(grad, copy, rtol=0, atol=0)
    assert not signatures.calls and signatures.known() == measured
    del out


def test_the_checked_step_is_measured_without_workspace_measurements(
    fresh_memo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Setup()
    budget = s.torch_peak()
    policies: list[MemoryBudget] = []
    when: list[tuple[bool, bool]] = []  # (a measurement ran, the check's step ran) per call

    def watched(*args: Any, **kwargs: Any) -> Any:
        when.append((busy(), any(p.planner.check.measuring for p in policies)))
        return measure(*args, **kwargs)

    monkeypatch.setattr(workspaces, "measure", watched)
    s.reset()
    policy = memory_budget(budget, flops_per_byte=FPB)
    policies.append(policy)
    forward = s.region(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(STEPS):
            s.step(forward)
    assert when and not any(a or b for a, b in when), when
    checked = policy.planner.check.last
    assert checked is not None  # the probe was not abandoned
    s.reset()
    assert measure(s.step, forward).peak_bytes == checked.measured_bytes

    # A second policy on the same model: every signature is known, nothing is measured.
    n = len(when)
    again, _ = _planned(s, budget)
    assert len(when) == n
    assert _largest_workspace(again) == _largest_workspace(policy)


def test_a_step_planned_inside_a_measurement_gets_its_workspaces_at_the_next(
    fresh_memo: None,
) -> None:
    s = Setup()
    budget = s.torch_peak()
    s.reset()
    policy = memory_budget(budget, flops_per_byte=FPB)
    forward = s.region(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # recorded, then planned while the program measures its step
            measure(s.step, forward)
        first = policy.planner.plan(0)
        assert first is not None and first.graph is not None
        assert first.graph.unmeasured is not None and _largest_workspace(policy) == 0
        s.step(forward)  # planned again at its start, with the workspaces
    assert first.graph.unmeasured is None
    assert policy.planner.plan(0) is not first and _largest_workspace(policy) > 0


# a fraction measured (check=True) is of the measured step: its graphs have the workspaces,
# as a byte budget's (Note [Measured budget check] rule 4)
@pytest.mark.parametrize("check", ["auto", False])
def test_fraction_budgets_measure_no_workspace(
    fresh_memo: None, monkeypatch: pytest.MonkeyPatch, check: bool | str
) -> None:
    def refused(region: Any) -> Any:
        raise AssertionError("a fraction's graph read the op signatures")

    monkeypatch.setattr(region_graph, "OpSignatures", refused)
    s = Setup()
    policy, _ = _planned(s, 0.5, check=check)
    assert _largest_workspace(policy) == 0
    assert workspaces.MEASURED == {}
