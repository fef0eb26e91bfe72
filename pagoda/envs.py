"""Environment variables pagoda reads; read when asked, never at import."""

from __future__ import annotations

import os


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("PAGODA_CACHE_DIR") or os.path.join(base, "pagoda")


def api_key() -> str | None:
    return os.environ.get("PAGODA_API_KEY") or None


def log_level() -> str:
    return os.environ.get("PAGODA_LOG_LEVEL", "INFO").upper()


def distributed_timeout_s() -> int:
    """How long a worker waits on another (a collective, a pipeline hand-off) before
    it gives up: PAGODA_DISTRIBUTED_TIMEOUT_S, 300 by default."""
    value = os.environ.get("PAGODA_DISTRIBUTED_TIMEOUT_S", "300")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"PAGODA_DISTRIBUTED_TIMEOUT_S must be whole seconds, got {value!r}."
        ) from None
