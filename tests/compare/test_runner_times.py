"""``compare.runner``: every timed step's process CPU time is kept in round order, so a
benchmark can read the ratio of two strategies within each round (their steps ran back to
back) and not only the ratio of medians. No assertion here depends on how long a step takes."""

from __future__ import annotations

import statistics

from ckpt_graph.compare.runner import WorkloadRun, run_comparison
from ckpt_graph.compare.strategies import make_forward
from ckpt_graph.compare.zoo import build_workload


def test_cpu_times_per_round_are_kept_and_give_the_median() -> None:
    w = build_workload("mlp", layers=2, width=16, batch=4)
    run = WorkloadRun(w, count_ops=False)
    run.add("none", lambda: make_forward("none", w))
    run.add("torch-ckpt", lambda: make_forward("torch-ckpt", w))
    results = run.results(repeat=3)
    assert [r.strategy for r in results] == ["none", "torch-ckpt"]
    for r in results:
        assert len(r.cpu_times_s) == 3 and len(r.step_times_s) == 3
        assert all(t >= 0.0 for t in r.cpu_times_s)
        assert r.cpu_time_s == statistics.median(r.cpu_times_s)
    none, ckpt = results
    assert none.cpu_time_s is not None and ckpt.cpu_time_s is not None
    if none.cpu_time_s > 0:
        assert ckpt.cpu_time_ratio == ckpt.cpu_time_s / none.cpu_time_s


def test_a_strategy_that_failed_has_no_times() -> None:
    results = run_comparison(
        "mlp",
        layers=2,
        width=16,
        batch=4,
        repeat=2,
        count_ops=False,
        strategies=["none", "cg-budget"],
        budget=-1.0,
    )
    by = {r.strategy: r for r in results}
    assert len(by["none"].cpu_times_s) == 2
    assert by["cg-budget"].status == "failed"
    assert "memory_budget(-1.0): a float is a fraction" in by["cg-budget"].note
    assert by["cg-budget"].cpu_times_s == ()
