"""Finding a model's files and its tokenizer: torch-free, for processes that never run
the model (the router)."""

from __future__ import annotations

import contextlib
import hashlib
import os

from pagoda import envs


def resolve_model(model: str | None) -> tuple[str, bool]:
    """(path, is_gguf) for a model name: None (the default), a folder, a GGUF file, or
    the name of a model the Hugging Face cache or Ollama's store holds."""
    if model is None:
        from pagoda.model_executor.default_model import default_model_path

        return default_model_path(), True
    if os.path.isfile(model):
        if not is_gguf_file(model):
            raise ValueError(f"model file {model!r} is not a GGUF file.")
        return model, True
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "config.json")):
            return model, False
        ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(model, ggufs[0]), True
        raise FileNotFoundError(f"model folder {model!r} has no config.json (nor one .gguf file).")
    from pagoda.model_executor.model_catalog import find_stored

    stored = find_stored(model)  # a name the HF cache or Ollama's store knows
    if stored is not None:
        return resolve_model(stored.path)
    raise FileNotFoundError(
        f"model {model!r} is not a local folder or GGUF file, nor a model of the Hugging "
        "Face cache or Ollama's store (`pagoda models` lists them; pagoda does not download)."
    )


def is_gguf_file(path: str) -> bool:
    """By its magic, not its name: Ollama's store keeps GGUF files as sha256-<digest>."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_tokenizer(path: str, is_gguf: bool):
    from transformers import AutoTokenizer

    try:
        if not is_gguf:
            return AutoTokenizer.from_pretrained(path)
        # Converting a GGUF vocabulary takes seconds; keep the result in the cache folder.
        cached = tokenizer_cache_dir(path)
        if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(cached)
        tokenizer = _gguf_tokenizer(path)
        with contextlib.suppress(OSError):  # a read-only cache only costs time
            tokenizer.save_pretrained(cached)
        return tokenizer
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer of {path!r}: {e}") from e


# llama.cpp's architecture -> transformers' model_type, where the two differ (as
# transformers' own GGUF loader renames them).
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def _gguf_tokenizer(path: str):
    """The tokenizer transformers builds from the file's vocabulary, of the class
    AutoTokenizer would pick for its architecture (TokenizersBackend where transformers
    has none of its own, or does not know the architecture: granite, smollm3, deepseek2).
    Not through AutoTokenizer itself: to pick the class it reads the file's whole
    config with the gguf package's reader (9 s for SmolLM2's 49,152-token vocabulary on
    a slow CPU; the vocabulary alone takes under 1 s)."""
    from pagoda.model_executor.gguf_file import string_field
    from pagoda.model_executor.gguf_tokenizer import (
        bpe_tokenizer,
        unigram_tokenizer,
        wordpiece_tokenizer,
    )

    arch, vocab = (
        string_field(path, "general.architecture"),
        string_field(path, "tokenizer.ggml.model"),
    )
    if vocab == "bert":
        return wordpiece_tokenizer(path)  # (BERT's respelled WordPiece: not transformers')
    if arch == "bert" and vocab == "t5":
        return unigram_tokenizer(path)  # (XLM-R's: transformers reads only T5's)
    if arch == "bert" and vocab == "gpt2":
        return bpe_tokenizer(path)  # (RoBERTa's: transformers reads no BERT file)
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    arch = arch or ""
    name = TOKENIZER_MAPPING_NAMES.get(_MODEL_TYPES.get(arch, arch))
    # (Mistral's own tokenizer reads tekken.json files, which a GGUF file is not.)
    cls = TokenizersBackend
    if name and name != "MistralCommonBackend":
        cls = tokenizer_class_from_name(name) or TokenizersBackend
    folder, file = os.path.dirname(path) or ".", os.path.basename(path)
    return cls.from_pretrained(folder, gguf_file=file)


def tokenizer_cache_dir(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = hashlib.sha256(
        f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return os.path.join(envs.cache_dir(), "tokenizers", key)


def weights_identity(path: str) -> list[tuple[str, int, str]]:
    """What tells a model's weight files apart without reading them whole: each file's
    name, size, and a digest of its first and last MiB (a copy elsewhere is the same
    model; another fine-tune of the same shape is not). For keys that must outlive the
    process (the disk KV tier's)."""
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if f.endswith((".safetensors", ".bin", ".gguf", ".pt")) or f == "config.json"
        )
    identity = []
    for file in files:
        size = os.path.getsize(file)
        digest = hashlib.blake2b(digest_size=16)
        with open(file, "rb") as f:
            digest.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(size - (1 << 20))
                digest.update(f.read())
        identity.append((os.path.basename(file), size, digest.hexdigest()))
    return identity
