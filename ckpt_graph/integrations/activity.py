"""What the integrations tell the user: INFO lines on the ``ckpt_graph`` logger, region labels.

# Note [Integrations say when they are active]
# An integration that reaches nothing (a patch no call goes through, an ``enable`` that
# something replaced later) leaves the user with torch's memory and no hint of it. So:
#   1. ``wrap``, ``transformers.enable`` (also when the model's own
#      ``gradient_checkpointing_enable`` is routed to it), the HF and Lightning callbacks and
#      ``patch_torch_checkpoint`` log one INFO line on the ``ckpt_graph`` logger when they
#      install regions: how many modules, of which classes, with which policy.
#   2. The callbacks log the same line on their framework's logger too (Lightning's,
#      transformers'), so that a run shows it among the framework's own lines, at the
#      framework's verbosity.
#   3. A region opened by an integration carries ``Region.opened_by`` (which integration, which
#      module); ``region.summary()`` shows it. A region opened by an outer block keeps the
#      outer block's (empty) label.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from ckpt_graph.engine.api import save_recompute_policy
from ckpt_graph.engine.region import Region, current_region

__all__ = ["announce", "describe_modules", "describe_policy", "labelled_region"]

logger = logging.getLogger("ckpt_graph")


def describe_policy(policy: Any) -> str:
    """A short readable name of a region policy, for log lines.

    Example:
        >>> describe_policy("recompute_all"), describe_policy(policies.memory_budget(0.5))
        ("'recompute_all'", 'memory_budget(0.5)')
    """
    if isinstance(policy, str):
        return repr(policy)
    name = getattr(policy, "__qualname__", None)
    return name if isinstance(name, str) else repr(policy)


def describe_modules(modules: Sequence[torch.nn.Module]) -> str:
    """``"12 modules (GPT2Block x12)"``: how many, of which classes (most frequent first)."""
    classes = Counter(type(m).__name__ for m in modules)
    kinds = ", ".join(f"{name} x{n}" for name, n in classes.most_common())
    noun = "module" if len(modules) == 1 else "modules"
    return f"{len(modules)} {noun} ({kinds})"


def announce(message: str, *framework_loggers: logging.Logger) -> None:
    """Log ``message`` at INFO on the ``ckpt_graph`` logger and on each framework logger.

    See Note [Integrations say when they are active].
    """
    logger.info("%s", message)
    for other in framework_loggers:
        other.info("ckpt_graph: %s", message)


class labelled_region:
    """``save_recompute_policy(policy)`` that labels the region it opens with ``label``.

    The label is ``Region.opened_by``, shown by ``region.summary()``; a block nested in a
    region opened elsewhere leaves that region's label alone. See Note [Integrations say when
    they are active].

    Example:
        >>> with labelled_region("recompute_all", "ckpt_graph.wrap: layers.0") as region:
        ...     y = block(x)
        >>> region.opened_by
        'ckpt_graph.wrap: layers.0'
    """

    __slots__ = ("_block", "label")

    def __init__(self, policy: Any, label: str, debug: bool = False) -> None:
        self._block = save_recompute_policy(policy, debug=debug)
        self.label = label

    def __enter__(self) -> Region:
        opens = current_region() is None
        region = self._block.__enter__()
        if opens:
            region.opened_by = self.label
        return region

    def __exit__(self, *exc: Any) -> None:
        self._block.__exit__(*exc)
