"""A region's graph as a backward pass sees it, numbered, and the pure rules over it.

Op nodes and values are integers (:class:`PassGraph`); per-value state (use counts, whether
a value is kept or cached) is any indexable sequence. The engine numbers a region
(``passes.pass_graph``), the liveness simulator its ``SimGraph`` (``SimGraph.pass_graph``);
both run these rules. See Note [One pass core] in ``pass_core.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = [
    "NodeRows",
    "PassGraph",
    "Rows",
    "collect",
    "count_uses",
    "free_use",
    "is_dead",
    "last_readers",
    "mark_transient",
    "roots",
]


@dataclass(frozen=True)
class PassGraph:
    """A region's graph as a backward pass sees it: op nodes and values as integers.

    Attributes:
        inputs: per op node (forward order, a topological order), the distinct values it
            reads.
        outputs: per op node, the values it makes (tensor outputs only).
        producer: per value, the op node that makes it, -1 for a region input.
        nbytes: per value, the bytes of its storage if it owns one.
        view: per value, whether it is a view of another value (shares its storage).
        has_views: per value, whether some view op took it as input.
        transient_ok: per op node, whether its output may be transient (pointwise, not
            random, not in place, exactly one output): Note [Transient values].

    Example:
        >>> g = PassGraph(((0,), (1,)), ((1,), (2,)), (-1, 0, 1), (8, 8, 8),
        ...               (False,) * 3, (False,) * 3, (False, False))
        >>> uses = [0, 0, 1]  # one saved tensor refers to value 2
        >>> count_uses(g, [True, False, False], uses), uses
        ([True, True], [0, 1, 1])
    """

    inputs: Sequence[Sequence[int]]
    outputs: Sequence[Sequence[int]]
    producer: Sequence[int]
    nbytes: Sequence[int]
    view: Sequence[bool]
    has_views: Sequence[bool]
    transient_ok: Sequence[bool]


class Rows(Protocol):
    """What the use-count sweep reads of a graph: per op node, its input and output values
    (a :class:`PassGraph`, or :class:`NodeRows` where the per-value facts are not needed)."""

    @property
    def inputs(self) -> Sequence[Sequence[int]]:
        """Per op node, the distinct values it reads."""
        ...

    @property
    def outputs(self) -> Sequence[Sequence[int]]:
        """Per op node, the values it makes."""
        ...


class NodeRows(NamedTuple):
    """A graph's op node rows alone (:class:`Rows`): ``PassGraph.inputs`` and ``outputs``."""

    inputs: Sequence[Sequence[int]]
    outputs: Sequence[Sequence[int]]


def count_uses(
    g: Rows,
    kept: Sequence[bool],
    uses: MutableSequence[int],
    *,
    all_inputs: bool = False,
    taken: Callable[[int], bool] | None = None,
) -> list[bool]:
    """Add the uses of the op nodes that will run to ``uses`` (which starts at the saved
    tensors of each value); return, per op node, whether it runs. See Note [One pass
    core], rule 1.

    Args:
        g: the graph.
        kept: per value, whether it is kept (never recomputed).
        uses: per value, the saved tensors referring to it; the uses of running op nodes
            are added (recomputed inputs only, or every input with ``all_inputs``).
        all_inputs: count the uses of kept inputs too (live uses at region exit).
        taken: called for each recomputed output with a pending use; ``True`` when the
            value is served otherwise (the engine's live forward tensors), so that it does
            not make its producer run.
    """
    inputs, outputs = g.inputs, g.outputs
    runs = [False] * len(outputs)
    # One loop per case, so that no test is repeated per op node (this sweep runs at each
    # region exit and pass start, once per op node).
    if taken is not None:
        for j in range(len(outputs) - 1, -1, -1):
            needed = False
            for o in outputs[j]:  # no break: ``taken`` sees every pending output
                if not kept[o] and uses[o] > 0 and not taken(o):
                    needed = True
            if not needed:
                continue
            runs[j] = True
            if all_inputs:
                for i in inputs[j]:
                    uses[i] += 1
            else:
                for i in inputs[j]:
                    if not kept[i]:
                        uses[i] += 1
    elif all_inputs:
        for j in range(len(outputs) - 1, -1, -1):
            for o in outputs[j]:
                if uses[o] > 0 and not kept[o]:
                    break
            else:
                continue
            runs[j] = True
            for i in inputs[j]:
                uses[i] += 1
    else:
        for j in range(len(outputs) - 1, -1, -1):
            for o in outputs[j]:
                if uses[o] > 0 and not kept[o]:
                    break
            else:
                continue
            runs[j] = True
            for i in inputs[j]:
                if not kept[i]:
                    uses[i] += 1
    return runs


def last_readers(g: PassGraph, kept: Sequence[bool], runs: Sequence[bool]) -> list[int]:
    """Per recomputed value, the last op node that runs and reads it (-1 if none)."""
    last = [-1] * len(g.producer)
    inputs = g.inputs
    for j in range(len(inputs) - 1, -1, -1):
        if runs[j]:
            for i in inputs[j]:
                if not kept[i] and last[i] < 0:
                    last[i] = j
    return last


