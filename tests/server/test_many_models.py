"""Many models from one server: the catalog of names (a models folder, NAME=PATH, the
Hugging Face cache, Ollama's store), and `pagoda serve --models-dir` loading models on
their first request, keeping the most recently used, unloading idle ones, refusing
what would not fit, driven by the official client."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from pagoda.model_executor.model_catalog import (
    catalog,
    hf_cache_models,
    ollama_models,
    scan_models_dir,
)
from pagoda.model_executor.model_files import resolve_model
from tests.gguf_writer import write_gguf
from tests.helpers import ROOT, RemoteServer

# ---- the catalog -----------------------------------------------------------------------


def _touch(path: str, data: bytes = b"GGUF") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_models_dir_names(tmp_path):
    d = str(tmp_path)
    _touch(f"{d}/qwen3-0.6b-Q4_0.gguf")
    _touch(f"{d}/mmproj-llava.gguf")  # a vision projector, not a model
    _touch(f"{d}/big-00001-of-00002.gguf")
    _touch(f"{d}/big-00002-of-00002.gguf")
    _touch(f"{d}/notes.txt", b"x")
    _touch(f"{d}/hf-folder/config.json", b"{}")
    _touch(f"{d}/one-gguf/model-q8.gguf")
    _touch(f"{d}/two-ggufs/a.gguf")
    _touch(f"{d}/two-ggufs/b.gguf")
    names = {e.name: e.path for e in scan_models_dir(d)}
    assert names == {
        "qwen3-0.6b-Q4_0": f"{d}/qwen3-0.6b-Q4_0.gguf",
        "big": f"{d}/big-00001-of-00002.gguf",
        "hf-folder": f"{d}/hf-folder",
        "one-gguf": f"{d}/one-gguf/model-q8.gguf",
    }
    with pytest.raises(FileNotFoundError, match="--models-dir"):
        scan_models_dir(f"{d}/missing")


def test_named_models_come_first_and_are_checked(tmp_path):
    d = str(tmp_path)
    a = _touch(f"{d}/dir/a.gguf")
    other = _touch(f"{d}/other.gguf")
    models = catalog([f"a={other}"], f"{d}/dir")
    assert models["a"].path == other and models["a"].source == "named"
    assert catalog(None, f"{d}/dir")["a"].path == a
    with pytest.raises(ValueError, match="NAME=PATH"):
        catalog(["no-equals-sign"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        catalog([f"x={d}/nothing.gguf"])


def _ollama_store(root: str, gguf: str, model: str, tag: str, namespace: str = "library") -> str:
    with open(gguf, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    blob = os.path.join(root, "blobs", f"sha256-{digest}")
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    shutil.copyfile(gguf, blob)
    manifest = {
        "schemaVersion": 2,
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
        ],
    }
    folder = os.path.join(root, "manifests", "registry.ollama.ai", namespace, model)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, tag), "w") as f:
        json.dump(manifest, f)
    return blob


def test_stored_models_by_their_names(tmp_path, monkeypatch, tiny_llama):
    """The Hugging Face cache's snapshots and Ollama's manifests, by the names those
    tools give them; `pagoda serve NAME` finds them too (an Ollama blob is a GGUF file
    named by its digest)."""
    gguf = write_gguf(str(tmp_path / "tiny.gguf"), tiny_llama)
    ollama = str(tmp_path / "ollama")
    blob = _ollama_store(ollama, gguf, "tinyllama", "latest")
    _ollama_store(ollama, gguf, "mine", "q4", namespace="someone")
    hub = str(tmp_path / "hub")
    snapshot = os.path.join(hub, "models--org--tiny", "snapshots", "abc123")
    shutil.copytree(tiny_llama, snapshot)
    _touch(os.path.join(hub, "models--org--tiny", "refs", "main"), b"abc123")
    shutil.copyfile(gguf, os.path.join(snapshot, "tiny-Q8_0.gguf"))
    _touch(os.path.join(hub, "datasets--org--data", "snapshots", "x", "config.json"), b"{}")
    monkeypatch.setenv("OLLAMA_MODELS", ollama)
    monkeypatch.setenv("HF_HUB_CACHE", hub)

    assert {e.name: e.path for e in ollama_models()} == {
        "tinyllama:latest": blob,
        "someone/mine:q4": blob,
    }
    assert {e.name: e.path for e in hf_cache_models()} == {
        "org/tiny": snapshot,
        "org/tiny:tiny-Q8_0": os.path.join(snapshot, "tiny-Q8_0.gguf"),
    }
    assert resolve_model("tinyllama") == (blob, True)  # ":latest" may be left off
    assert resolve_model("org/tiny") == (snapshot, False)
    with pytest.raises(FileNotFoundError, match="pagoda models"):
        resolve_model("not-a-model-anywhere")

    out = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "models", "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"tinyllama:latest", "someone/mine:q4", "org/tiny", "org/tiny:tiny-Q8_0"}
    assert rows["tinyllama:latest"]["source"] == "ollama"
    assert rows["tinyllama:latest"]["size_bytes"] == os.path.getsize(gguf)

    # The Ollama blob serves as it is, with the GGUF's own tokenizer and template.
    from pagoda import LLM, SamplingParams

    llm = LLM("tinyllama:latest", dtype="float32", kv_cache_memory_bytes=8 << 20)
    direct = LLM(gguf, dtype="float32", kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(max_tokens=6, temperature=0)
    assert (
        llm.generate(["hello there"], params)[0].outputs[0].token_ids
        == direct.generate(["hello there"], params)[0].outputs[0].token_ids
    )


# ---- the server ------------------------------------------------------------------------


def _tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def _status(server: RemoteServer) -> dict[str, str]:
    data = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["status"]["value"] for card in data}


def _model_pids(server: RemoteServer) -> list[int]:
    return [p.pid for p in psutil.Process(server.proc.pid).children()]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_models, gguf_path):
    d = tmp_path_factory.mktemp("many")
    os.symlink(gguf_path, d / "smollm2.gguf")
    write_gguf(str(d / "tiny-llama.gguf"), tiny_models["llama"])
    os.symlink(tiny_models["qwen2"], d / "tiny-qwen")
    _touch(str(d / "broken.gguf"), b"GGUF" + b"\0" * 60)
    return str(d)


def test_many_models_load_on_demand(models_dir):
    server = RemoteServer(
        None, "--models-dir", models_dir, "--max-loaded-models", "1", "--keep-alive", "4"
    )
    try:
        client = server.client()
        assert _status(server) == dict.fromkeys(
            ["broken", "smollm2", "tiny-llama", "tiny-qwen"], "unloaded"
        )
        # First request loads the model; the answer names it.
        r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4)
        assert r.model == "tiny-llama" and r.choices[0].text is not None
        assert _status(server)["tiny-llama"] == "loaded"
        card = client.models.retrieve("tiny-llama")
        assert card.model_extra["max_model_len"] > 0

        # A stream for a model not loaded: a comment at once, then the model's events.
        body = {
            "model": "smollm2", "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }  # fmt: skip
        with httpx.stream("POST", server.base_url + "/chat/completions", json=body,
                          timeout=120) as s:  # fmt: skip
            lines = [line for line in s.iter_lines() if line]
        assert lines[0] == ": loading smollm2"
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events and all(e["model"] == "smollm2" for e in events)
        assert lines[-1] == "data: [DONE]"
        # --max-loaded-models 1: the other one went.
        assert _status(server) == {
            "broken": "unloaded", "smollm2": "loaded", "tiny-llama": "unloaded",
            "tiny-qwen": "unloaded",
        }  # fmt: skip

        # A third model, through the official client's chat: the answer names it.
        r = client.chat.completions.create(
            model="tiny-qwen", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.model == "tiny-qwen"
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="nope", prompt="x", max_tokens=1)
        assert e.value.code == "model_not_found" and "tiny-qwen" in e.value.message

        # A file that is no model: 503 with its server's last words; the rest serve on.
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="broken", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and e.value.code == "model_load_failed"
        assert "exit status" in e.value.message
        r = client.completions.create(model="tiny-qwen", prompt="still here", max_tokens=2)
        assert r.model == "tiny-qwen"

        # A model's server killed: the next request loads it again.
        (pid,) = _model_pids(server)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _status(server)["tiny-qwen"] != "unloaded":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = client.completions.create(model="tiny-qwen", prompt="back", max_tokens=2)
        assert r.model == "tiny-qwen"

        # llama.cpp's endpoints: unload, load.
        r = httpx.post(server.url + "/models/unload", json={"model": "tiny-qwen"}, timeout=60)
        assert r.status_code == 200 and r.json()["success"]
        assert _model_pids(server) == []
        assert (
            httpx.post(server.url + "/models/unload", json={"model": "tiny-qwen"}).status_code
            == 400
        )
        before = _tree_rss(server.proc.pid)
        r = httpx.post(server.url + "/models/load", json={"model": "smollm2"}, timeout=120)
        assert r.status_code == 200 and r.json()["status"] == {"value": "loaded"}
        loaded = _tree_rss(server.proc.pid)
        assert loaded - before > 100 << 20  # the model's process: torch, weights, KV cache

        # Idle past --keep-alive: unloaded, and the memory is back.
        deadline = time.monotonic() + 30
        while _status(server)["smollm2"] != "unloaded":
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert _model_pids(server) == []
        assert _tree_rss(server.proc.pid) < before + (20 << 20)

        m = server.metrics()
        assert m[("pagoda_models:unloads_total", (("model", "smollm2"), ("reason", "idle")))] == 1
        assert (
            m[("pagoda_models:unloads_total", (("model", "tiny-llama"), ("reason", "room")))] == 1
        )
        assert (
            m[("pagoda_models:unloads_total", (("model", "tiny-qwen"), ("reason", "exited")))] == 1
        )
        assert (
            m[("pagoda_models:unloads_total", (("model", "tiny-qwen"), ("reason", "request")))] == 1
        )
        assert m[("pagoda_models:loads_total", (("model", "smollm2"),))] == 2
        assert server.terminate() == 0
    finally:
        server.stop()


def test_a_model_that_would_not_fit_is_refused(tiny_llama):
    """A load whose estimate (weights, KV cache, runtime) is past the memory available
    is a 503 naming the model and the memory, before any process starts."""
    server = RemoteServer(
        None, "--model", f"big={tiny_llama}", "--model", f"other={tiny_llama}",
        "--kv-cache-memory-bytes", str(1 << 50), "--api-key", "k",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="big", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and e.value.code == "insufficient_memory"
        assert "`big` needs about" in e.value.message and "GiB is available" in e.value.message
        assert _model_pids(server) == []
        # The key guards the API and the load endpoints; health stays open.
        assert httpx.get(server.base_url + "/models").status_code == 401
        assert httpx.post(server.url + "/models/load", json={"model": "big"}).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        page = httpx.get(server.url + "/")  # the chat page, its model picker over all models
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    finally:
        server.stop()
