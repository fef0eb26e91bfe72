"""Checks of one value against a type and range, raising `InvalidRequestError` that
names the field: shared by `SamplingParams` (at construction) and the front door."""

from __future__ import annotations

import math
from typing import Any

from pagoda.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1


def show(value: Any) -> str:
    """A short repr for error messages (a bad value may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(
    param: str, why: str, value: Any = None, code: str | None = None, where: str | None = None
):
    """Raise InvalidRequestError for `param`; the message names `where` (a path inside
    the field, e.g. messages[2].content) when given."""
    shown = "" if value is None else f", got {show(value)}"
    raise InvalidRequestError(f"{where or param} {why}{shown}.", param, code)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, param: str, lo: int, hi: int) -> int:
    if not is_int(value) or not lo <= value <= hi:
        fail(param, f"must be an integer in [{lo}, {hi}]", value)
    return value


def check_real(value: Any, param: str, lo: float, hi: float, lo_open: bool = False) -> float:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (lo < value if lo_open else lo <= value)
        and value <= hi
    )
    if not ok:
        fail(param, f"must be a number in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return float(value)


def check_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        fail(param, "must be true or false", value)
    return value
