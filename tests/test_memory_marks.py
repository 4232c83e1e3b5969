"""``StepProbe.mark``: the peak of each stretch of a probed step between marks (Note [Phases of
a measured step])."""

from __future__ import annotations

import torch

from ckpt_graph.memory import StepProbe


def test_marks_split_the_peak_into_windows() -> None:
    probe = StepProbe("cpu")
    assert probe.start()
    a = torch.empty(4096, dtype=torch.uint8)
    b = torch.empty(1000, dtype=torch.uint8)
    del b
    probe.mark("exit")
    c = torch.empty(100, dtype=torch.uint8)  # on top of a, still live: 4196
    probe.mark("backward")
    del a, c  # the level when the stretch starts counts in it
    d = torch.empty(10, dtype=torch.uint8)
    assert probe.stop() == 5096
    assert probe.windows == (("start", 5096), ("exit", 4196), ("backward", 4196))
    del d


def test_a_mark_when_not_running_does_nothing() -> None:
    probe = StepProbe("cpu")
    probe.mark("exit")
    assert probe.start()
    keep = torch.empty(64, dtype=torch.uint8)
    assert probe.stop() == 64
    assert probe.windows == (("start", 64),)
    probe.mark("backward")  # stopped: nothing
    assert probe.windows == (("start", 64),)
    del keep