def collect(
    g: PassGraph,
    targets: Iterable[int],
    kept: Sequence[bool],
    cached: Sequence[bool] | None = None,
) -> tuple[list[int], dict[int, int]]:
    """What realizing the recomputed ``targets`` runs: from them back through producers to
    the nearest kept or cached values. See Note [One pass core], rule 2.

    Args:
        g: the graph.
        targets: recomputed values to realize.
        kept: per value, whether it is kept.
        cached: per value, whether it is cached (``None``: nothing is).

    Returns:
        The op nodes in forward order, and per recomputed value the collected op nodes that
        read it (``need``; each target once more, for the read that asked for it).
    """
    inputs, producer = g.inputs, g.producer
    need: dict[int, int] = {}
    stack = []
    for v in targets:
        need[v] = need.get(v, 0) + 1
        stack.append(producer[v])
    todo: set[int] = set()
    while stack:
        j = stack.pop()
        if j in todo:
            continue
        todo.add(j)
        for i in inputs[j]:
            if not kept[i]:
                need[i] = need.get(i, 0) + 1
                if cached is None or not cached[i]:
                    stack.append(producer[i])
    return sorted(todo), need


def roots(g: PassGraph, kept: Sequence[bool]) -> list[int]:
    """Per value, the value whose storage it uses: itself unless a recomputed view, then
    through views (to the first input of their producers) up to a kept value or one that
    is not a view."""
    view, producer, inputs = g.view, g.producer, g.inputs
    root = list(range(len(producer)))
    done = [False] * len(producer)
    for v in range(len(producer)):
        path: list[int] = []
        r = v
        while not done[r] and view[r] and not kept[r]:
            p = producer[r]
            if p < 0 or not inputs[p]:
                break
            path.append(r)
            r = inputs[p][0]
        top = root[r] if done[r] else r
        for u in path:
            root[u] = top
            done[u] = True
    return root


def mark_transient(
    g: PassGraph,
    kept: Sequence[bool],
    uses: MutableSequence[int],
    min_bytes: int,
    live: Sequence[bool] | None = None,
) -> list[bool]:
    """Per value, whether it is transient in this pass; adds the extra uses of the
    transient values' recomputed inputs to ``uses``. See Note [Transient values].

    Args:
        g: the graph.
        kept: per value, whether it is kept.
        uses: the pass's use counts, after ``count_uses``.
        min_bytes: smaller values stay cached (``passes.TRANSIENT_MIN_BYTES``).
        live: per value, whether the pass reads it as the program's live forward tensor
            (never transient).
    """
    inputs, outputs, producer = g.inputs, g.outputs, g.producer
    nbytes, view = g.nbytes, g.view
    transient = [False] * len(producer)
    if not any(g.transient_ok):
        return transient

    def aliases_kept(v: int) -> bool:  # a view of a kept value, through views only
        while view[v] and not kept[v]:
            p = producer[v]
            if p < 0 or not inputs[p]:
                return False
            v = inputs[p][0]
        return kept[v]

    for j, ok in enumerate(g.transient_ok):
        if not ok:
            continue
        h = outputs[j][0]
        if (
            kept[h]
            or (live is not None and live[h])
            or uses[h] < 2
            or view[h]
            or g.has_views[h]
            or nbytes[h] < min_bytes
        ):
            continue
        total = 0
        for i in inputs[j]:
            if not kept[i] and not aliases_kept(i):
                if transient[i] or view[i] or uses[i] < 2:
                    break
                total += nbytes[i]
        else:
            if total <= nbytes[h]:
                transient[h] = True
                extra = uses[h] - 1
                for i in inputs[j]:
                    if not kept[i]:
                        uses[i] += extra
    return transient


def free_use(
    g: PassGraph,
    kept: Sequence[bool],
    live_uses: MutableSequence[int],
    may_run: MutableSequence[bool],
    v: int,
    free_kept: Callable[[int], None],
    dead: Callable[[int], None] | None,
) -> None:
    """A saved tensor of ``v`` was freed: take one live use, and follow what that frees.
    See Note [Releasing kept values].

    Args:
        g: the graph.
        kept: per value, whether it is kept (read as the uses fall).
        live_uses: per value, its live uses (``count_uses`` with ``all_inputs``).
        may_run: per op node, whether it may still run (updated).
        v: the value of the freed saved tensor.
        free_kept: frees a kept value with no live use left.
        dead: called with an op node that may have become dead (``is_dead``): it ran out
            of uses or one of its kept outputs was freed; ``None`` when nothing is to be
            done for a dead op node (the engine's region has no op node with a generator
            state), which saves a call per op node freed.
    """
    inputs, outputs, producer = g.inputs, g.outputs, g.producer
    stack = [v]
    while stack:
        v = stack.pop()
        live_uses[v] -= 1
        if live_uses[v] > 0:
            continue
        p = producer[v]
        if kept[v]:
            free_kept(v)
            if p >= 0 and dead is not None:
                dead(p)
            continue
        if p < 0 or not may_run[p]:
            continue
        for o in outputs[p]:  # a loop, not any(): it runs for every freed saved tensor
            if not kept[o] and live_uses[o] > 0:
                break
        else:
            may_run[p] = False
            if dead is not None:
                dead(p)
            stack.extend(inputs[p])


def is_dead(g: Rows, live_uses: Sequence[int], may_run: Sequence[bool], j: int) -> bool:
    """Whether op node ``j`` never runs again: no recomputed output needs it and no kept
    output has a live use (Note [Kept values changed after the region] may recompute a
    kept output still in use)."""
    return not may_run[j] and not any(live_uses[o] > 0 for o in g.outputs[j])
