"""No module reads the private fields of the region, of the objects that own its state, of
the policy context, or of the ``memory_budget`` policy and its parts.

The rule, checked on the syntax tree of every module of the package, the tests and the
benchmarks: an attribute ``<expr>._name`` (or ``getattr``/``setattr``/``hasattr``/
``delattr`` with the constant ``"_name"``) where ``_name`` is a private attribute or method
of one of the owner classes below may appear only in the module that defines that class,
or on ``self`` / ``cls``. Private names are the ``self._name`` attributes a class assigns
and the ``_name`` methods it defines (dunders excluded).
"""

from __future__ import annotations

import ast
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
