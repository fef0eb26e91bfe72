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


def check_text(
    value: Any, param: str, max_chars: int | None = None, where: str | None = None
) -> str:
    """A str that is valid Unicode for UTF-8 (a lone surrogate is not), at most `max_chars`."""
    if not isinstance(value, str):
        fail(param, "must be a string", value, where=where)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        fail(param, f"is not valid UTF-8 (a lone surrogate at character {e.start})", where=where)
    if max_chars is not None and len(value) > max_chars:
        fail(param, f"must be at most {max_chars} characters long (is {len(value)})", where=where)
    return value


def check_list(value: Any, param: str, max_len: int, allow_empty: bool = False) -> list:
    if not isinstance(value, list):
        fail(param, "must be a list", value)
    if not value and not allow_empty:
        fail(param, "must not be empty")
    if len(value) > max_len:
        fail(param, f"may hold at most {max_len} entries (has {len(value)})")
    return value


def check_strings(value: Any, param: str, max_chars: int, max_len: int) -> list[str]:
    """A non-empty string or a list of them (stop strings, bad words)."""
    values = [value] if isinstance(value, str) else check_list(value, param, max_len, True)
    for item in values:
        if not check_text(item, param, max_chars):
            fail(param, "must not hold empty strings")
    return list(values)


def check_all_text(value: Any, param: str, depth: int = 0) -> None:
    """Every string inside a JSON-like value is valid UTF-8 (template variables)."""
    if depth > 16:
        fail(param, "is nested too deeply")
    if isinstance(value, str):
        check_text(value, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_all_text(key, param, depth + 1)
            check_all_text(item, param, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_all_text(item, param, depth + 1)
