"""The package's import direction: each stage imports only the stages below it.

See the README's "Code map". Stages, lowest first; a module may import its own stage and any
stage listed before it. The check reads every ``import`` statement of every module (function-
level imports included), so a late import cannot hide an upward dependency. Inside the
planner, each module imports only the planner layers below it, only the adapters import the
engine, and its records are imported from ``records`` (Note [Planner layers]).
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


def _import_target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` in ``module`` names, relative ones resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, module: str) -> set[str]:
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(node, module, is_package)
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


# The planner's own layers: see Note [Planner layers] in ckpt_graph/planner/__init__.py.

PLANNER = "ckpt_graph.planner"

# layer -> (its modules, the layers it builds on)
PLANNER_LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "graph": (("sim_graph",), ()),
    "simulator": (("liveness",), ("graph",)),
    "records": (("records",), ("graph",)),
    "solver": (
        ("seeds", "hand_seeds", "milp", "local_search", "solve"),
        ("graph", "simulator", "records"),
    ),
    "adapters": (
        (
            "from_region",
            "permuted_gradients",
            "param_grads",
            "workspaces",
            "cost_model",
            "region_graph",
            "blocks",
            "compile_solver",
        ),
        ("graph", "simulator", "records", "solver"),
    ),
    "plans": (
        ("forward_memory", "plans", "menus", "step_budget", "across_sizes"),
        ("graph", "simulator", "records", "solver"),
    ),
    "policy parts": (
        ("budget_heuristic", "budget_report", "budget_check", "step_tracker", "budget_planner"),
        ("graph", "simulator", "records", "solver", "adapters", "plans"),
    ),
    "policy": (
        ("memory_budget",),
        ("graph", "simulator", "records", "solver", "adapters", "plans", "policy parts"),
    ),
}

# Layers whose modules depend on no torch (``_framework_free``).
FRAMEWORK_FREE_LAYERS = ("graph", "simulator", "records", "solver")

PLANNER_ALLOWED: dict[tuple[str, str], str] = {
    # StepPlan.__str__ prints the table of budget_report (Note [Budget reports]), imported
    # when a plan is printed; the records never need it to be built or read.
    ("records", "ckpt_graph.planner.budget_report"): "the step plan's table",
    # The hand seeds read the names of the matmul ops (strings) from the built-in policy that
    # saves them, so both agree on what a matmul is; no engine object is used.
    ("hand_seeds", "ckpt_graph.policies.builtins"): "matmul op names",
}

# Modules that re-export records on purpose: the policy's public names (``ckpt_graph.policies``
# re-exports them) and the simulator's graph types next to ``simulate``.
REEXPORTS: dict[str, frozenset[str]] = {
    "ckpt_graph.planner.memory_budget": frozenset({"KeptTensor", "PlanReport", "StepPlan"}),
    "ckpt_graph.planner.liveness": frozenset({"SimGraph", "SimOp", "SimResult", "SimValue"}),
}

# Record classes other modules import that stay where they are built, with the reason.
RECORDS_ELSEWHERE: dict[str, str] = {
    # The policy's report extends PlanReport with its step and prints it with budget_report's
    # tables; only memory_budget builds one.
    "BudgetReport": "the policy's report, with its table",
    # The block finder's answer carries the engine's module-call records (an adapter's
    # result); the solver layers below never see it, only the block numbers.
    "Blocks": "the block finder's answer, with engine module calls",
}

RECORD_HOMES = (f"{PLANNER}.records", f"{PLANNER}.sim_graph")


def _layer_of(module: str) -> str:
    name = module.removeprefix(PLANNER + ".")
    for layer, (members, _) in PLANNER_LAYERS.items():
        if name in members:
            return layer
    raise AssertionError(f"{module} is in no planner layer: add it to PLANNER_LAYERS")


def _typed_imports(path: Path, module: str) -> list[tuple[str, str | None, bool]]:
    """Every import of ``path``: (module imported, name imported or None, under TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    out: list[tuple[str, str | None, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, None, type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(node, module, is_package)
            for a in node.names:
                sub = f"{target}.{a.name}"
                if _is_module(sub):  # `from ckpt_graph.x import sub` names a submodule
                    out.append((sub, None, type_only))
                else:
                    out.append((target, a.name, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(path.read_text()), False)
    return out


def _path_of(module: str) -> Path:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _framework_free(module: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``module`` imports no torch, directly or through the ckpt_graph modules it
    imports (TYPE_CHECKING imports included; the packages' ``__init__`` files are not
    followed: they are facades, not dependencies of the code)."""
    if module in seen:
        return True
    for target, _, _ in _typed_imports(_path_of(module), module):
        root = target.split(".")[0]
        if root == "torch":
            return False
        if (
            root == "ckpt_graph"
            and _is_module(target)
            and _path_of(target).name != "__init__.py"
            and not _framework_free(target, seen | {module})
        ):
            return False
    return True


PLANNER_MODULES = sorted((PACKAGE / "planner").glob("*.py"))
PLANNER_MODULES = [p for p in PLANNER_MODULES if p.name != "__init__.py"]


@pytest.mark.parametrize("path", PLANNER_MODULES, ids=lambda p: _module_name(p))
def test_planner_layers(path: Path) -> None:
    """Note [Planner layers]: imports between planner modules go down the planner's layers."""
    module = _module_name(path)
    layer = _layer_of(module)
    below = {layer, *PLANNER_LAYERS[layer][1]}
    name = module.removeprefix(PLANNER + ".")
    wrong = []
    for target, _, _ in _typed_imports(path, module):
        if (
            target.startswith(PLANNER + ".")
            and _is_module(target)
            and _layer_of(target) not in below
            and (name, target) not in PLANNER_ALLOWED
        ):
            wrong.append(f"{target} ({_layer_of(target)})")
    assert not wrong, (
        f"{module} ({layer}) imports {sorted(set(wrong))}; it may import only the layers "
        f"{sorted(below)}: see Note [Planner layers] in ckpt_graph/planner/__init__.py"
    )


@pytest.mark.parametrize("path", PLANNER_MODULES, ids=lambda p: _module_name(p))
def test_only_adapters_import_the_engine(path: Path) -> None:
    """Note [Planner layers]: the engine is imported by the adapters; the simulator's pass rules
    are framework-free; the policy names the region's type only."""
    module = _module_name(path)
    layer = _layer_of(module)
    wrong = []
    for target, _, type_only in _typed_imports(path, module):
        if not (target == "ckpt_graph.engine" or target.startswith("ckpt_graph.engine.")):
            continue
        if layer == "adapters":
            continue
        if layer in ("graph", "simulator") and _framework_free(target):
            continue
        if (
            layer in ("policy", "policy parts")
            and type_only
            and target == "ckpt_graph.engine.region"
        ):
            continue
        wrong.append(target + (" (TYPE_CHECKING)" if type_only else ""))
    assert not wrong, (
        f"{module} ({layer}) imports the engine: {sorted(set(wrong))}; only the adapters "
        f"{list(PLANNER_LAYERS['adapters'][0])} do (Note [Planner layers])"
    )


@pytest.mark.parametrize(
    "path",
    [p for p in PLANNER_MODULES if _layer_of(_module_name(p)) in FRAMEWORK_FREE_LAYERS],
    ids=lambda p: _module_name(p),
)
def test_simulator_and_solver_are_framework_free(path: Path) -> None:
    """Note [Planner layers]: graph, simulator, records and solver work on the simulator's graph
    alone; what they import from outside the planner depends on no torch."""
    module = _module_name(path)
    name = module.removeprefix(PLANNER + ".")
    wrong = []
    for target, _, _ in _typed_imports(path, module):
        root = target.split(".")[0]
        if (name, target) in PLANNER_ALLOWED or target.startswith(PLANNER + "."):
            continue
        if root == "torch" or (root == "ckpt_graph" and not _framework_free(target)):
            wrong.append(target)
    assert not wrong, (
        f"{module} depends on torch through {sorted(set(wrong))} (Note [Planner layers])"
    )


def _record_classes(path: Path) -> set[str]:
    """Classes of ``path`` that are plain records: dataclasses and NamedTuples."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
        is_dataclass = any(
            (isinstance(d, ast.Name) and d.id == "dataclass")
            or (isinstance(d, ast.Attribute) and d.attr == "dataclass")
            for d in decorators
        )
        is_tuple = any(isinstance(b, ast.Name) and b.id == "NamedTuple" for b in node.bases)
        if is_dataclass or is_tuple:
            found.add(node.name)
    return found


RECORDS: dict[str, str] = {
    name: _module_name(p) for p in PLANNER_MODULES for name in _record_classes(p)
}

IMPORTERS = MODULES + [
    p
    for folder in ("tests", "benchmarks", "examples")
    for p in sorted((PACKAGE.parent / folder).rglob("*.py"))
]


def _importer_name(path: Path) -> str:
    if path.is_relative_to(PACKAGE):
        return _module_name(path)
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


@pytest.mark.parametrize("path", IMPORTERS, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_records_are_imported_from_their_module(path: Path) -> None:
    """Rule 3 of Note [Planner layers]: a planner record is defined in ``records`` (or the
    simulator's ``sim_graph``) and imported from there or from a re-export in REEXPORTS."""
    module = _importer_name(path)
    wrong = []
    for target, name, _ in _typed_imports(path, module):
        if name is None or name not in RECORDS or not target.startswith(PLANNER):
            continue
        home = RECORDS[name]
        if target == module:
            continue
        if home not in RECORD_HOMES and name not in RECORDS_ELSEWHERE:
            wrong.append(f"{name} is defined in {home}, not in records")
        elif target != home and name not in REEXPORTS.get(target, ()):
            wrong.append(f"{name} imported from {target}, not from {home}")
    assert not wrong, f"{module}: " + "; ".join(wrong)
