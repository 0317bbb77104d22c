"""Bytes as the planner's people read and write them: one convention for the API, the CLI and the table.

A memory is bytes (a number) or a string with a unit, ``"8GiB"``, ``"512 MiB"``, ``"16GB"`` (decimal units
too), in ``sw.plan(memory=...)``, a pipeline's ``memory_caps=`` and ``stagewise plan --memory`` alike. A table
shows every value of a column in one unit, the one its largest value reads best in (:func:`unit_for`).
"""

from __future__ import annotations

import math
import re

UNITS = {
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 10**3,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
_TEXT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]+)\s*$")


def parse_bytes(value: float | str, what: str = "memory", *, bare: bool = True) -> float:
    """``value`` in bytes: a number (``bare``: taken as bytes; else refused, asking for a unit), ``"inf"``, or a
    string with a unit of :data:`UNITS`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be bytes (a number) or a string with a unit like '8GiB', got {value!r}")
    text = value.strip()
    if text.lower() in ("inf", "none", "unlimited"):
        return math.inf
    found = _TEXT.match(text)
    if found is None:
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"{what}: expected a size like '8GiB' or '512MiB', got {value!r}") from None
        if not bare:
            raise ValueError(f"{what} {value}: give a unit, e.g. {value}GiB (or {value}B); units: {', '.join(UNITS)}")
        return number
    number, unit = float(found.group(1)), found.group(2)
    if unit not in UNITS:
        raise ValueError(f"{what}: unknown unit {unit!r} in {value!r}; units: {', '.join(UNITS)}")
    return number * UNITS[unit]


def unit_for(largest: float) -> str:
    """The binary unit ``largest`` bytes read best in (B, KiB, MiB, GiB, TiB)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if largest >= UNITS[unit]:
            return unit
    return "B"


def in_unit(x: float, unit: str) -> str:
    """``x`` bytes in ``unit``: ``4.5 MiB``, ``0.12 MiB``, ``inf``."""
    if math.isinf(x):
        return "inf"
    return f"{x / UNITS[unit]:.3g} {unit}" if unit != "B" else f"{x:.0f} B"
