"""What a many-model server can serve, by name (torch-free):

- `--model NAME=PATH`: a GGUF file or HF folder under a name;
- `--models-dir DIR`: each GGUF file in DIR by its stem, each HF folder (config.json)
  and each folder holding one GGUF file by the folder's name; split GGUF files
  (`-00001-of-00003`) by their first part, vision projectors (`mmproj*`) left out;
- `--stored-models`: what the user has already downloaded, where other tools keep it:
  the Hugging Face hub cache (`org/name` for a snapshot with config.json,
  `org/name:FILE` for each GGUF file in it) and Ollama's store (`model:tag` as
  `ollama list` names it; its blobs are GGUF files named by their digest).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_SPLIT = re.compile(r"-(\d{5})-of-\d{5}$")
_OLLAMA_MODEL = "application/vnd.ollama.image.model"
_OLLAMA_DEFAULT = ("registry.ollama.ai", "library")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str  # a GGUF file or an HF folder
    source: str  # "named", "models-dir", "hf-cache" or "ollama"

    @property
    def size_bytes(self) -> int:
        """The weights' bytes on disk (the files a load reads)."""
        if os.path.isfile(self.path):
            return os.path.getsize(self.path)
        total = 0
        for f in os.listdir(self.path):
            if f.endswith((".safetensors", ".bin", ".gguf", ".pt")):
                total += os.path.getsize(os.path.join(self.path, f))
        return total


def _gguf_stem(filename: str) -> str | None:
    """The model name of a GGUF file, or None for one that is not a model by itself."""
    if not filename.endswith(".gguf") or filename.startswith("mmproj"):
        return None
    stem = filename[: -len(".gguf")]
    split = _SPLIT.search(stem)
    if split is not None:
        return None if split.group(1) != "00001" else stem[: split.start()]
    return stem


def scan_models_dir(folder: str) -> list[ModelEntry]:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--models-dir {folder!r} is not a folder.")
    entries = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and (stem := _gguf_stem(name)) is not None:
            entries.append(ModelEntry(stem, path, "models-dir"))
        elif os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "config.json")):
                entries.append(ModelEntry(name, path, "models-dir"))
                continue
            ggufs = [f for f in sorted(os.listdir(path)) if _gguf_stem(f) is not None]
            if len(ggufs) == 1:
                entries.append(ModelEntry(name, os.path.join(path, ggufs[0]), "models-dir"))
    return entries


def parse_named(spec: str) -> ModelEntry:
    """One `--model NAME=PATH`."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--model {spec!r}: expected NAME=PATH.")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model {spec!r}: {path!r} does not exist.")
    return ModelEntry(name, path, "named")


def hf_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "huggingface"
    )
    return os.path.join(home, "hub")


def hf_cache_models(cache: str | None = None) -> list[ModelEntry]:
    cache = cache or hf_cache_dir()
    if not os.path.isdir(cache):
        return []
    entries = []
    for repo in sorted(os.listdir(cache)):
        if not repo.startswith("models--"):
            continue
        name = repo[len("models--") :].replace("--", "/")
        snapshot = _hf_snapshot(os.path.join(cache, repo))
        if snapshot is None:
            continue
        if os.path.isfile(os.path.join(snapshot, "config.json")) and any(
            f.endswith((".safetensors", ".bin")) for f in os.listdir(snapshot)
        ):
            entries.append(ModelEntry(name, snapshot, "hf-cache"))
        for f in sorted(os.listdir(snapshot)):
            if (stem := _gguf_stem(f)) is not None:
                entries.append(ModelEntry(f"{name}:{stem}", os.path.join(snapshot, f), "hf-cache"))
    return entries


def _hf_snapshot(repo_dir: str) -> str | None:
    """The snapshot `refs/main` names, else the newest one."""
    snapshots = os.path.join(repo_dir, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    try:
        with open(os.path.join(repo_dir, "refs", "main")) as f:
            main = os.path.join(snapshots, f.read().strip())
        if os.path.isdir(main):
            return main
    except OSError:
        pass
    found = [os.path.join(snapshots, s) for s in os.listdir(snapshots)]
    return max(found, key=os.path.getmtime) if found else None


def ollama_dir() -> str:
    return os.environ.get("OLLAMA_MODELS") or os.path.join(
        os.path.expanduser("~"), ".ollama", "models"
    )


def ollama_models(root: str | None = None) -> list[ModelEntry]:
    root = root or ollama_dir()
    manifests = os.path.join(root, "manifests")
    entries = []
    for folder, _, files in sorted(os.walk(manifests)):
        parts = os.path.relpath(folder, manifests).split(os.sep)
        if len(parts) != 3:  # host/namespace/model, a file per tag
            continue
        for tag in sorted(files):
            try:
                with open(os.path.join(folder, tag)) as f:
                    layers = json.load(f)["layers"]
                digest = next(x["digest"] for x in layers if x["mediaType"] == _OLLAMA_MODEL)
            except (OSError, ValueError, KeyError, TypeError, StopIteration):
                continue
            blob = os.path.join(root, "blobs", digest.replace(":", "-"))
            if not os.path.isfile(blob):
                continue
            host, namespace, model = parts
            if (host, namespace) == _OLLAMA_DEFAULT:
                name = f"{model}:{tag}"
            elif host == _OLLAMA_DEFAULT[0]:
                name = f"{namespace}/{model}:{tag}"
            else:
                name = f"{host}/{namespace}/{model}:{tag}"
            entries.append(ModelEntry(name, blob, "ollama"))
    return entries


def stored_models() -> list[ModelEntry]:
    return hf_cache_models() + ollama_models()


def find_stored(name: str) -> ModelEntry | None:
    """A model of the Hugging Face cache or Ollama's store by its name there (Ollama's
    `:latest` may be left off, as `ollama run` allows)."""
    for entry in stored_models():
        if entry.name in (name, f"{name}:latest"):
            return entry
    return None


def catalog(
    named: list[str] | None = None, models_dir: str | None = None, stored: bool = False
) -> dict[str, ModelEntry]:
    """Every model by name; where two share a name the first wins: named, then the
    models folder, then the stores."""
    entries = [parse_named(spec) for spec in named or ()]
    if models_dir is not None:
        entries += scan_models_dir(models_dir)
    if stored:
        entries += stored_models()
    models: dict[str, ModelEntry] = {}
    for entry in entries:
        if entry.name in models:
            logger.warning(
                "model name %r: %s kept, %s (%s) left out",
                entry.name, models[entry.name].path, entry.path, entry.source,
            )  # fmt: skip
            continue
        models[entry.name] = entry
    return models
