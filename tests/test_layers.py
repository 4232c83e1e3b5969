"""The package's import direction: each stage imports only the stages below it.

See the README's "Code map". Stages, lowest first; a module may import its own stage and any
stage listed before it. The check reads every ``import`` statement of every module (function-
level imports included), so a late import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_graph"

# Lowest first. A module's stage is the longest prefix listed here.
STAGES: list[tuple[str, ...]] = [
    ("ckpt_graph._errors", "ckpt_graph._sizes", "ckpt_graph.memory"),
    ("ckpt_graph.engine",),
    ("ckpt_graph.grads", "ckpt_graph.nn"),
    ("ckpt_graph.policies",),
    ("ckpt_graph.planner",),
    ("ckpt_graph.analysis",),
    ("ckpt_graph.integrations",),
    ("ckpt_graph.compare",),
    ("ckpt_graph", "ckpt_graph.__main__"),
]

# Upward imports allowed on purpose, each with its reason.
ALLOWED: dict[tuple[str, str], str] = {
    # Region.summary()/explain()/graph/to_networkx() are shortcuts that call the analysis
    # functions at call time; the engine never needs analysis to record or realize.
    ("ckpt_graph.engine.region", "ckpt_graph.analysis"): "introspection shortcuts",
    # The public facade of ckpt_graph.policies re-exports the planner's memory_budget.
    ("ckpt_graph.policies", "ckpt_graph.planner.memory_budget"): "public facade",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _stage(module: str) -> int:
    best, best_len = -1, -1
    for level, prefixes in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    assert best >= 0, f"{module} is in no stage: add it to STAGES"
    return best


def _imports(path: Path, module: str) -> set[str]:
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from ckpt_graph.x import sub` may name a submodule.
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m == "ckpt_graph" or m.startswith("ckpt_graph.")}


MODULES = sorted(PACKAGE.rglob("*.py"))


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_point_down(path: Path) -> None:
    module = _module_name(path)
    mine = _stage(module)
    upward = []
    for target in sorted(_imports(path, module)):
        if not _is_module(target) or target == "ckpt_graph":
            continue  # a name imported from a module, or the top-level facade's own package
        if _stage(target) > mine and not any(
            module == m and (target == t or target.startswith(t + ".")) for m, t in ALLOWED
        ):
            upward.append(target)
    assert not upward, f"{module} imports {upward} from a later stage; see the README's Code map"
