"""What ``memory_budget`` accepts as a budget, and what recomputing an op costs.

# Note [Budget argument]
# ``memory_budget(budget)`` takes bytes as an int, bytes as a string with a unit, or a
# fraction of the region's activation memory as a float in (0, 1]:
#   - units are decimal (``B``, ``KB``, ``MB``, ``GB``, ``TB``: powers of 1000) or binary
#     (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024), case-insensitive, with optional
#     spaces and a decimal number (``"1.5 GiB"``); ``"40%"`` is the fraction 0.4;
#   - an int below 1 KiB is refused: no region fits in a few bytes, and ``memory_budget(1)``
#     is almost always meant as 100% (``memory_budget(1.0)``). The message says so.
#   - a bare ``K``/``M``/``G`` is refused (bytes or bits? powers of 1000 or 1024?);
#   - a string without a unit is the Python number it spells, with the same rule:
#     ``"4096"`` is the int 4096 (bytes), ``"0.5"`` and ``"2e-1"`` floats (fractions), and
#     ``"1"`` one byte, refused like ``1``. ``ckpt-graph compare --budget TEXT`` passes its
#     text here, so the command line and the API accept the same budgets (one parser).
# Every refusal is a ``CkptGraphError`` naming the value and the accepted forms.

# Note [Recompute cost model]
# The planner compares plans by the time backward spends recomputing, in FLOP units. A
# roofline: an op's time is its FLOPs over the machine's FLOP rate or its bytes moved over
# its memory bandwidth, whichever is larger. Matmul-class ops (those with a FLOP formula in
# ``torch.utils.flop_counter``: mm, addmm, bmm, baddbmm, convolution, attention) are costed
# by their FLOPs; every other op (pointwise, reductions, copies, layer norm: memory-bound)
# by ``flops_per_byte x (bytes read + bytes written)``, where ``flops_per_byte`` is the
# FLOPs a matmul runs in the time a pointwise op moves one byte on this machine. It is
# *calibrated* once per process, at the first plan, from two measured op times (the best of
# 9 interleaved runs of a 256^3 float32 matmul and of a 2^20-element float32 add), and
# clamped to [0.5, 16]; ``memory_budget(..., flops_per_byte=x)`` fixes it for one policy, and
# the environment variable ``CKPT_GRAPH_FLOPS_PER_BYTE`` for every policy that does not pass
# it (see Note [Pinned calibration]). Reads count: costing a pointwise op by its output
# elements alone makes long pointwise chains (GELU, softmax, dropout) look nearly free to
# recompute, and matmul outputs kept less often than their time warrants.
# Known limitations: one constant for every memory-bound op (a strided copy or a reduction
# moves bytes more slowly than an add); bytes are the tensors' sizes, not what the kernel
# touches (broadcasts count once); calibration on a loaded machine is noisy (the clamp bounds
# the damage; plans are made once and reused).

# Note [Pinned calibration]
# A plan depends on ``flops_per_byte``, so a calibrated one makes the same program plan
# differently from machine to machine and from run to run (a loaded core slows the add more
# than the matmul, or the reverse). Where plans must agree, the environment variable
# ``CKPT_GRAPH_FLOPS_PER_BYTE`` pins the ratio for every ``memory_budget`` that was not given
# ``flops_per_byte=``:
#   - a test session (``tests/conftest.py`` sets it, so no test result depends on the
#     machine or its load);
#   - the processes of one distributed job (ranks that calibrate on their own may plan the
#     same layers differently);
#   - a benchmark compared across machines.
# It is read at each plan (not cached), so changing it between steps takes effect at the
# next plan; a value that is not a finite number >= 0 raises, naming the variable.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ckpt_graph._errors import CkptGraphTypeError, CkptGraphValueError
from ckpt_graph._sizes import parse_size
from ckpt_graph.engine.flops import node_flops
from ckpt_graph.engine.graph import Handle

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = [
    "FLOPS_PER_BYTE_ENV",
    "calibrated_flops_per_byte",
    "machine_flops_per_byte",
    "op_cost",
    "parse_budget",
    "recorded_costs",
]

FLOPS_PER_BYTE_ENV = "CKPT_GRAPH_FLOPS_PER_BYTE"

_MIN_BYTES = 1024
_FORMS = (
    'pass bytes as an int (at least 1 KiB) or a string with a unit ("512MiB", "2GB", '
    '"1.5 GiB"), or a fraction of the region\'s activation memory as a float in (0, 1] '
    '("40%" also works)'
)


def parse_budget(budget: object) -> int | float:
    """The budget in bytes (int) or as a fraction in (0, 1] (float). See Note [Budget argument].

    Raises:
        CkptGraphError: not a budget; the message gives the accepted forms.

    Example:
        >>> parse_budget("1.5 KiB"), parse_budget(0.25), parse_budget("40%"), parse_budget("4096")
        (1536, 0.25, 0.4, 4096)
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise CkptGraphTypeError(
            f"ckpt_graph: memory_budget got {type(budget).__name__} {budget!r}; {_FORMS}"
        )
    if isinstance(budget, str):
        return _parse_str(budget)
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:  # also refuses nan
            raise CkptGraphValueError(
                f"ckpt_graph: memory_budget({budget!r}): a float is a fraction of the "
                f"activation memory and must be in (0, 1]; {_FORMS}"
            )
        return budget
    if budget < _MIN_BYTES:
        hint = (
            " If you meant 100% of the activation memory, pass the float 1.0."
            if budget == 1
            else ""
        )
        raise CkptGraphValueError(
            f"ckpt_graph: memory_budget({budget}) is {budget} bytes: an int budget is bytes "
            f"and must be at least 1 KiB ({_MIN_BYTES}); no region fits in less.{hint} "
            f"To fix it, {_FORMS}"
        )
    return budget


