"""memory_budget with changing shapes: plans apply across sizes (issue 14 item 14).

See Note [Plans across sizes] in ckpt_graph/planner/across_sizes.py. The step-time ratio is
measured in benchmarks/bench_budget_shapes.py, not here. Int budgets here bound the simulated
peak (``check=False``): the measured check of Note [Measured budget check] would plan once more.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ckpt_graph as cg
from ckpt_graph.compare.architectures import GPT
from ckpt_graph.memory import measure
from ckpt_graph.planner import budget_planner, local_search, menus, seeds
from ckpt_graph.planner.budget_planner import BudgetPlanner
from ckpt_graph.planner.from_region import from_region, kept_ops_of
from ckpt_graph.planner.liveness import simulate
from ckpt_graph.planner.local_search import Refinement
from ckpt_graph.planner.memory_budget import MemoryBudget, StepPlan, memory_budget
from ckpt_graph.planner.solve import solve_from

VOCAB, WIDTH, LAYERS, HEADS, MAX_SEQ = 64, 32, 2, 2, 48


@pytest.fixture
def plans_made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the regions recorded for a new plan (one entry per ``BudgetPlanner.graph`` call:
    a region no plan matched, whose step the solver plans again)."""
    made: list[int] = []
    graph = BudgetPlanner.graph

    def counting(self: BudgetPlanner, region: cg.Region, run: object) -> object:
        made.append(len(region.nodes))
        return graph(self, region, run)  # type: ignore[arg-type]

    monkeypatch.setattr(BudgetPlanner, "graph", counting)
    yield made


def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(VOCAB, WIDTH, LAYERS, HEADS, MAX_SEQ).train()
    for p in m.parameters():
        p.grad = torch.zeros_like(p)  # accumulated in place: gradients add no peak
    return m


class Step:
    """One training step of ``gpt`` on ``x``, with or without a policy."""

    def __init__(self, gpt: GPT) -> None:
        self.gpt = gpt
        self.region: cg.Region | None = None

    def __call__(self, x: torch.Tensor, policy: MemoryBudget | None) -> None:
        for p in self.gpt.parameters():
            p.grad.zero_()  # type: ignore[union-attr]
        if policy is None:
            y = self.gpt(x)
        else:
            with cg.save_recompute_policy(policy) as self.region:
                y = self.gpt(x)
        y.pow(2).mean().backward()

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.gpt.parameters()]  # type: ignore[union-attr]


def batch(b: int, s: int) -> torch.Tensor:
    torch.manual_seed(b * 1000 + s)
    return torch.randint(0, VOCAB, (b, s))


