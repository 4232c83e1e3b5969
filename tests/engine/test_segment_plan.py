"""Cut positions of a bounded pass on synthetic profiles (Note [Planned segment cuts]).

No framework in the loop: a profile is a list of storages ``(producer, last reader, bytes,
saved)``, and the cuts are checked against every cut set of small chains.
"""

from __future__ import annotations

import itertools
import random

import pytest

from ckpt_graph.engine.segment_plan import SegmentProfile

Storage = tuple[int, int, int, bool]


def _cost(n: int, storages: list[Storage], cuts: tuple[int, ...], peak: int) -> int | None:
    """Checkpoint bytes of ``cuts`` if each segment fits in ``peak`` with the checkpoints
    before it (rule 1), else ``None``: the definition, by brute force."""
    kept, start = 0, 0
    for c in (*cuts, n - 1):
        seg = sum(b for p, _, b, s in storages if s and start <= p <= c)
        if c != n - 1 and seg == 0:
            return None  # a cut closes a segment holding something
        if kept + seg > peak:
            return None
        if c != n - 1:
            kept += sum(b for p, last, b, _ in storages if start <= p <= c < last)
        start = c + 1
    return kept


def _random_profile(rng: random.Random, n: int) -> list[Storage]:
    out = []
    for p in range(n):
        last = min(n - 1, p + rng.choice([1, 1, 1, 2, 3, n]))
        out.append((p, last, rng.choice([1, 2, 4, 8, 16]), rng.random() < 0.8))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_fewest_checkpoint_bytes_within_a_peak(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    storages = _random_profile(rng, n)
    profile = SegmentProfile(n, storages)
    for peak in range(1, profile.saved_bytes + 1):
        brute = [
            k
            for r in range(n)
            for cuts in itertools.combinations(range(n - 1), r)
            if (k := _cost(n, storages, cuts, peak)) is not None
        ]
        found = profile._least_kept_within(peak)
        if not brute:
            assert found is None, peak
            continue
        assert found is not None, peak
        reached, kept, cuts = found
        assert kept == min(brute), (peak, cuts)
        assert _cost(n, storages, tuple(cuts), peak) == kept
        assert reached <= peak


def test_the_greedy_keeps_more_where_a_wide_value_crosses_its_cut() -> None:
    # A chain of 10-byte values with a 40-byte value made at op 2 and read at op 4 (an MLP's
    # wide activation): the greedy's best ratio cuts after op 2, keeping the wide value.
    chain: list[Storage] = [(p, p + 1, 10, True) for p in range(8)]
    chain[2] = (2, 4, 40, True)
    profile = SegmentProfile(8, chain)
    greedy = profile._cuts_within(70)
    least = profile._least_kept_within(70)
    assert greedy is not None and least is not None
    assert least[1] <= greedy[1]
    plan = profile.plan()
    assert _cost(8, chain, plan.cuts, plan.peak) is not None
