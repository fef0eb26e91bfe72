"""/v1/embeddings with the official `openai` client, /v1/rerank (Cohere's shape, also at
/rerank and /v2/rerank) and /v1/score against a live `pagoda serve` of an embedding
model and of a cross-encoder: the same numbers as the offline API, OpenAI's error body
for bad input, and the engine serves on."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from pagoda import LLM
from tests.helpers import (
    ENCODER_TEXTS,
    RemoteRouter,
    RemoteServer,
    make_encoder,
    make_sentence_transformer,
)

QUERY = "the quick brown fox"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling")
    bert = make_encoder(str(root / "bert"), "bert")
    return {
        "embed": make_sentence_transformer(str(root / "st"), bert, "mean", dense=32),
        "rerank": make_encoder(str(root / "ce"), "xlm-roberta", num_labels=1),
    }


@pytest.fixture(scope="module")
def embed_server(folders):
    with RemoteServer(folders["embed"], "--served-model-name", "emb") as s:
        yield s


@pytest.fixture(scope="module")
def rerank_server(folders):
    with RemoteServer(folders["rerank"], "--served-model-name", "rr") as s:
        yield s


def assert_error(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_embeddings_with_the_openai_client(embed_server, folders):
    expected = [o.outputs.embedding for o in LLM(folders["embed"], dtype="float32").embed(ENCODER_TEXTS, use_tqdm=False)]  # fmt: skip
    client = embed_server.client()
    # The client asks for base64 by itself and decodes it.
    out = client.embeddings.create(model="emb", input=ENCODER_TEXTS)
    assert [d.index for d in out.data] == list(range(len(ENCODER_TEXTS)))
    np.testing.assert_allclose([d.embedding for d in out.data], expected, atol=1e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(ENCODER_TEXTS)
    floats = client.embeddings.create(model="emb", input=ENCODER_TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=1e-6)
    ids = client.embeddings.create(model="emb", input=[[2, 10, 11, 3], [2, 12, 3]])
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 7
    short = client.embeddings.create(
        model="emb", input=ENCODER_TEXTS[0], dimensions=8, encoding_format="base64"
    )
    vector = np.frombuffer(base64.b64decode(short.data[0].embedding), dtype="<f4")
    head = np.asarray(expected[0][:8])
    np.testing.assert_allclose(vector, head / np.linalg.norm(head), atol=1e-6)


def test_rerank_and_score_on_an_embedding_model(embed_server, folders):
    """An embedding model scores by the cosine of embeddings, as `LLM.score`."""
    llm = LLM(folders["embed"], dtype="float32")
    expected = [o.outputs.score for o in llm.score(QUERY, ENCODER_TEXTS, use_tqdm=False)]
    r = httpx.post(
        embed_server.url + "/v1/rerank",
        json={"model": "emb", "query": QUERY, "documents": ENCODER_TEXTS, "top_n": 3},
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(expected)[::-1][:3])
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-6)
        assert x["document"]["text"] == ENCODER_TEXTS[x["index"]]
    r = httpx.post(
        embed_server.url + "/v1/score",
        json={"model": "emb", "text_1": QUERY, "text_2": ENCODER_TEXTS},
    )
    assert r.status_code == 200, r.text
    got = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_rerank_on_a_cross_encoder(rerank_server, folders):
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(folders["rerank"], device="cpu").predict([(QUERY, d) for d in ENCODER_TEXTS])  # fmt: skip
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = {"model": "rr", "query": QUERY, "documents": [{"text": d} for d in ENCODER_TEXTS],
                "return_documents": False}  # fmt: skip
        r = httpx.post(rerank_server.url + path, json=body)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-expected, kind="stable"))
        assert all("document" not in x for x in results)
        np.testing.assert_allclose(
            [x["relevance_score"] for x in results], np.sort(expected)[::-1], atol=1e-6
        )
    pairs = {"model": "rr", "text_1": ENCODER_TEXTS[:2], "text_2": ENCODER_TEXTS[2:4]}
    r = httpx.post(rerank_server.url + "/score", json=pairs)
    assert r.status_code == 200 and len(r.json()["data"]) == 2


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"model": "emb", "input": []}, "input"),
        ("/v1/embeddings", {"model": "emb", "input": ""}, "input"),
        ("/v1/embeddings", {"model": "emb", "input": [[2, 10**6]]}, "input"),
        ("/v1/embeddings", {"model": "emb", "input": "fox " * 300}, "input"),
        ("/v1/embeddings", {"model": "emb", "input": "x", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"model": "emb", "input": "x", "dimensions": 33}, "dimensions"),
        ("/v1/embeddings", {"model": "emb", "input": "x", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"model": "emb", "input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/embeddings", {"model": "emb", "input": "x", "frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {"model": "emb", "prompt": "hi"}, "model"),
        ("/v1/rerank", {"model": "emb", "query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"model": "emb", "query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"model": "emb", "query": "q", "documents": [{"txt": "a"}]}, "documents"),
        ("/v1/score", {"model": "emb", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(embed_server, path, body, param):
    assert_error(httpx.post(embed_server.url + path, json=body), param)
    assert embed_server.client().embeddings.create(model="emb", input="still serving").data


def test_a_generation_model_refuses_embeddings(tiny_llama):
    with RemoteServer(tiny_llama, "--served-model-name", "tiny") as s:
        r = httpx.post(s.base_url + "/embeddings", json={"model": "tiny", "input": "hello"})
        assert_error(r, "model")
        assert "--task embed" in r.json()["error"]["message"]


def test_the_router_relays_pooling_and_lists_tasks(embed_server, folders):
    """`pagoda router` relays the pooling routes, and /v1/models says what each model
    serves."""
    with RemoteRouter([embed_server.url], folders["embed"]) as router:
        direct = embed_server.client().embeddings.create(model="emb", input=ENCODER_TEXTS[:2])
        relayed = router.client().embeddings.create(model="emb", input=ENCODER_TEXTS[:2])
        assert [d.embedding for d in relayed.data] == [d.embedding for d in direct.data]
        body = {"model": "emb", "query": QUERY, "documents": ENCODER_TEXTS[:3]}
        assert httpx.post(router.url + "/rerank", json=body).status_code == 200
        pairs = {"model": "emb", "text_1": QUERY, "text_2": ENCODER_TEXTS[:2]}
        assert httpx.post(router.base_url + "/score", json=pairs).status_code == 200
        (card,) = httpx.get(router.base_url + "/models").json()["data"]
        assert card["id"] == "emb" and card["tasks"] == ["embed", "score"]
