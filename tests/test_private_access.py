"""No module reads another module's private names: the private fields of the region, of the
objects that own its state, of the policy context, of the ``memory_budget`` policy and its
parts, and the private module-level names (functions, classes, constants) of any module of
the package.

Two rules, checked on the syntax tree of every module of the package, the tests and the
benchmarks (rule 2 also on the examples and the notebooks' code cells):

1. Fields: an attribute ``<expr>._name`` (or ``getattr``/``setattr``/``hasattr``/``delattr``
   with the constant ``"_name"``) where ``_name`` is a private attribute or method of one of
   the owner classes below may appear only in the module that defines that class, or on
   ``self`` / ``cls``. Private names are the ``self._name`` attributes a class assigns and the
   ``_name`` methods it defines (dunders excluded).
2. Module-level names: ``from ckpt_graph.x import _name``, ``module._name`` on a name bound
   to a ckpt_graph module (``import ckpt_graph as cg; cg.memory._name``, ``from
   ckpt_graph.engine import flops; flops._name``), ``getattr``/``setattr``/``hasattr``/
   ``delattr``/``monkeypatch.setattr`` of ``"_name"`` on such a module, or the dotted string
   ``"ckpt_graph.x._name"``, may appear only in the module ``x`` itself. A private *module*
   (``ckpt_graph._errors``, ``ckpt_graph.nn._abn_function``) may be imported: its names
   without an underscore are the package's internal interface. Names a module shares with
   others have no underscore and stay out of ``ckpt_graph.__all__``.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module (relative to the repository) -> the classes whose private state it owns
OWNERS = {
    "ckpt_graph/engine/region.py": ("Region",),
    "ckpt_graph/engine/policy_stack.py": ("PolicyStack",),
    "ckpt_graph/engine/saved_log.py": ("SavedLog",),
    "ckpt_graph/engine/recording_state.py": ("RecordingState",),
    "ckpt_graph/engine/decisions.py": ("PolicyContext",),
    "ckpt_graph/engine/lowering.py": ("CompileContext",),
    "ckpt_graph/planner/memory_budget.py": ("MemoryBudget",),
    "ckpt_graph/planner/step_tracker.py": ("StepTracker",),
    "ckpt_graph/planner/budget_planner.py": ("BudgetPlanner", "_PlanCache"),
}
# Reads of a third party's private attribute that shares a name with an owner's, allowed in
# the modules named (the rule matches names, not types), each with its reason.
THIRD_PARTY = {
    ("ckpt_graph/engine/record.py", "_op"): "torch's OpOverload._op, the C++ op it forwards to",
    ("ckpt_graph/engine/replay.py", "_op"): "torch's OpOverload._op, the C++ op it forwards to",
}
EXEMPT: set[str] = set()
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names(source: str, classes: tuple[str, ...]) -> set[str]:
    """The private attributes and methods the named classes of ``source`` define."""
    names: set[str] = set()
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef) or cls.name not in classes:
            continue
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                names.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and _is_private(node.attr)
            ):
                names.add(node.attr)
    return names


def reads_of(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each access to one of ``names`` not made on ``self``/``cls``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ACCESSORS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            found.append((node.lineno, str(node.args[1].value)))
    return sorted(found)


def _owned() -> dict[str, set[str]]:
    return {
        module: private_names((ROOT / module).read_text(), classes) - EXEMPT
        for module, classes in OWNERS.items()
    }


def test_owner_classes_define_the_private_names_checked() -> None:
    owned = _owned()
    # Guards the collection itself: a rename of a class or module must not empty the rule.
    assert {"_open", "_closed", "_release", "_exits"} <= owned["ckpt_graph/engine/region.py"]
    assert "_pairs" in owned["ckpt_graph/engine/saved_log.py"]
    assert "_update_constant" in owned["ckpt_graph/engine/policy_stack.py"]
    assert "_pass" not in owned["ckpt_graph/engine/region.py"]
    assert {"_op", "_out", "_args"} <= owned["ckpt_graph/engine/decisions.py"]
    assert {"_runs", "_compile_solver"} <= owned["ckpt_graph/planner/memory_budget.py"]
    assert {"_plans", "_cache", "_plan_region"} <= owned["ckpt_graph/planner/budget_planner.py"]
    assert "_regions" in owned["ckpt_graph/planner/step_tracker.py"]


def test_the_rule_finds_reads_and_skips_self() -> None:
    source = (
        "def f(region, h):\n"
        "    region._open = False\n"
        "    self._open = True\n"
        "    x = getattr(region, '_closed')\n"
        "    return h.region._release()\n"
    )
    names = {"_open", "_closed", "_release"}
    assert reads_of(source, names) == [(2, "_open"), (4, "_closed"), (5, "_release")]


def test_no_module_reads_private_state_of_the_region_or_its_owners() -> None:
    owned = _owned()
    bad: list[str] = []
    for top in ("ckpt_graph", "tests", "benchmarks"):
        for file in sorted((ROOT / top).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            source = file.read_text()
            for module, names in owned.items():
                if module != path:
                    bad += [
                        f"{path}:{line}: {name} (private to {module})"
                        for line, name in reads_of(source, names)
                        if (path, name) not in THIRD_PARTY
                    ]
    assert not bad, "use the owner's public attributes instead:\n" + "\n".join(bad)


# Rule 2: private module-level names other modules may read, each with its reason.
MODULE_EXEMPT = {
    ("tests/conftest.py", "ckpt_graph.memory._abandon_probes"): (
        "test isolation: a memory_budget probe left running by a test that ended before its "
        "policy's next step is stopped after each test; a program stops it at exit (atexit), "
        "so the library has no public call for it"
    ),
}
_DOTTED = re.compile(r"^ckpt_graph(?:\.\w+)*\._\w+$")


def _module_file(dotted: str) -> Path | None:
    """The file of the ckpt_graph module ``dotted``, or None if it names no module."""
    base = ROOT.joinpath(*dotted.split("."))
    for file in (base.with_suffix(".py"), base / "__init__.py"):
        if file.is_file():
            return file
    return None


def _module_of(path: str) -> str:
    """``ckpt_graph/engine/api.py`` -> ``ckpt_graph.engine.api`` (packages: their __init__)."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.ImportFrom, path: str) -> str:
    """The absolute module name of ``from <module> import ...`` in the file ``path``."""
    if not node.level:
        return node.module or ""
    package = _module_of(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def _dotted(expr: ast.expr, bound: dict[str, str]) -> str | None:
    """``a.b.c`` with the root name replaced by the ckpt_graph module it is bound to."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in bound:
        return None
    return ".".join([bound[expr.id], *reversed(parts)])


def private_module_names(source: str, path: str) -> list[tuple[int, str]]:
    """``(line, "ckpt_graph.module._name")`` for each use in ``source`` (the file ``path``) of
    a private module-level name of a ckpt_graph module other than ``path``'s own."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the ckpt_graph module or name it stands for
    found: list[tuple[int, str]] = []

    def use(line: int, owner: str, name: str) -> None:
        # A private submodule (``_errors``) may be imported; its own names are checked.
        if (
            _is_private(name)
            and _module_file(owner) is not None
            and _module_file(f"{owner}.{name}") is None
        ):
            found.append((line, f"{owner}.{name}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ckpt_graph":
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["ckpt_graph"] = "ckpt_graph"
        elif isinstance(node, ast.ImportFrom):
            module = _imported(node, path)
            if module.split(".")[0] != "ckpt_graph":
                continue
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{module}.{alias.name}"
                use(node.lineno, module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (owner := _dotted(node.value, bound)):
            use(node.lineno, owner, node.attr)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name not in _ACCESSORS:
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                if _DOTTED.match(first.value):  # monkeypatch.setattr("ckpt_graph.x._name", v)
                    owner, _, attr = first.value.rpartition(".")
                    use(node.lineno, owner, attr)
            elif (
                len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and (owner := _dotted(first, bound))
            ):
                use(node.lineno, owner, node.args[1].value)
    own = _module_of(path)
    return sorted((line, name) for line, name in found if name.rpartition(".")[0] != own)


def _sources() -> list[tuple[str, str]]:
    """``(path, source)`` of every module of the package, test, benchmark, example and
    notebook."""
    out: list[tuple[str, str]] = []
    for top in ("ckpt_graph", "tests", "benchmarks", "examples", "notebooks"):
        for file in sorted((ROOT / top).rglob("*.py")):
            out.append((file.relative_to(ROOT).as_posix(), file.read_text()))
    for file in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(file.read_text())["cells"]
        code = [
            "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells
            if c["cell_type"] == "code"
        ]
        out.append((file.relative_to(ROOT).as_posix(), "\n\n".join(code)))
    return out


def test_the_module_rule_finds_private_names_of_other_modules() -> None:
    source = (
        "import ckpt_graph as cg\n"
        "import ckpt_graph.engine.flops\n"
        "from ckpt_graph.engine import replay\n"
        "from ckpt_graph.engine.api import _x, checkpoint\n"
        "from ckpt_graph.nn import _abn_function\n"
        "from ckpt_graph._errors import CkptGraphError\n"
        "from .replay import _y\n"
        "def f(monkeypatch):\n"
        "    cg.memory._probe()\n"
        "    ckpt_graph.engine.flops._MEMO.clear()\n"
        "    replay._z, replay.exact_copy, cg.Region._w\n"
        "    monkeypatch.setattr(replay, '_v', None)\n"
        "    monkeypatch.setattr('ckpt_graph.memory._u', None)\n"
        "    getattr(_abn_function, '_t')\n"
    )
    assert private_module_names(source, "ckpt_graph/engine/realize.py") == [
        (4, "ckpt_graph.engine.api._x"),
        (7, "ckpt_graph.engine.replay._y"),
        (9, "ckpt_graph.memory._probe"),
        (10, "ckpt_graph.engine.flops._MEMO"),
        (11, "ckpt_graph.engine.replay._z"),
        (12, "ckpt_graph.engine.replay._v"),
        (13, "ckpt_graph.memory._u"),
        (14, "ckpt_graph.nn._abn_function._t"),
    ]
    # A module's own names are its own: replay.py may read ``replay._z``.
    assert (11, "ckpt_graph.engine.replay._z") not in private_module_names(
        source, "ckpt_graph/engine/replay.py"
    )


def test_no_module_reads_private_module_level_names_of_another() -> None:
    bad: list[str] = []
    used: set[tuple[str, str]] = set()
    for path, source in _sources():
        for line, name in private_module_names(source, path):
            if (path, name) in MODULE_EXEMPT:
                used.add((path, name))
            else:
                bad.append(f"{path}:{line}: {name}")
    assert not bad, (
        "give the name a home: no underscore in the module that owns the concept (not in "
        "ckpt_graph.__all__), or move it to the module that uses it:\n" + "\n".join(bad)
    )
    assert used == set(MODULE_EXEMPT), f"stale exemptions: {set(MODULE_EXEMPT) - used}"
