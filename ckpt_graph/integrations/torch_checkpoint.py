"""Drop-ins for ``torch.utils.checkpoint``: ``checkpoint_sequential`` and a scoped global patch.

``ckpt_graph.checkpoint`` itself takes torch's keyword arguments (see Note [checkpoint as a
drop-in for torch's] in api.py); this module adds torch's sequential helper and a context
manager that makes code calling ``torch.utils.checkpoint.checkpoint`` use regions.

Example:
    >>> import ckpt_graph as cg
    >>> with cg.patch_torch_checkpoint():  # doctest: +SKIP
    ...     loss = third_party_model(x).sum()  # its torch.utils.checkpoint calls open regions
    >>> loss.backward()
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine.api import checkpoint

__all__ = ["checkpoint_sequential", "patch_torch_checkpoint"]


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    *,
    policy: Any = "recompute_all",
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint_sequential`` with one region per segment.

    As torch's: the functions (a ``Sequential``'s children, or a list) are cut into
    ``segments`` runs of ``len // segments``; every run but the last is checkpointed, the
    last runs as is (its activations are needed right away by backward).

    Args:
        functions: an ``nn.Sequential`` or a list of modules / functions applied in order.
        segments: the number of runs.
        input: the input of the first function.
        use_reentrant: accepted for torch compatibility; no effect.
        policy: the policy of each segment's region.
        **kwargs: the keyword arguments ``ckpt_graph.checkpoint`` takes from torch
            (``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug``).

    Raises:
        CkptGraphError: ``segments`` is not between 1 and the number of functions.

    Example:
        >>> y = cg.checkpoint_sequential(torch.nn.Sequential(*blocks), 4, x)
    """
    if isinstance(functions, torch.nn.Sequential):
        fns: list[Callable[..., Any]] = list(functions.children())
    else:
        fns = list(functions)
    if not 1 <= segments <= max(len(fns), 1):
        raise CkptGraphError(
            f"ckpt_graph: checkpoint_sequential(segments={segments}) needs 1 <= segments <= "
            f"{len(fns)} (the number of functions); pass a segment count in that range"
        )
    size = len(fns) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(_run_range(fns, start, end), input, policy=policy, **kwargs)
    return _run_range(fns, end + 1, len(fns) - 1)(input)


def _run_range(fns: list[Callable[..., Any]], start: int, end: int) -> Callable[[Any], Any]:
    """The function applying ``fns[start..end]`` (inclusive) in order."""

    def run(value: Any) -> Any:
        for fn in fns[start : end + 1]:
            value = fn(value)
        return value

    return run


# Note [Patching torch's checkpoint]
# ``patch_torch_checkpoint`` replaces the attributes ``checkpoint`` and
# ``checkpoint_sequential`` of the module ``torch.utils.checkpoint`` while it is entered, so
# that code calling ``torch.utils.checkpoint.checkpoint(...)`` (an attribute lookup at call
# time) opens regions instead. On exit the attributes it found are put back, also when the
# block raises. Rules:
#   1. The patch is process-wide (a module attribute): it also affects other threads during
#      the block. Entries nest; each exit restores what its entry found, so blocks must be
#      left in reverse order (``with`` does that); one left out of order raises.
#   2. A name bound before the block (``from torch.utils.checkpoint import checkpoint`` at
#      import time, as transformers does) still refers to torch's function: the patch cannot
#      reach it. For transformers models use ``ckpt_graph.integrations.transformers.enable``.
#   3. Backward may run after the block: the regions opened inside it are complete objects and
#      need no patch to recompute.


class patch_torch_checkpoint:
    """Make ``torch.utils.checkpoint.checkpoint`` open ckpt_graph regions inside the block.

    See Note [Patching torch's checkpoint] for the scope of the patch.

    Args:
        policy: the policy of every region the patched functions open.

    Example:
        >>> with cg.patch_torch_checkpoint(policy=cg.policies.save_matmuls()):  # doctest: +SKIP
        ...     loss = model(x).sum()  # model calls torch.utils.checkpoint.checkpoint
        >>> loss.backward()
    """

    _lock = threading.Lock()

    def __init__(self, policy: Any = "recompute_all") -> None:
        self.policy = policy
        self._saved: tuple[Any, Any] | None = None
        self._installed: tuple[Any, Any] | None = None

    def __enter__(self) -> patch_torch_checkpoint:
        if self._saved is not None:
            raise CkptGraphError(
                "ckpt_graph: a patch_torch_checkpoint block cannot be entered twice"
            )
        patched = (
            functools.partial(checkpoint, policy=self.policy),
            functools.partial(checkpoint_sequential, policy=self.policy),
        )
        with self._lock:
            self._saved = (torch_checkpoint.checkpoint, torch_checkpoint.checkpoint_sequential)
            torch_checkpoint.checkpoint, torch_checkpoint.checkpoint_sequential = patched  # type: ignore[assignment]
        self._installed = patched
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None and self._installed is not None
        with self._lock:
            current = (torch_checkpoint.checkpoint, torch_checkpoint.checkpoint_sequential)
            if current != self._installed:
                raise CkptGraphError(
                    "ckpt_graph: patch_torch_checkpoint blocks were left out of order (or "
                    "torch.utils.checkpoint.checkpoint was replaced inside the block); leave "
                    "nested blocks in reverse order of entry, e.g. with `with` statements"
                )
            torch_checkpoint.checkpoint, torch_checkpoint.checkpoint_sequential = self._saved
        self._saved = self._installed = None

    def __repr__(self) -> str:
        return f"patch_torch_checkpoint(policy={self.policy!r})"
