"""Text a person typed (a CLI flag, a console field): numbers read strictly, and bad input
echoed back clipped."""

from __future__ import annotations

import re

# (Up to 40 digits: past int64, and short enough that a range check can name its bound.)
_WHOLE = re.compile(r"[+-]?[0-9]{1,40}")
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def whole_number(text: str) -> int:
    """A base-10 integer as a person types it: ASCII digits and an optional sign. (``int()``
    also takes ``1_0``, other scripts' digits and numbers thousands of digits long.)"""
    t = text.strip()
    if not _WHOLE.fullmatch(t):
        raise ValueError(f"not a whole number: {clip(t)!r}")
    return int(t)


def decimal_number(text: str) -> float:
    """A decimal number as a person types it: ASCII digits, an optional sign, point and
    exponent. (``float()`` also takes ``1_0``, other scripts' digits, ``nan`` and
    ``infinity``.)"""
    t = text.strip()
    if not _DECIMAL.fullmatch(t):
        raise ValueError(f"not a number: {clip(t)!r}")
    return float(t)


def clip(text: str, n: int = 24) -> str:
    """Bad input echoed in a one-line error: its start, if it is long."""
    return text if len(text) <= n else text[:n] + "..."
