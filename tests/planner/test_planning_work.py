"""Planning work grows linearly with the ops of a region of many tiny ops.

The planner simulates a bounded pass for every plan it evaluates, and each pass plans its
segment cuts (Note [Planned segment cuts]); the fewest-checkpoint search of those cuts
visited about ``n x L`` ops, quadratic on a region like transformers' Mamba, whose selective
scan is hundreds of tiny ops per layer between a few large values (rule 5 of the Note).
The work is counted in op visits of ``SegmentProfile._grow``, never timed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckpt_graph.engine import segment_plan
from ckpt_graph.engine.segment_plan import SegmentProfile

Storage = tuple[int, int, int, bool]


def _scan(layers: int, steps: int) -> tuple[int, list[Storage]]:
    """Per layer a 4 KiB value read after the layer's scan, then ``steps`` 8-byte values each
    read by the next op: Mamba's shape (a large projection, then a long loop of tiny ops)."""
    storages: list[Storage] = []
    p = 0
    for _ in range(layers):
        storages.append((p, p + steps + 1, 4096, True))
        p += 1
        for _ in range(steps):
            storages.append((p, p + 1, 8, True))
            p += 1
    return p, storages


def _visits(monkeypatch: pytest.MonkeyPatch, n: int, storages: list[Storage]) -> int:
    """Op visits of planning the automatic cuts of a fresh profile (no cached plan)."""
    count = [0]
    grow = SegmentProfile._grow

    def counted(
        self: SegmentProfile, start: int, stop: int, room: int
    ) -> Iterator[tuple[int, int, int]]:
        for step in grow(self, start, stop, room):
            count[0] += 1
            yield step

    with monkeypatch.context() as m:
        m.setattr(SegmentProfile, "_grow", counted)
        m.setattr(segment_plan, "PLANS", {})
        SegmentProfile(n, storages).plan()
    return count[0]


@pytest.mark.parametrize("steps", [100, 200, 400, 800])
def test_cut_planning_visits_a_bounded_number_of_ops_per_op(
    monkeypatch: pytest.MonkeyPatch, steps: int
) -> None:
    n, storages = _scan(4, steps)
    visits = _visits(monkeypatch, n, storages)
    # the bound of rule 5 plus the greedy scans of the bisection, whatever the scan length
    assert visits <= (segment_plan.LEAST_KEPT_WORK + 16) * n, (n, visits)


def test_cut_planning_work_doubles_when_the_scan_doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    short = _visits(monkeypatch, *_scan(4, 400))
    long = _visits(monkeypatch, *_scan(4, 800))
    assert long <= 2.2 * short, (short, long)


def test_without_the_bound_the_search_is_quadratic(monkeypatch: pytest.MonkeyPatch) -> None:
    # What rule 5 prevents: the fewest-checkpoint search alone grows with the scan's square.
    monkeypatch.setattr(segment_plan, "LEAST_KEPT_WORK", 10**12)
    short = _visits(monkeypatch, *_scan(4, 400))
    long = _visits(monkeypatch, *_scan(4, 800))
    assert long >= 3 * short, (short, long)


@pytest.mark.parametrize("steps", [100, 400])
def test_bounded_cuts_reach_the_same_peak(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    # The greedy cuts taken past the bound keep each segment within the same least peak.
    n, storages = _scan(4, steps)
    bounded = SegmentProfile(n, storages)._plan(None, 0)
    monkeypatch.setattr(segment_plan, "LEAST_KEPT_WORK", 10**12)
    exact = SegmentProfile(n, storages)._plan(None, 0)
    assert bounded.peak == exact.peak
    assert bounded.feasible and exact.feasible


def test_small_profiles_plan_the_same_cuts_as_without_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A chain of 64 ops: the search stays under the bound and is exact (rule 1).
    storages: list[Storage] = [(p, p + 1, 10 + p % 7, True) for p in range(64)]
    bounded = SegmentProfile(64, storages)._plan(None, 0)
    monkeypatch.setattr(segment_plan, "LEAST_KEPT_WORK", 10**12)
    assert SegmentProfile(64, storages)._plan(None, 0) == bounded
