"""Checks of the numbers users and files give (ints, finite reals in a range), and numbers made plain for JSON."""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import TideArgumentError, TideArgumentTypeError


def check_int(name: str, value: Any, *, minimum: int | None = None) -> None:
    """`value` is an int (not a bool, not a float such as 2.5), at least `minimum`; else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TideArgumentTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise TideArgumentError(f"{name} must be >= {minimum}, got {value}")


def check_real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False) -> None:
    """`value` is a finite real number (not a bool or a string) in the given range; else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TideArgumentTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    out = not math.isfinite(value)
    out |= low is not None and (value <= low if low_open else value < low)
    out |= high is not None and (value >= high if high_open else value > high)
    if out:
        lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
        raise TideArgumentError(f"{name} must be a finite number in {lo}, {hi}, got {value}")


def plain(value: Any) -> Any:
    """`value` with every number inside (dicts, lists) a plain int / float / bool, as JSON writes them."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value
