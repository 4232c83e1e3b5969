"""``Handle.recompute_readers`` is counted from the first value it protects on.

A region that recomputes everything (or keeps only its inputs so far) calls no ``need`` at
its saves; the first kept op output, in-place op or tag replays the counts
(``count_readers``). See Note [Kept values live no longer than in eager], rule 6. Each test
compares the counts with a region that counted from its start, and gradients with eager,
bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import leaf

import ckpt_graph as cg
from ckpt_graph.engine.kept_lifetime import count_readers

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten


def counts(region: cg.Region) -> list[tuple[int, int]]:
    """(recompute_readers, saved_refs) of every input and op output, in recording order."""
    values = list(region.inputs)
    values += [o for n in region.nodes for o in n.outputs if o is not None]
    return [(v.recompute_readers, v.saved_refs) for v in values]


def program(x: torch.Tensor, late: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Saves of recomputed values, one graph dropped during the forward, then ``late``."""
    a = x * 2
    b = a.sin()  # saves a
    c = (b + a).exp()  # saves its output
    dropped = (c * 3).cos()  # saves c * 3; its graph goes below
    del dropped
    d = c.tanh() + b  # saves its output
    e = late(d)
    return (e * d).sum()  # saves e and d


def tag_late(t: torch.Tensor) -> torch.Tensor:
    u = t * 5
    cg.tag_with_policy(u, True)  # the first kept op output: counting starts here
    return u.sigmoid()


def policy_keeps_late(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return op is aten.sigmoid.default


@pytest.mark.parametrize("kind", ["tag", "policy", "in_place", "none"])
def test_counts_started_late_equal_counts_from_the_start(kind: str) -> None:
    def late(t: torch.Tensor) -> torch.Tensor:
        if kind == "tag":
            return tag_late(t)
        if kind == "in_place":
            u = t * 1.0
            u.mul_(2)  # an in-place op: counting starts here
            return u.sigmoid()
        return (t * 5).sigmoid()

    policy: Any = policy_keeps_late if kind == "policy" else "recompute_all"
    seen: list[list[tuple[int, int]]] = []
    grads = []
    for early in (True, False):
        x = leaf(6, 4)
        with cg.save_recompute_policy(policy) as region:
            if early:
                count_readers(region)
            y = program(x, late)
            assert region.recording.counting is (early or kind != "none")
            seen.append(counts(region))
        y.backward()
        grads.append(x.grad)
    if kind == "none":  # nothing to protect: never counted
        assert all(readers == 0 for readers, _ in seen[1])
        assert any(readers > 0 for readers, _ in seen[0])
    else:
        assert seen[0] == seen[1]
    x = leaf(6, 4)  # eager: the same values (t * 1.0 * 2 is t * 2 exactly), no tag
    factor = 2.0 if kind == "in_place" else 5.0
    program(x, lambda t: (t * factor).sigmoid()).backward()
    torch.testing.assert_close(grads, [x.grad, x.grad], rtol=0, atol=0)


def test_an_input_written_in_place_is_copied_for_a_recomputation_counted_late() -> None:
    # Nothing is kept before the write: the input's readers are counted when ``add_``
    # comes, so the write copies the old value that recomputing ``y`` reads.
    base = leaf(8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2  # recomputed
        z = y.sin()  # saves y: its recomputation reads x
        x.add_(1)
        return z + x

    x = base * 1.0
    with cg.save_recompute_policy("recompute_all") as region:
        out = fn(x)
    (h,) = region.inputs
    assert h.copied  # the old value, which recomputing y reads
    out.sum().backward()
    want = base.detach().requires_grad_(True)
    fn(want * 1.0).sum().backward()
    torch.testing.assert_close(base.grad, want.grad, rtol=0, atol=0)
