"""Sizes written with a unit (``"256MiB"``, ``"1.5 GB"``), shared by every argument that
takes bytes (``cache_limit``, ``memory_budget``)."""

from __future__ import annotations

import math
import re

__all__ = ["parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int | None:
    """Bytes of a size such as ``"256MiB"``, ``"1.5 GB"`` or ``"4096"``; ``None`` if ``text``
    is not one. KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024.

    Example:
        >>> parse_size("1.5 KiB"), parse_size("2GB"), parse_size("12 parsecs")
        (1536, 2000000000, None)
    """
    m = _SIZE.match(text)
    if m is None:
        return None
    unit = _UNITS.get(m.group(2).lower())
    number = float(m.group(1))
    if unit is None or not math.isfinite(number):
        return None
    return round(number * unit)
