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
