"""Drop-ins for ``torch.utils.checkpoint``: ``checkpoint_sequential`` and a scoped patch.

``ckpt_graph.checkpoint`` itself takes torch's keyword arguments (see Note [checkpoint as a
drop-in for torch's] in api.py); this module adds torch's sequential helper and a context
manager that makes code calling torch's checkpoint (however it bound the name) use regions.

Example:
    >>> import ckpt_graph as cg
    >>> with cg.patch_torch_checkpoint():  # doctest: +SKIP
    ...     loss = third_party_model(x).sum()  # its torch.utils.checkpoint calls open regions
    >>> loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckpt_graph._errors import CkptGraphError
from ckpt_graph.engine.api import checkpoint
from ckpt_graph.integrations.activity import announce, describe_policy
from ckpt_graph.integrations.torch_routing import enter_block, exit_block

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
# ``patch_torch_checkpoint`` makes torch's checkpoint open regions while it is entered, for
# every way of reaching it (the attribute, a name bound at import, torch's
# ``checkpoint_wrapper``, the composable ``checkpoint(module)``): it replaces the internals that
# torch's module looks up at call time, not the public functions. See Note [Routing torch's
# checkpoint calls] in torch_routing.py for how, and for the rules of threads and of backward
# after the block. In short:
#   1. Blocks are counted: entered in several threads, and left in any order, torch's
#      internals are put back when the last one leaves (also when a block raises).
#   2. The region's policy is the block's. Keywords of the call that torch passes to the
#      function (``policy=`` included) reach the function.
#   3. Backward may run after the block: regions are complete objects, and a torch checkpoint
#      replayed in backward takes, for each call inside it, the decision its forward took.
#   4. The block logs an INFO line on the ``ckpt_graph`` logger when entered and when left
#      (how many calls ran in regions); ``calls`` counts them.


class patch_torch_checkpoint:
    """Make torch's checkpoint open ckpt_graph regions inside the block.

    Reaches ``torch.utils.checkpoint.checkpoint`` however the caller bound it (see Note
    [Patching torch's checkpoint]); ``checkpoint_sequential`` goes through it too.

    Args:
        policy: the policy of every region the patched calls open.

    Attributes:
        calls: torch checkpoint calls that ran in regions of this block so far.

    Example:
        >>> with cg.patch_torch_checkpoint(policy=cg.policies.save_matmuls()):  # doctest: +SKIP
        ...     loss = model(x).sum()  # model calls torch.utils.checkpoint.checkpoint
        >>> loss.backward()
    """

    def __init__(self, policy: Any = "recompute_all") -> None:
        self.policy = policy
        self.calls = 0
        self._entered: list[Any] | None = None

    def __enter__(self) -> patch_torch_checkpoint:
        if self._entered is not None:
            raise CkptGraphError(
                "ckpt_graph: a patch_torch_checkpoint block cannot be entered twice"
            )
        self._entered = enter_block(self)
        announce(
            "patch_torch_checkpoint: torch.utils.checkpoint calls run in ckpt_graph regions "
            f"(policy={describe_policy(self.policy)})"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._entered is None:
            raise CkptGraphError(
                "ckpt_graph: a patch_torch_checkpoint block was left without being entered"
            )
        exit_block(self, self._entered)
        self._entered = None
        announce(
            f"patch_torch_checkpoint: left; {self.calls} torch.utils.checkpoint "
            f"call{'' if self.calls == 1 else 's'} ran in ckpt_graph regions"
        )

    def __repr__(self) -> str:
        return f"patch_torch_checkpoint(policy={self.policy!r})"
