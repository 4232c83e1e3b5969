"""Introspection (``ckpt_graph.analysis``) and ``debug=True`` replay checks.

The byte figures of ``summary()`` are checked against ``ckpt_graph.memory.measure``: at the end
of a forward run inside a region, what the allocator still holds is what the region keeps (plus
the RNG states of random ops and the returned value).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import networkx as nx
import pytest
import torch
from models import ZOO, make_model, save_matmuls
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import FlopCounterMode

import ckpt_graph as cg
from ckpt_graph.memory import measure, measure_with_result

POLICIES: dict[str, Any] = {
    "recompute_all": "recompute_all",
    "must_save_all": "must_save_all",
    "save_matmuls": save_matmuls,
}


def _forward(name: str, policy: Any, *, tag: bool = False) -> tuple[Any, torch.Tensor, Any]:
    model, x = make_model(name)
    model.tag_blocks = tag
    with cg.save_recompute_policy(policy) as region:
        y = model(x)
    return region, y, model


def _backward(y: torch.Tensor, **kwargs: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    y.backward(torch.randn(y.shape, generator=gen, dtype=y.dtype), **kwargs)


# ------------------------------------------------------------------------------------ graph
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ZOO)
def test_graph_records_every_op_node(name: str, policy: str) -> None:
    region, _, _ = _forward(name, POLICIES[policy])
    records = region.graph
    assert [r.index for r in records] == list(range(len(region.nodes)))
    for r, node in zip(records, region.nodes, strict=True):
        assert r.op == str(node.op)
        assert r.decision == node.decision.name
        for shape, dtype, nbytes, o in zip(
            r.shapes, r.dtypes, r.out_bytes, node.outputs, strict=True
        ):
            if o is None:
                assert (shape, dtype, nbytes) == (None, None, 0)
                continue
            numel = 1
            for s in shape or ():
                numel *= s
            assert nbytes == numel * getattr(torch, str(dtype)).itemsize
        assert r.kept == tuple(o.reason if o is not None else None for o in node.outputs)
        assert all(i < r.index for i, _ in r.inputs)  # producers come first
        if policy == "save_matmuls" and node.op in (torch.ops.aten.addmm.default,):
            assert (r.decision, r.decided_by, r.kept) == ("MUST_SAVE", "save_matmuls", ("policy",))
        if policy == "recompute_all" and not r.decided_by.startswith("engine"):
            assert r.decision == "PREFER_RECOMPUTE"
            assert not r.is_kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].op = "x"  # type: ignore[misc]


@pytest.mark.parametrize("name", ZOO)
def test_flops_match_flop_counter(name: str) -> None:
    model, x = make_model(name)
    with FlopCounterMode(display=False) as counter:
        model(x)
    expected = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    region, _, _ = _forward(name, "recompute_all")
    got: dict[str, int] = {}
    for r in region.graph:
        packet = r.op.rsplit(".", 1)[0]
        got[packet] = got.get(packet, 0) + r.flops
    assert {k: v for k, v in got.items() if k in expected} == expected
    assert sum(expected.values()) > 0
    assert all(node.flops >= 0 for node in region.nodes)  # cached on the op nodes
    if name == "transformer":  # CPU SDPA has no registered formula: QK^T and AV matmuls
        sdpa = [r for r in region.graph if "scaled_dot_product" in r.op]
        b, heads, t, dh = 2, 2, 6, 4
        assert [r.flops for r in sdpa] == [2 * (2 * b * heads * t * t * dh)] * 2


def test_realized_counts_over_backward_passes() -> None:
    region, y, _ = _forward("mlp", "recompute_all")
    assert all(r.realized == 0 for r in region.graph)
    _backward(y, retain_graph=True)
    once = [r.realized for r in region.graph]
    assert sum(once) == region.pass_state.recomputed_ops > 0
    _backward(y)
    assert [r.realized for r in region.graph] == [2 * n for n in once]


# ----------------------------------------------------------------------- networkx and DOT
@pytest.mark.parametrize("name", ZOO)
def test_to_networkx_matches_records(name: str) -> None:
    region, _, _ = _forward(name, save_matmuls)
    g = region.to_networkx()
    records = region.graph
    assert isinstance(g, nx.DiGraph)
    assert nx.is_directed_acyclic_graph(g)
    assert g.number_of_nodes() == len(records) + len(region.inputs)
    for r in records:
        attrs = g.nodes[r.index]
        assert attrs["kind"] == "op"
        assert {k: attrs[k] for k in dataclasses.asdict(r)} == dataclasses.asdict(r)
        expected: dict[Any, tuple[tuple[int, ...], int]] = {}
        for producer, index in r.inputs:
            source = producer if producer >= 0 else ("input", index)
            size = (
                records[producer].out_bytes[index] if producer >= 0 else g.nodes[source]["nbytes"]
            )
            outs, total = expected.get(source, ((), 0))
            expected[source] = ((*outs, index), total + size)
        got = {u: (d["outputs"], d["nbytes"]) for u, _, d in g.in_edges(r.index, data=True)}
        assert got == expected
    for node, attrs in g.nodes(data=True):
        if attrs["kind"] == "input":
            assert g.in_degree(node) == 0


@pytest.mark.parametrize("name", ZOO)
def test_to_dot_has_every_node_and_edge_coloured_by_decision(name: str) -> None:
    region, _, _ = _forward(name, save_matmuls)
    dot = region.to_dot()
    assert dot.startswith("digraph region {") and dot.rstrip().endswith("}")
    fills = dict(re.findall(r'^\s+(op\d+|in\d+) \[label=".*", .*fillcolor="(#\w+)"\];$', dot, re.M))
    edges = re.findall(r"^\s+(op\d+|in\d+) -> (op\d+) \[", dot, re.M)
    g = region.to_networkx()
    assert len(fills) == g.number_of_nodes()
    name_of = {n: (f"op{n}" if isinstance(n, int) else f"in{n[1]}") for n in g.nodes}
    assert sorted(edges) == sorted((name_of[a], name_of[b]) for a, b in g.edges)
    kept = {fills[f"op{r.index}"] for r in region.graph if r.is_kept}
    recomputed = {fills[f"op{r.index}"] for r in region.graph if not r.is_kept}
    assert kept and recomputed and not kept & recomputed


# ------------------------------------------------------------------------------------ summary
@pytest.mark.parametrize("tag", [False, True], ids=["", "tag_blocks"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ZOO)
def test_summary_kept_bytes_match_measured_end_of_forward(
    name: str, policy: str, tag: bool
) -> None:
    """Kept bytes vs. what the allocator holds after the forward, within 5%.

    Parameters and the input exist before the measured call, so region inputs (and engine
    snapshots of them) are not in ``end_bytes``. What is: the values the region keeps, the
    generator states of random ops, and the returned scalar. The forward's own output is
    dropped inside the call unless the region keeps it.
    """
    model, x = make_model(name)
    model.tag_blocks = tag

    def forward() -> tuple[torch.Tensor, Any]:
        with cg.save_recompute_policy(POLICIES[policy]) as region:
            y = model(x)
        return y.sum(), region

    (loss, region), report = measure_with_result(forward)
    s = region.summary()
    if tag:
        assert s.kept_bytes["tag"] > 0
    assert s.kept_bytes["snapshot"] == 0  # nothing in the zoo changes a value through an alias
    kept = s.kept_bytes["policy"] + s.kept_bytes["tag"] + s.kept_bytes["engine"]
    assert kept == s.total_kept_bytes
    # The engine may release, when the forward ends, kept values nothing will read.
    assert kept - s.unused_kept_bytes <= s.held_bytes <= kept
    expected = s.held_bytes + s.rng_state_bytes + loss.nbytes
    assert abs(report.end_bytes - expected) <= 0.05 * report.end_bytes, (report, s)
    if policy == "recompute_all" and not tag:
        assert kept == 0


def test_summary_of_a_chain_by_hand() -> None:
    """x -> sin -> exp -> cos: exp and cos save exp's output, which needs sin's output."""
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)  # 4 KiB per value
    with cg.save_recompute_policy("recompute_all") as region:
        y = x.sin().exp().cos()
    s = region.summary()
    assert (s.ops, s.saved_tensors) == (3, 3)  # sin saves x; exp saves out; cos saves its input
    assert s.saved_bytes == 4096  # the exp output, saved twice (x is a region input)
    assert s.kept_bytes["input"] == 4096
    assert s.total_kept_bytes == 0
    assert s.recomputable_bytes == 2 * 4096  # exp's output and sin's output, needed for it
    assert s.recompute_ops == 2
    assert (s.backward_passes, s.recomputed_ops_last_pass) == (0, 0)
    _backward(y)
    s = region.summary()
    assert (s.backward_passes, s.recomputed_ops_last_pass, s.recomputed_ops_total) == (1, 2, 2)
    assert s.peak_cached_bytes == 2 * 4096
    text = str(s)
    for row in ("ops recorded", "recomputable", "8.00 KiB", "ops recomputed (last pass)"):
        assert row in text


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ZOO)
def test_summary_after_backward_matches_engine(name: str, policy: str) -> None:
    region, y, _ = _forward(name, POLICIES[policy])
    before = region.summary()
    _backward(y)
    s = region.summary()
    assert s.recomputed_ops_last_pass == region.pass_state.recomputed_ops
    assert s.recomputed_ops_total == sum(n.realized for n in region.nodes)
    assert s.peak_cached_bytes == region.pass_state.peak_cached_bytes
    # A full backward unpacks every saved tensor: it runs exactly the recompute chain, some
    # cheap pointwise ops more than once (see Note [Transient values]).
    ran = [n for n in region.nodes if n.pass_id == region.pass_state.number]
    assert len(ran) == before.recompute_ops
    repeated = [n for n in ran if n.realized > 1]
    assert s.recomputed_ops_last_pass == len(ran) + sum(n.realized - 1 for n in repeated)
    assert all(n.info.is_pointwise for n in repeated)
    assert (s.kept_bytes, s.recomputable_bytes) == (before.kept_bytes, before.recomputable_bytes)
    assert s.rng_state_bytes == s.held_bytes == 0  # released with the graph
    if policy == "must_save_all":
        assert before.recompute_ops == 0 and before.recomputable_bytes == 0
    else:
        assert before.recompute_ops > 0 and before.recomputable_bytes > 0


def keep_mm(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return True if op is torch.ops.aten.mm.default else None


def keep_exp(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return True if op is torch.ops.aten.exp.default else CheckpointPolicy.PREFER_RECOMPUTE


def test_summary_by_policy_and_unused_kept_values() -> None:
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)  # 512 B per value
    with cg.save_recompute_policy(keep_mm) as region:
        h = x.mm(x)
        with cg.save_recompute_policy(keep_exp):
            e = h.exp()
            y = e.relu()  # saves its output, recomputed from exp's kept output
    s = region.summary()
    assert s.kept_by == {"keep_mm": 512, "keep_exp": 512}
    assert s.kept_bytes["policy"] == 1024
    assert s.unused_kept_bytes == 512  # mm's output: exp's output is kept, so nobody reads it
    with cg.save_recompute_policy("must_save_all") as region2:
        y2 = x.sin().exp()
    s2 = region2.summary()
    assert s2.total_kept_bytes == 1024
    # the final exp output is saved by exp itself; sin's output is needed by nobody
    assert s2.unused_kept_bytes == 512
    assert [v[1] for v in s2.largest_kept] == [512, 512]
    del y, y2


def test_summary_inside_open_region_records_nothing() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        h = x.sin()
        n = len(region.nodes)
        region.summary(), region.graph, region.to_networkx(), region.to_dot(), region.explain(h)
        assert len(region.nodes) == n
        h.cos().sum().backward()


# ------------------------------------------------------------------------------------ explain
def keep_first_mm(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op is torch.ops.aten.mm.default and ctx.op_index == 0:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _mlp_chain() -> tuple[Any, dict[str, torch.Tensor]]:
    x = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    with cg.save_recompute_policy(keep_first_mm) as region:
        a = x.mm(w1)  # kept
        r = a.relu()  # recomputed from a
        b = r.mm(w2)  # recomputed: needs r, which needs a
        t = b.tanh()
        cg.tag_with_policy(t, True)
        out = t.sum()
    return region, {"x": x, "a": a, "r": r, "b": b, "t": t, "out": out, "w1": w1}


def test_explain_kept_by_policy() -> None:
    region, v = _mlp_chain()
    e = region.explain(v["a"])
    assert (e.kept, e.reason, e.decision, e.decided_by) == (
        True,
        "policy",
        "MUST_SAVE",
        "keep_first_mm",
    )
    assert "keep_first_mm" in e.why and "MUST_SAVE" in e.why
    # not kept, it would cost the matmul from the region inputs
    assert (e.recompute_ops, e.recompute_flops, e.recompute_bytes) == (
        1,
        2 * 16 * 32 * 64,
        16 * 64 * 8,
    )
    assert e.chain == ("#0 aten.mm.default",)
    assert "recomputing it would cost 1 op(s)" in str(e)
    assert e.needed  # relu's recomputation reads it


def test_explain_values_backward_never_reads() -> None:
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    with cg.save_recompute_policy(keep_exp) as region:
        e = x.exp()  # kept; exp saves its output
        s = e.sin()  # sin saves its input e
        y = s.sum()  # nothing saves s, and sum's output is never needed
    kept = region.explain(e)
    assert kept.needed and kept.saved_count == 2
    unused = region.explain(s)
    assert (unused.kept, unused.needed, unused.saved_count) == (False, False, 0)
    assert "backward never needs it: it is not recomputed" in str(unused)
    with cg.save_recompute_policy("must_save_all") as region2:
        t = x.exp().sum()
    wasted = region2.explain(t)
    assert (wasted.kept, wasted.needed) == (True, False)
    assert "keeping it wastes memory" in str(wasted)
    del y


def test_explain_recomputed_chain_and_tag() -> None:
    region, v = _mlp_chain()
    e = region.explain(v["b"])
    assert (e.kept, e.reason, e.decided_by) == (False, None, "keep_first_mm")
    assert "PREFER_RECOMPUTE" in e.why
    assert e.chain == ("#1 aten.relu.default", "#2 aten.mm.default")
    assert e.recompute_flops == 2 * 16 * 64 * 8
    assert e.recompute_bytes == 16 * 64 * 8 + 16 * 8 * 8  # relu's output and b
    assert e.sources[0].startswith("output 0 of op #0 aten.mm.default")
    assert (e.saved_count, e.consumers) == (0, 1)  # tanh saves its output, not its input b
    r = region.explain(v["r"])
    assert (r.saved_count, r.recompute_ops, r.recompute_bytes) == (2, 1, 16 * 64 * 8)  # relu, mm
    t = region.explain(v["t"])
    assert (t.kept, t.reason, t.decided_by) == (True, "tag", "tag")
    assert "tag_with_policy" in t.why
    x = region.explain(v["x"])
    assert (x.kept, x.reason, x.op_index, x.recompute_ops) == (True, "input", -1, 0)
    assert "region input" in str(x)


def test_explain_unknown_tensor_and_bad_argument() -> None:
    region, _ = _mlp_chain()
    with pytest.raises(
        ValueError, match=r"ckpt_graph: explain\(\): this tensor \[3x3 .*never seen"
    ):
        region.explain(torch.zeros(3, 3))
    with pytest.raises(TypeError, match=r"needs a torch\.Tensor"):
        region.explain([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ZOO)
def test_explain_every_module_output_of_the_zoo(name: str) -> None:
    model, x = make_model(name)
    outputs: list[tuple[str, torch.Tensor]] = []
    for path, m in model.named_modules():
        if path:
            m.register_forward_hook(lambda m, i, o, path=path: outputs.append((path, o)))
    with cg.save_recompute_policy(save_matmuls) as region:
        model(x)
    assert outputs
    for path, t in outputs:
        h = region.lookup(t)
        assert h is not None, path
        e = region.explain(t)
        assert e.kept == h.kept and e.nbytes == h.nbytes
        assert e.saved_count == sum(1 for _, s in region.saved if s is h)
        text = str(e)
        assert text.startswith(e.value) and e.why in text
        if not e.kept:
            assert e.recompute_ops >= 1 and e.sources


# --------------------------------------------------------------------------- memory timeline
def test_backward_of_a_region_shows_recompute_phase() -> None:
    model, x = make_model("mlp")

    def step() -> None:
        with cg.save_recompute_policy("recompute_all") as region:
            y = model(x)
        _backward(y)
        boxes.append(region)

    boxes: list[Any] = []
    report = measure(step)
    recompute = [p for p in report.timeline if p.phase == "recompute"]
    assert any(p.delta_bytes > 0 for p in recompute)
    assert {p.op for p in recompute if p.delta_bytes > 0} <= {
        f"aten::{r.op.split('.')[1]}" for r in boxes[0].graph
    }
    assert boxes[0].summary().recomputed_ops_last_pass > 0


# ------------------------------------------------------------------------------ debug=True
_DRIFT = {"calls": 0}


@torch.library.custom_op("ckpt_graph_analysis_test::drifting", mutates_args=())
def drifting(x: torch.Tensor) -> torch.Tensor:
    """x times the number of calls so far: its recomputation differs from the forward."""
    _DRIFT["calls"] += 1
    return x * _DRIFT["calls"]


@drifting.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


drifting.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, inputs, output: None)


class _Drifts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drifting(self.lin(x)).sin()  # the forward line


@pytest.mark.parametrize("where", ["function", "module"])
def test_debug_names_the_diverging_op_and_the_forward_line(where: str) -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    module = torch.nn.Sequential(_Drifts())
    with cg.save_recompute_policy("recompute_all", debug=True):
        if where == "function":  # noqa: SIM108 (the forward line must stand alone)
            y = drifting(x).sin()  # the forward line
        else:
            y = module(x)
    with pytest.raises(cg.CkptGraphError) as info:
        y.sum().backward()
    message = str(info.value)
    assert message.startswith("ckpt_graph: debug check failed: recomputing op #")
    assert "ckpt_graph_analysis_test.drifting.default" in message
    forward_line = "drifting(x).sin()  # the forward line"
    if where == "module":
        forward_line = "drifting(self.lin(x)).sin()  # the forward line"
        assert inspect.getsourcefile(_Drifts) in message
    assert forward_line in message.split("Forward call:", 1)[1]


def test_debug_without_divergence_changes_nothing() -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for debug in (False, True):
        _DRIFT["calls"] = 0
        with cg.save_recompute_policy("must_save_all", debug=debug):
            y = drifting(x).sin()  # kept: never recomputed, never checked
        y.sum().backward()


@pytest.mark.parametrize("name", ZOO)
def test_debug_on_the_zoo_matches_eager(name: str) -> None:
    """Random ops (dropout) and BatchNorm replay exactly: no false alarm, same gradients."""
    grads = []
    for debug in (None, True):
        model, x = make_model(name)
        torch.manual_seed(0)
        if debug is None:
            y = model(x)
        else:
            with cg.save_recompute_policy("recompute_all", debug=debug):
                y = model(x)
        _backward(y)
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_snapshot_after_writes_through_aliases() -> None:
    # A write through a view is rebased (recomputed, see Note [Mutation and views]); writes
    # through two unsafe chunks, each with a counter of its own, leave a snapshot.
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        h = x * 2
        a, b = h.unsafe_chunk(2, 1)
        a.mul_(3)  # changes h through an alias
        b.mul_(3)
        y = h.sin()  # the engine takes h as it is now
    s = region.summary()
    assert s.kept_bytes["snapshot"] == h.nbytes
    assert s.total_kept_bytes == 0 and s.kept_by == {}
    e = region.explain(h)
    assert (e.kept, e.op_index, e.decided_by) == (True, -1, e.reason)
    assert e.reason is not None and e.reason.startswith("engine: ") and e.reason in e.why
    assert "engine snapshots" in str(s)
    del y


def test_to_networkx_merges_values_from_one_producer() -> None:
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    with cg.save_recompute_policy("recompute_all") as region:
        a, b, c = x.sin().split(2)
        y = torch.cat([c, a]).exp()
    g = region.to_networkx()
    split = next(r.index for r in region.graph if r.op == "aten.split.Tensor")
    cat = next(r.index for r in region.graph if r.op == "aten.cat.default")
    edge = g.edges[split, cat]
    assert (edge["outputs"], edge["nbytes"], edge["kept"]) == ((2, 0), 2 * 64, (None, None))
    del b, y
