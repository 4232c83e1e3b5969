"""``StepProbe.mark``: the peak of each stretch of a probed step between marks (Note [Phases of
a measured step]). Sizes are multiples of 512 bytes, CUDA's allocation granule, so that both
devices give the same figures; the ``cuda`` case is skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from ckpt_graph.memory import StepProbe

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
def test_marks_split_the_peak_into_windows(device: str) -> None:
    probe = StepProbe(device)
    assert probe.start()
    a = torch.empty(8192, dtype=torch.uint8, device=device)
    b = torch.empty(2048, dtype=torch.uint8, device=device)
    del b
    probe.mark("exit")
    c = torch.empty(1024, dtype=torch.uint8, device=device)  # on top of a, still live
    probe.mark("backward")
    del a, c  # the level when the stretch starts counts in it
    d = torch.empty(512, dtype=torch.uint8, device=device)
    assert probe.stop() == 10240
    assert probe.windows == (("start", 10240), ("exit", 9216), ("backward", 9216))
    del d


def test_a_mark_when_not_running_does_nothing() -> None:
    probe = StepProbe("cpu")
    probe.mark("exit")
    assert probe.start()
    keep = torch.empty(512, dtype=torch.uint8)
    assert probe.stop() == 512
    assert probe.windows == (("start", 512),)
    probe.mark("backward")  # stopped: nothing
    assert probe.windows == (("start", 512),)
    del keep