def _parse_str(text: str) -> int | float:
    number = _bare_number(text)
    if number is not None:
        return parse_budget(number)
    if text.strip().endswith("%"):
        try:
            percent = float(text.strip()[:-1])
        except ValueError:
            percent = math.nan
        if math.isfinite(percent):
            return parse_budget(percent / 100)
    size = parse_size(text)
    if size is None:
        raise CkptGraphValueError(
            f"ckpt_graph: memory_budget({text!r}) is not a size: use a number and a unit among "
            f"B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), or a "
            f"percentage; {_FORMS}"
        )
    return parse_budget(size)


def _bare_number(text: str) -> int | float | None:
    """The Python number a string without a unit spells (``"4096"``: 4096, ``"0.5"``: 0.5),
    else ``None``. See Note [Budget argument]."""
    stripped = text.strip()
    if stripped.isdigit():
        return int(stripped)
    try:
        return float(stripped)
    except ValueError:
        return None


def op_cost(flops: int, nbytes: int, flops_per_byte: float) -> int:
    """Recompute cost of one op in FLOP units. See Note [Recompute cost model].

    Args:
        flops: the op's FLOPs from a formula (0: none, a memory-bound op).
        nbytes: bytes it reads and writes (its tensor inputs and outputs).
        flops_per_byte: FLOPs worth one byte moved on this machine.

    Example:
        >>> op_cost(2_000_000, 48_000, 4.0), op_cost(0, 48_000, 4.0)
        (2000000, 192000)
    """
    if flops > 0:
        return flops
    return math.ceil(nbytes * flops_per_byte)


def recorded_costs(region: Region, indices: Iterable[int], flops_per_byte: float) -> dict[int, int]:
    """Recompute cost of the op nodes ``indices`` of ``region``, from what they recorded.

    FLOPs come from the formulas, applied to shape-only (meta) stand-ins of the op's
    tensors; bytes moved are its tensor arguments' and outputs' bytes. Computed when a plan
    needs them, not per op in the forward (see Note [Following a plan]).
    """
    nodes = region.nodes
    costs: dict[int, int] = {}
    for j in indices:
        node = nodes[j]
        flops = node_flops(node)
        moved = 0
        if flops <= 0:
            moved = sum(h.nbytes for h in node.outputs if h is not None)
            moved += sum(_arg_bytes(a) for a in node.args)
        costs[j] = op_cost(flops, moved, flops_per_byte)
    return costs


def _arg_bytes(a: Any) -> int:
    if type(a) is Handle:
        return a.nbytes
    if type(a) is list or type(a) is tuple:
        return sum(e.nbytes for e in a if type(e) is Handle)
    return 0


_CLAMP = (0.5, 16.0)
_ROUNDS = 9


@functools.cache
def calibrated_flops_per_byte() -> float:
    """FLOPs of a float32 matmul per byte a pointwise add moves in the same time, measured.

    Cached for the process. See Note [Recompute cost model].
    """
    # Planning runs at region exit, inside the region's recorder (and maybe a user's flop
    # counter or another mode): the calibration's ops belong to none of them.
    with _disable_current_modes(), torch.no_grad(), torch.inference_mode():
        # not torch.randn: calibrating must not advance the user's random stream
        a = torch.full((256, 256), 0.5)
        b = torch.full((256, 256), 0.25)
        x = torch.full((1 << 20,), 0.5)
        y = torch.full((1 << 20,), 0.25)

        def once(fn: Callable[[], object]) -> float:
            t0 = time.perf_counter()
            fn()
            return max(time.perf_counter() - t0, 1e-9)

        once(lambda: torch.mm(a, b))  # warm-up
        once(lambda: torch.add(x, y))
        # interleaved, best of each: a run that another process slowed down does not count
        mm_s = add_s = float("inf")
        for _ in range(_ROUNDS):
            mm_s = min(mm_s, once(lambda: torch.mm(a, b)))
            add_s = min(add_s, once(lambda: torch.add(x, y)))
    flop_rate = 2 * 256**3 / mm_s
    byte_rate = 3 * 4 * (1 << 20) / add_s
    lo, hi = _CLAMP
    return min(max(flop_rate / byte_rate, lo), hi)


def machine_flops_per_byte() -> float:
    """The ``flops_per_byte`` of a plan whose policy was not given one.

    ``$CKPT_GRAPH_FLOPS_PER_BYTE`` when set (see Note [Pinned calibration]), else
    :func:`calibrated_flops_per_byte`.

    Raises:
        CkptGraphValueError: the variable is set to something other than a finite number >= 0.

    Example:
        >>> os.environ[FLOPS_PER_BYTE_ENV] = "2"
        >>> machine_flops_per_byte()
        2.0
        >>> del os.environ[FLOPS_PER_BYTE_ENV]
    """
    text = os.environ.get(FLOPS_PER_BYTE_ENV)
    if text is None or not text.strip():
        return calibrated_flops_per_byte()
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise CkptGraphValueError(
            f"ckpt_graph: {FLOPS_PER_BYTE_ENV}={text!r} is not a number of FLOPs per byte: set "
            f"it to a finite number >= 0 (e.g. 2.0), or unset it to calibrate on this machine"
        )
    return value
