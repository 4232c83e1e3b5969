"""Exception types raised by ckpt_graph.

# Note [Error types]
# Every error the library raises on a user mistake is a ``CkptGraphError``, so that
# ``except ckpt_graph.CkptGraphError`` catches all of them. Argument checks raise the
# subclasses that also derive from the builtin type Python code expects for them
# (``CkptGraphTypeError`` is a ``TypeError``, ``CkptGraphValueError`` a ``ValueError``,
# ``CkptGraphImportError`` an ``ImportError``), so code written against the builtin types
# keeps working. Messages start with ``"ckpt_graph: "`` (command-line messages, printed by
# the CLI after its own prefix, excepted). tests/test_errors_api.py reads every ``raise``
# of the package and fails on one that raises anything else.
"""

from __future__ import annotations

__all__ = ["CkptGraphError", "CkptGraphImportError", "CkptGraphTypeError", "CkptGraphValueError"]


class CkptGraphError(RuntimeError):
    """An error detected by the ckpt_graph engine.

    Messages start with ``"ckpt_graph: "`` and name the op, the tensor or the policy
    involved, and what to do about it. It subclasses :class:`RuntimeError` so that code
    which catches autograd's own errors (for example the version-counter error raised
    when a saved tensor was modified in place) keeps working. See Note [Error types].
    """


class CkptGraphValueError(CkptGraphError, ValueError):
    """An argument with the right type but a wrong value (also a :class:`ValueError`)."""


class CkptGraphTypeError(CkptGraphError, TypeError):
    """An argument of the wrong type (also a :class:`TypeError`)."""


class CkptGraphImportError(CkptGraphError, ImportError):
    """An optional dependency a feature needs is missing (also an :class:`ImportError`)."""