@pytest.mark.slow  # run by .ci/run after the README's test command (issue 21 item 14)
def test_fraction_budget_applies_its_plan_to_unseen_sizes(plans_made: list[int]) -> None:
    step = Step(model())
    policy = memory_budget(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(batch(4, 16), policy)  # plans
    assert len(plans_made) == 1
    planned = policy.report()
    assert planned is not None and step.region is not None
    ratio = planned.budget_bytes / from_region(step.region).saved_bytes()
    for b, s in [(2, 16), (4, 24), (6, 40), (3, 8), (6, 40)]:
        x = batch(b, s)
        plain = measure(step, x, None).peak_bytes
        expected = step.grads()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # same ops, other sizes: no warning
            peak = measure(step, x, policy).peak_bytes
        torch.testing.assert_close(step.grads(), expected, rtol=0, atol=0)
        assert len(plans_made) == 1, f"re-planned for batch {b}x{s}"
        assert step.region is not None
        g = from_region(step.region)
        report = policy.report()
        assert report is not None
        budget = report.budget_bytes  # the fraction scales with the shapes
        assert budget / g.saved_bytes() == pytest.approx(ratio, rel=1e-3)
        assert simulate(g, kept_ops_of(step.region)).peak_bytes <= 1.03 * budget
        if b * s >= 4 * 16:  # measured; see test_budget.py for the same accounting
            others = plain - g.saved_bytes()
            assert peak - others <= 1.03 * budget
    report = policy.report()
    assert report is not None and report.reuses == 5


@pytest.mark.slow  # run by .ci/run after the README's test command (issue 21 item 14)
def test_int_budget_plans_again_only_for_a_new_largest_size(plans_made: list[int]) -> None:
    step = Step(model())
    budget = 240_000
    policy = memory_budget(budget, check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(batch(4, 16), policy)
    assert len(plans_made) == 1
    expected_plans = {(2, 16): 1, (3, 8): 1, (4, 24): 2, (2, 24): 2, (4, 16): 2, (3, 20): 2}
    for (b, s), plans in expected_plans.items():
        x = batch(b, s)
        step(x, None)
        expected = step.grads()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(x, policy)
        torch.testing.assert_close(step.grads(), expected, rtol=0, atol=0)
        assert len(plans_made) == plans, f"batch {b}x{s}"
        assert step.region is not None
        if (b, s) != (4, 24):  # that step ran on the heuristic, and was planned at its exit
            peak = simulate(from_region(step.region), kept_ops_of(step.region)).peak_bytes
            assert peak <= budget


def test_a_structural_change_still_warns_and_plans_again(plans_made: list[int]) -> None:
    step = Step(model())
    policy = memory_budget(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(batch(4, 16), policy)
    step.gpt.blocks = step.gpt.blocks[:1]  # one block fewer: other ops, not other sizes
    with pytest.warns(UserWarning, match="differs from the planned one"):
        step(batch(4, 16), policy)
    assert len(plans_made) == 2


@pytest.fixture
def solver_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the policy's full solver runs (``solve``) and warm starts (``solve_from``)."""
    calls: Counter[str] = Counter()

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for module in (budget_planner, menus):
        monkeypatch.setattr(module, "solve", counting("solve", module.solve))
    monkeypatch.setattr(budget_planner, "solve_from", counting("solve_from", solve_from))
    return calls


@pytest.mark.slow  # run by .ci/run after the README's test command (issue 21 item 14)
def test_int_budget_at_a_new_largest_size_starts_from_the_smaller_plan(
    solver_calls: Counter[str],
) -> None:
    # Before: each new largest size was planned from scratch (about 20x a planned step in
    # benchmarks/bench_budget_shapes.py); see Note [Warm start at a new size].
    step = Step(model())
    budget = 400_000
    policy = memory_budget(budget, flops_per_byte=2.0, check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(batch(4, 16), policy)
    assert policy.report() is not None
    assert solver_calls == {"solve": 1}
    warm = 0
    for b, s in [(4, 24), (5, 24), (6, 24)]:  # each larger than every size before
        x = batch(b, s)
        plain = measure(step, x, None).peak_bytes
        expected = step.grads()
        for planned in (False, True):  # the step that grows, then the one with its plan
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # same ops, other sizes: no warning
                peak = measure(step, x, policy).peak_bytes
            torch.testing.assert_close(step.grads(), expected, rtol=0, atol=0)
            if not planned:
                report = policy.report()  # plans the step that grew
                warm += 1
                assert solver_calls == {"solve": 1, "solve_from": warm}, (b, s, report)
                assert report is not None and report.method == "warm start"
                assert report.feasible and report.predicted_total_peak_bytes <= budget
        assert step.region is not None
        g = from_region(step.region)
        assert simulate(g, kept_ops_of(step.region)).peak_bytes <= budget
        others = plain - g.saved_bytes()  # measured; see test_budget.py
        assert peak - others <= 1.03 * budget, (b, s, peak - others)


def test_per_block_regions_at_a_new_largest_size_reuse_the_smaller_menus(
    solver_calls: Counter[str],
) -> None:
    gpt = model()
    # for the step's LAYERS regions together, gradients of activations included (Note [Step
    # budget across regions] rule 1): within every size's peak without checkpointing but
    # the smallest's (simulated: 0.34 / 0.49 / 0.73 MB at 4x16 / 4x24 / 6x24)
    budget = 450_000
    policy = memory_budget(budget, flops_per_byte=2.0, check=False)

    def blocks_step(x: torch.Tensor, policy: MemoryBudget | None) -> None:
        for p in gpt.parameters():
            p.grad.zero_()  # type: ignore[union-attr]
        h = gpt.tok(x) + gpt.pos(torch.arange(x.shape[1]))
        for block in gpt.blocks:
            if policy is None:
                h = block(h)
            else:
                with cg.save_recompute_policy(policy):
                    h = block(h)
        gpt.head(gpt.ln_f(h)).pow(2).mean().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blocks_step(batch(4, 16), policy)
    first = policy.step_report()
    assert first is not None and first.regions == LAYERS and first.feasible
    solves = solver_calls["solve"]
    assert solves > 0
    for b, s in [(4, 24), (6, 24)]:
        x = batch(b, s)
        plain = measure(blocks_step, x, None).peak_bytes
        expected = [p.grad.clone() for p in gpt.parameters()]  # type: ignore[union-attr]
        report: StepPlan | None = None
        for _ in range(2):  # the step that grows, then the one with its plan
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                peak = measure(blocks_step, x, policy).peak_bytes
            grads = [p.grad for p in gpt.parameters()]
            torch.testing.assert_close(grads, expected, rtol=0, atol=0)
            report = policy.step_report()  # plans the step that grew (warm menus)
            assert report is not None and report.feasible
            assert report.predicted_peak_bytes <= budget
        assert report is not None
        assert solver_calls["solve"] == solves, (b, s)  # no menu built by the solver again
        assert report.baseline_bytes > first.baseline_bytes  # planned at the new size
        # the memory outside the regions: measured without checkpointing less the
        # planner's figure for it (Note [Step budget across regions] rule 5)
        others = plain - report.plain_peak_bytes
        assert peak - others <= 1.03 * budget, (b, s, peak - others)


@pytest.mark.slow  # run by .ci/run after the README's test command (issue 21 item 14)
def test_a_warm_start_is_refined_at_later_steps_until_its_search_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # See Note [Warm start at a new size] rule 5.
    runs: list[bool] = []
    run = Refinement.run

    def counting(self: Refinement, evals: int) -> bool:
        runs.append(run(self, evals))
        return runs[-1]

    monkeypatch.setattr(Refinement, "run", counting)
    step = Step(model())
    budget = 400_000
    policy = memory_budget(budget, flops_per_byte=2.0, check=False)
    x = batch(6, 24)
    step(x, None)
    expected = step.grads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(batch(4, 16), policy)
        step(x, policy)  # larger: planned from the smaller plan
    report = policy.report()
    assert report is not None and report.method == "warm start"
    costs = [report.predicted_recompute_flops]
    for _ in range(40):
        step(x, policy)
        torch.testing.assert_close(step.grads(), expected, rtol=0, atol=0)
        assert step.region is not None
        peak = simulate(from_region(step.region), kept_ops_of(step.region)).peak_bytes
        assert peak <= budget
        report = policy.report()
        assert report is not None
        costs.append(report.predicted_recompute_flops)
    assert costs == sorted(costs, reverse=True)
    assert costs[-1] < costs[0]  # measured: 2.3% less recompute than the warm start
    assert 0 < len(runs) < 40  # a bounded search per step, ended (then no more runs)
    fresh = memory_budget(budget, flops_per_byte=2.0, check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(x, fresh)
    fresh_report = fresh.report()
    assert fresh_report is not None and fresh_report.method != "warm start"
    # measured: 3.4% above since a byte budget's graph has its ops' measured workspaces
    # (1.7% without them; equal when the budget bounded activations only)
    assert costs[-1] <= 1.04 * fresh_report.predicted_recompute_flops


@pytest.fixture
def simulations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the planner's liveness simulations (its unit of planning work)."""
    count = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return simulate(*args, **kwargs)

    monkeypatch.setattr(local_search, "simulate", counting)
    monkeypatch.setattr(seeds, "simulate", counting)
    return count


@pytest.mark.slow  # run by .ci/run after the README's test command (issue 21 item 14)
def test_int_budget_below_reach_at_a_new_largest_size_costs_about_a_warm_start(
    simulations: list[int],
) -> None:
    step = Step(model())
    policy = memory_budget(240_000, check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(batch(4, 16), policy)
        policy.report()  # planned from scratch: several hundred simulations
        costs = {}
        for s in (24, 32, 40):  # 24 fits the budget; 32 and 40 no longer do
            simulations[0] = 0
            step(batch(4, s), policy)
            policy.report()  # plans the step that grew
            costs[s] = simulations[0]
        report = policy.report()
        fresh = memory_budget(240_000, check=False)  # the unlimited solver at the largest size
        step(batch(4, 40), fresh)
        best = fresh.report()
    assert costs[24] <= 100, costs  # a warm start that fits
    assert max(costs.values()) <= 100, costs
    assert report is not None and best is not None
    assert not report.feasible and not best.feasible  # below reach: the lowest peak found
    # measured: 5.5% above the unlimited solver's total peak (its step 6a searches further)
    assert report.predicted_total_peak_bytes <= 1.08 * best.predicted_total_peak_bytes
