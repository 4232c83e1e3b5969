"""Exception types raised by ckpt_graph."""

from __future__ import annotations

__all__ = ["CkptGraphError"]


class CkptGraphError(RuntimeError):
    """An error detected by the ckpt_graph engine.

    Messages start with ``"ckpt_graph: "`` and name the op, the tensor or the policy
    involved, and what to do about it. It subclasses :class:`RuntimeError` so that code
    which catches autograd's own errors (for example the version-counter error raised
    when a saved tensor was modified in place) keeps working.
    """
