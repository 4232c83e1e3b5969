"""``need``'s walk counts as it goes and undoes its counts when it fails.

``kept_lifetime.need`` counts each input of the op nodes a new saved tensor needs as the
walk visits it (Note [Kept values live no longer than in eager], rule 1), which is cheaper
than a walk and a second counting loop; a walk that reaches a kept value that is not
``intact`` changes nothing. These tests hold it to the rule stated as two steps (find the
op nodes, then count their inputs) on random graphs, and check the undo on a program.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import torch
from models import leaf

import ckpt_graph as cg
from ckpt_graph.engine import graph
from ckpt_graph.engine.kept_lifetime import need

aten = torch.ops.aten


def _needed(h: Any) -> bool:
    return h.saved_refs > 0 or h.recompute_readers > 0


def _live(node: Any) -> bool:
    return any(o is not None and o.reason is None and _needed(o) for o in node.outputs)


def _need_in_two_steps(region: Any, h: Any) -> bool:
    """The rule: the op nodes nothing needed yet that recomputing ``h`` runs, then one
    count per input of each; nothing when a kept value they read is not intact."""
    if h.node_index < 0:
        return False
    node = region.nodes[h.node_index]
    if _live(node):
        return True
    newly, seen, k = [node], {h.node_index}, 0
    while k < len(newly):
        for i in newly[k].inputs:
            if i.reason is not None:
                if i.value is None or (i.superseded and not i.copied):
                    return False
            elif not _needed(i):
                if i.node_index < 0:
                    return False
                if i.node_index not in seen:
                    seen.add(i.node_index)
                    if not _live(region.nodes[i.node_index]):
                        newly.append(region.nodes[i.node_index])
        k += 1
    for n in newly:
        for i in n.inputs:
            i.recompute_readers += 1
    return True


def _value(node_index: int, rnd: random.Random) -> SimpleNamespace:
    kept = rnd.random() < 0.2
    return SimpleNamespace(
        node_index=node_index,
        reason=graph.POLICY if kept else None,
        value=None if kept and rnd.random() < 0.3 else 1,
        superseded=kept and rnd.random() < 0.2,
        copied=rnd.random() < 0.5,
        saved_refs=rnd.randint(1, 2) if rnd.random() < 0.3 else 0,
        recompute_readers=rnd.randint(1, 2) if rnd.random() < 0.2 else 0,
    )


def _random_region(seed: int) -> tuple[SimpleNamespace, list[SimpleNamespace], random.Random]:
    rnd = random.Random(seed)
    values = [_value(-1, rnd) for _ in range(rnd.randint(1, 3))]
    nodes = []
    for j in range(rnd.randint(1, 25)):
        inputs = tuple(rnd.sample(values, rnd.randint(0, min(3, len(values)))))  # distinct
        outputs: list[SimpleNamespace | None] = []
        for _ in range(rnd.choice([1, 1, 1, 2, 3])):
            outputs.append(_value(j, rnd))
            values.append(outputs[-1])  # type: ignore[arg-type]
        if rnd.random() < 0.1:
            outputs.append(None)
        nodes.append(SimpleNamespace(inputs=inputs, outputs=tuple(outputs)))
    return SimpleNamespace(nodes=nodes), values, rnd


def test_need_counts_what_the_two_step_rule_counts_on_random_graphs() -> None:
    for seed in range(3000):
        region, values, rnd = _random_region(seed)
        start = [(v.saved_refs, v.recompute_readers) for v in values]
        saves = [rnd.choice(values) for _ in range(5)]  # then saved, as the pack hook does
        runs = []
        for fn in (need, _need_in_two_steps):
            for v, (refs, readers) in zip(values, start, strict=True):
                v.saved_refs, v.recompute_readers = refs, readers
            run = []
            for h in saves:
                run.append((fn(region, h), [v.recompute_readers for v in values]))  # type: ignore[arg-type]
                h.saved_refs += 1
            runs.append(run)
        assert runs[0] == runs[1], f"seed {seed}"


def test_a_walk_that_fails_after_counting_an_input_leaves_no_count() -> None:
    # ``b = c + a`` is recomputed from two kept values; ``a`` is overwritten as is (nothing
    # needs ``b`` yet), so when ``sin`` saves ``b`` the walk counts ``c`` and then fails at
    # ``a``: ``b`` is kept itself and ``c`` has no recomputing reader.
    x = leaf(16)

    def fn(t: torch.Tensor) -> torch.Tensor:
        c = t * 3
        a = t * 5
        b = c + a
        a.mul_(7)
        return b.sin() + a

    with cg.save_recompute_policy(
        lambda ctx, out, op, *args, **k: op is aten.mul.Tensor and args[1] in (3, 5)
    ) as region:
        y = fn(x)
    (add,) = [n for n in region.nodes if n.op is aten.add.Tensor and n.index < 4]
    c, a = add.inputs
    assert c.kept and a.superseded
    assert add.outputs[0].reason is graph.SAVED_AFTER_INPUTS_FREED
    assert c.recompute_readers == 0
    y.sum().backward()
    want = x.detach().clone().requires_grad_(True)
    fn(want).sum().backward()
    torch.testing.assert_close(x.grad, want.grad, rtol=0, atol=0)
