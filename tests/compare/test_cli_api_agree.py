"""The command line and the API accept the same budgets and policy names (issue 21 item 16).

See Note [Budget argument] in ckpt_graph/planner/cost_model.py and Note [Policy names] in
ckpt_graph/engine/decisions.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import ckpt_graph as cg
from ckpt_graph.compare import cli
from ckpt_graph.engine.decisions import policy_names
from ckpt_graph.policies import memory_budget, save_matmuls

TINY = ["--model", "mlp", "--layers", "2", "--width", "16", "--batch", "2", "--repeat", "1"]

BUDGET_TEXTS = [
    "1",  # one byte: refused by both, where the command line used to read 100%
    "0",
    "1.0",
    "0.5",
    "2e-1",
    "40%",
    "4096",
    "1023",
    "300000",
    "64MiB",
    "1.5 KB",
    "1e6",
    "1.5",
    "ten",
    "3PB",
]


@pytest.mark.parametrize("text", BUDGET_TEXTS)
def test_budget_text_means_the_same_on_the_command_line_and_in_the_api(text: str) -> None:
    try:
        api = memory_budget(text).budget
    except cg.CkptGraphError as e:
        with pytest.raises(cli.UsageError) as got:
            cli.parse_budget(text)
        assert str(got.value) == f"--budget {text!r}: {str(e).removeprefix('ckpt_graph: ')}"
        return
    got_cli = cli.parse_budget(text)
    assert got_cli == api and type(got_cli) is type(api)


def test_budget_one_is_one_byte_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    hint = "If you meant 100% of the activation memory, pass the float 1.0"
    with pytest.raises(cg.CkptGraphValueError, match=re.escape(hint)):
        memory_budget(1)
    with pytest.raises(cg.CkptGraphValueError, match=re.escape(hint)):
        memory_budget("1")
    assert cli.main(["compare", *TINY, "--budget", "1"]) == 2
    assert hint in capsys.readouterr().err
    assert cli.parse_budget("1.0") == memory_budget(1.0).budget == 1.0


def test_the_command_line_offers_exactly_the_api_names() -> None:
    compare = cli.build_parser()._subparsers._group_actions[0].choices["compare"]  # type: ignore[union-attr]
    help_text = " ".join(compare.format_help().split())
    assert f"one of {', '.join(policy_names())} (the names" in help_text
    assert policy_names() == ("recompute_all", "must_save_all", "save_matmuls")


def _grads(policy: object) -> tuple[list[torch.Tensor], cg.Region | None]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    if policy is None:
        model(x).pow(2).sum().backward()
        return [p.grad for p in model.parameters()], None  # type: ignore[misc]
    with cg.save_recompute_policy(policy) as region:
        y = model(x).pow(2).sum()
    y.backward()
    return [p.grad for p in model.parameters()], region  # type: ignore[misc]


@pytest.mark.parametrize("name", policy_names())
def test_every_name_works_in_the_api(name: str) -> None:
    eager, _ = _grads(None)
    got, region = _grads(name)
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert region is not None


def test_save_matmuls_by_name_keeps_what_the_object_keeps() -> None:
    _, by_name = _grads("save_matmuls")
    _, by_object = _grads(save_matmuls())
    assert by_name is not None and by_object is not None
    kept = by_name.summary().kept_by
    assert kept == by_object.summary().kept_by and kept.get("save_matmuls()", 0) > 0


def test_a_name_is_a_fresh_policy_per_region() -> None:
    stacks = []
    for _ in range(2):
        with cg.save_recompute_policy("save_matmuls") as region:
            stacks.append(region.policies)
    assert repr(stacks[0][0]) == "save_matmuls()" and stacks[0][0] is not stacks[1][0]


@pytest.mark.parametrize("name", ["memory_budget", "save_ops", "save_module_outputs"])
def test_a_builtin_that_takes_arguments_says_how_to_call_it(name: str) -> None:
    with pytest.raises(
        cg.CkptGraphValueError,
        match=rf"unknown policy '{name}'; {name} takes arguments, so it has no name: pass the "
        rf"policy, e\.g\. ckpt_graph\.policies\.{name}\(",
    ):
        cg.save_recompute_policy(name)


def test_memory_budget_on_the_command_line_points_to_cg_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["compare", *TINY, "--policy", "memory_budget"]) == 2
    err = capsys.readouterr().err
    assert "memory_budget takes a budget, so it has no name; run strategy cg-budget" in err


def test_policy_by_name_reaches_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.json"
    argv = ["compare", *TINY, "--strategies", "none", "--policy", "save_matmuls", "--no-count"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    results = {r["strategy"]: r for r in json.loads(path.read_text())["results"]}
    assert results["cg-policy"]["status"] == "ok"
    assert results["cg-policy"]["max_grad_diff"] == 0.0
