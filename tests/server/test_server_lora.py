"""LoRA adapters through `pagoda serve`, driven by the official `openai` client: the
request's `model` picks an adapter, adapters load and unload at run time, unknown
names get 404, bad adapters 4xx, and the metrics count requests by adapter."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagoda import LLM, LoRARequest, SamplingParams
from tests.helpers import ADAPTERS, RemoteServer, broken_copy, make_adapter

KEY = "lora-key"
PROMPT = "The quick brown fox"
LONG = 400  # tokens: still streaming when the adapter is unloaded
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_adapters")
    names = ["all8", "mlp16", "qv4rs"]
    return {
        n: make_adapter(tiny_llama, str(root / n), i, **ADAPTERS[n]) for i, n in enumerate(names, 1)
    }


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    args = ["--served-model-name", "tiny", "--api-key", KEY, "--enable-lora", "--max-loras", "2"]
    args += ["--lora-modules", f"a={adapters['all8']}"]
    args += [json.dumps({"name": "b", "path": adapters["mlp16"]})]
    with RemoteServer(tiny_llama, *args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters):
    """Greedy completions of PROMPT by LLM: base model and each adapter."""
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=24)
    out = {None: llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text}
    for i, (name, path) in enumerate(adapters.items(), 1):
        lora = LoRARequest(name, i, path)
        out[name] = (
            llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        )
    long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    lora = LoRARequest("qv4rs", 3, adapters["qv4rs"])
    out["qv4rs long"] = (
        llm.generate(PROMPT, long, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    )
    return out


def complete(client, model: str, **kwargs) -> str:
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, **kwargs
    )
    return r.choices[0].text


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_models_list_adapters_with_their_base(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == ["tiny", "a", "b"]
    assert cards["a"].parent == "tiny" and cards["a"].root == adapters["all8"]
    assert cards["tiny"].parent is None
    assert client.models.retrieve("b").root == adapters["mlp16"]


def test_model_field_picks_the_adapter(client, expected):
    texts = {name: complete(client, name) for name in ("tiny", "a", "b")}
    assert texts == {"tiny": expected[None], "a": expected["all8"], "b": expected["mlp16"]}
    assert len(set(texts.values())) == 3
    chat = [{"role": "user", "content": "Hello world"}]
    whole = client.chat.completions.create(model="a", messages=chat, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="a", messages=chat, max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.model == "a"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "no-such-adapter")
    assert e.value.body["code"] == "model_not_found"


def test_load_use_and_unload_at_run_time(server, client, adapters, expected):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["qv4rs"]})
    assert r.status_code == 200, r.text
    assert "c" in [m.id for m in client.models.list().data]
    assert complete(client, "c") == expected["qv4rs"]
    # A request in flight under an adapter that is unloaded finishes as it would have.
    stream = client.completions.create(
        model="c", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    first = next(chunks).choices[0].text
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200, r.text
    assert first + "".join(c.choices[0].text for c in chunks) == expected["qv4rs long"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "c")
    assert "c" not in [m.id for m in client.models.list().data]
    # Loaded again under the same name: a new adapter as far as any cache knows.
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["all8"]})
    assert r.status_code == 200, r.text
    assert complete(client, "c") == expected["all8"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"lora_name": "a", "lora_path": "/tmp"}, 400, "lora_name", "already served"),
        ({"lora_name": "tiny", "lora_path": "/tmp"}, 400, "lora_name", "already served"),
        ({"lora_name": "d", "lora_path": "/no/such/folder"}, 404, "lora_path", "no such folder"),
        (
            {"lora_name": "d", "lora_path": "/tmp"},
            400,
            "lora_path",
            "adapter_config.json is missing",
        ),
        ({"lora_name": "d"}, 400, "lora_path", "lora_path"),
        ({"lora_name": "", "lora_path": "/tmp"}, 400, "lora_name", "non-empty"),
        ({"lora_name": "d", "lora_path": "/tmp", "junk": 1}, 400, "junk", "Unrecognized"),
    ],
)
def test_bad_loads_are_4xx(server, client, body, status, param, words):
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert complete(client, "a")  # the server serves on


def test_adapter_above_max_rank_is_refused(server, tmp_path, adapters):

    path = broken_copy(adapters["all8"], str(tmp_path / "big"), "rank_too_big")
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": path})
    assert r.status_code == 400
    assert "max_lora_rank (16)" in r.json()["error"]["message"]


def test_an_adapter_gone_from_disk_is_a_400_naming_model(server, client, adapters, tmp_path):
    import shutil

    path = shutil.copytree(adapters["all8"], str(tmp_path / "gone"))
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": path})
    assert r.status_code == 200, r.text
    shutil.rmtree(path)
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, "gone")
    assert e.value.body["param"] == "model" and "no such folder" in e.value.body["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "gone"}).status_code == 200
    assert complete(client, "a")


def test_unload_unknown_is_404_and_routes_need_the_key(server):
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}, headers={})
    assert r.status_code == 401
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a"}, headers={})
    assert r.status_code == 401


def test_metrics_count_requests_by_adapter(server, client):
    for model in ("tiny", "a", "b"):
        complete(client, model)
    text = httpx.get(server.url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("pagoda:request_success_total")]
    by_lora = {}
    for line in lines:
        labels, value = line.rsplit(" ", 1)
        if 'finished_reason="length"' in labels:
            lora = labels.split('lora_name="')[1].split('"')[0]
            by_lora[lora] = by_lora.get(lora, 0) + float(value)
    assert by_lora.get("b", 0) >= 1 and by_lora.get("a", 0) >= 1 and by_lora.get("", 0) >= 1
    assert "pagoda:lora_requests_info{" in text and 'max_lora="2"' in text
    resident = next(
        line for line in text.splitlines() if line.startswith("pagoda:lora_adapters_resident")
    )
    assert 1 <= float(resident.rsplit(" ", 1)[1]) <= 2


def test_lora_modules_need_enable_lora(tiny_llama, adapters):
    with pytest.raises(RuntimeError, match="--lora-modules needs --enable-lora"):
        RemoteServer(tiny_llama, "--lora-modules", f"a={adapters['all8']}")


def test_bad_lora_module_at_startup_is_an_error(tiny_llama):
    with pytest.raises(RuntimeError, match="no such folder"):
        RemoteServer(tiny_llama, "--enable-lora", "--lora-modules", "a=/no/such/adapter")
