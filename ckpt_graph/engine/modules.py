"""Which nn.Module forward is running: the module path policies see as ``ctx.module_path``.

# Note [Module path tracking]
# Global module forward hooks are installed while at least one region is open in any
# thread (reference counted under a lock) and removed when the last one closes, so code
# outside regions pays nothing. Each hook looks up the thread's open region and returns at
# once if there is none. The region keeps a stack of running modules; names are qualified
# names relative to the outermost module called inside the region, computed once per
# outermost module with ``named_modules()``. A module that is not a submodule of it is
# named after its class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as _module

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["ModuleCall", "ModuleStack", "install_hooks", "uninstall_hooks"]


class ModuleCall:
    """One forward call of a module inside a region. See Note [Module path tracking].

    Attributes:
        index: the call's position among the region's module calls, in call order.
        cls: the module's class.
        module_id: ``id()`` of the module (the module is alive while the region records).
        parent: the call of the module whose forward made this call; ``None`` outermost.
        path: the module's qualified name, as ``ctx.module_path`` says it.
    """

    __slots__ = ("cls", "index", "module_id", "parent", "path")

    def __init__(
        self, index: int, cls: type, module_id: int, parent: ModuleCall | None, path: str
    ) -> None:
        self.index = index
        self.cls = cls
        self.module_id = module_id
        self.parent = parent
        self.path = path

    def __repr__(self) -> str:
        return f"ModuleCall({self.index}, {self.cls.__name__}, {self.path!r})"


class ModuleStack:
    """The modules whose forward is running in one region, outermost first."""

    __slots__ = (
        "_calls",
        "_count",
        "_names",
        "_paths",
        "_root",
        "_stack",
        "current_call",
        "current_path",
    )

    def __init__(self) -> None:
        self._stack: list[torch.nn.Module] = []
        self._paths: list[str] = []
        self._root: torch.nn.Module | None = None
        self._names: dict[int, str] = {}
        self.current_path = ""  # path() of the top of the stack, kept up to date
        self._calls: list[ModuleCall] = []
        self._count = 0  # calls so far in the region: ModuleCall.index
        self.current_call: ModuleCall | None = None  # the top of the stack's call record

    def push(self, module: torch.nn.Module) -> None:
        if not self._stack and module is not self._root:
            self._root = module
            self._names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        self._stack.append(module)
        name = self._names.get(id(module))
        self.current_path = name if name is not None else type(module).__name__
        self._paths.append(self.current_path)
        call = ModuleCall(
            self._count, type(module), id(module), self.current_call, self.current_path
        )
        self._count += 1
        self._calls.append(call)
        self.current_call = call

    def pop(self, module: torch.nn.Module) -> None:
        # A forward that raised may leave entries above ``module``: unwind to it.
        while self._stack:
            self._paths.pop()
            self._calls.pop()
            if self._stack.pop() is module:
                break
        self.current_path = self._paths[-1] if self._paths else ""
        self.current_call = self._calls[-1] if self._calls else None

    def current(self) -> torch.nn.Module | None:
        return self._stack[-1] if self._stack else None

    def path(self) -> str:
        return self.current_path

    def clear(self) -> None:
        self._stack.clear()
        self._paths.clear()
        self._calls.clear()
        self.current_path = ""
        self.current_call = None
        self._root = None
        self._names = {}


_lock = threading.Lock()
_installed: list[RemovableHandle] = []
_users = 0


# ``region.current_region``, given by the first ``install_hooks`` (region.py imports this
# module, so the hooks cannot import it at module level, and an import per call costs).
_current_region: Callable[[], Any] = lambda: None  # noqa: E731


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    region = _current_region()
    if region is not None:
        region.module_stack.push(module)


def _post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    region = _current_region()
    if region is not None:
        region.module_stack.pop(module)


def install_hooks(current_region: Callable[[], Any]) -> None:
    """Install the global module hooks (reference counted); ``current_region`` gives the
    region open in the calling thread."""
    global _users, _current_region
    with _lock:
        _current_region = current_region
        _users += 1
        if _users == 1:
            _installed.append(_module.register_module_forward_pre_hook(_pre_hook))
            _installed.append(_module.register_module_forward_hook(_post_hook, always_call=True))


def uninstall_hooks() -> None:
    """Drop one reference; remove the hooks when no region is open."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for h in _installed:
                h.remove()
            _installed.clear()
