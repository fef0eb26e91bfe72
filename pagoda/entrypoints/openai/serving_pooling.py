"""POST /v1/embeddings (OpenAI's shape), /v1/rerank (Cohere's and Jina's; also /rerank,
/v2/rerank) and /v1/score (vLLM's; also /score): pooling requests through the same
front door and engine as generation. Pairs are scored by the model's classifier (a
cross-encoder reads each pair whole) or, for an embedding model, as the cosine of
the two texts' embeddings."""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from pagoda.engine.pooling import cosine, score_pairs
from pagoda.entrypoints.openai.errors import bad_request, failure_to_api_error, from_invalid
from pagoda.entrypoints.openai.protocol import OpenAIModel, random_id
from pagoda.entrypoints.openai.serving_engine import OpenAIServing
from pagoda.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from pagoda.outputs import PoolingRequestOutput
from pagoda.pooling_params import PoolingParams

# the front door's names -> the bodies'
_RENAMES = {"prompt": "input", "prompt_token_ids": "input", "task": "model"}


class EmbeddingRequest(OpenAIModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0


class RerankRequest(OpenAIModel):
    query: str
    documents: list[str] | list[dict[str, str]]  # texts, or Cohere's {"text": ...}
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreRequest(OpenAIModel):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ServingPooling:
    """The pooling routes, on the server's shared request plumbing (`OpenAIServing`)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.tasks = serving.engine.model_config.tasks

    async def embeddings(self, req: EmbeddingRequest, trace_headers: Mapping[str, str]) -> dict:
        model, lora = self.serving.check_model(req.model)
        inputs = req.input
        if isinstance(inputs, str) or (inputs and all(isinstance(t, int) for t in inputs)):
            inputs = [inputs]
        prompts = [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": x} for x in inputs]
        params = self._params(
            task="embed",
            dimensions=req.dimensions,
            normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        outs = await self._run("embd", prompts, params, req.priority, lora, trace_headers)
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(outs)
        ]  # fmt: skip
        num_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }

    async def rerank(self, req: RerankRequest, trace_headers: Mapping[str, str]) -> dict:
        model, lora = self.serving.check_model(req.model)
        documents = [d if isinstance(d, str) else d.get("text") for d in req.documents]
        if not all(isinstance(d, str) for d in documents):
            raise bad_request("documents must be texts or {'text': ...} objects.", "documents")
        if req.top_n is not None and req.top_n < 0:
            raise bad_request("top_n must be >= 0.", "top_n")
        scores, num_tokens = await self._scores(
            req.query, documents, req.truncate_prompt_tokens, req.priority, lora, trace_headers,
            {"text_1": "query", "text_2": "documents"},
        )  # fmt: skip
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [
            {"index": i, "relevance_score": scores[i]}
            | ({"document": {"text": documents[i]}} if req.return_documents else {})
            for i in order
        ]
        return {
            "id": random_id("rerank"),
            "model": model,
            "usage": {"total_tokens": num_tokens},
            "results": results,
        }

    async def score(self, req: ScoreRequest, trace_headers: Mapping[str, str]) -> dict:
        model, lora = self.serving.check_model(req.model)
        scores, num_tokens = await self._scores(
            req.text_1, req.text_2, req.truncate_prompt_tokens, req.priority, lora, trace_headers,
            {},
        )  # fmt: skip
        return {
            "id": random_id("score"),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }

    async def _scores(self, text_1, text_2, truncate, priority, lora, trace_headers, renames):
        """Each pair's score and the tokens read: a cross-encoder's, else the cosine of
        embeddings (each distinct text embedded once)."""
        try:
            pairs = score_pairs(text_1, text_2)
        except InvalidRequestError as e:
            raise from_invalid(e, renames) from e
        if "classify" in self.tasks:
            params = self._params(task="score", truncate_prompt_tokens=truncate)
            prompts = [{"text_1": a, "text_2": b} for a, b in pairs]
            outs = await self._run("score", prompts, params, priority, lora, trace_headers, renames)
            scores = [float(o.outputs.data[0]) for o in outs]
        else:
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            params = self._params(task="embed", truncate_prompt_tokens=truncate)
            outs = await self._run("score", texts, params, priority, lora, trace_headers, renames)
            embedded = {t: o.outputs.data for t, o in zip(texts, outs, strict=True)}
            scores = [cosine(embedded[a].tolist(), embedded[b].tolist()) for a, b in pairs]
        return scores, sum(len(o.prompt_token_ids) for o in outs)

    def _params(self, **fields: Any) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except InvalidRequestError as e:
            raise from_invalid(e, _RENAMES) from e

    async def _run(
        self, kind, prompts, params, priority, lora, trace_headers, renames=None
    ) -> list[PoolingRequestOutput]:
        """Every prompt through the engine, all or nothing; their outputs in order."""
        renames = {**_RENAMES, **(renames or {})}
        streams = await self.serving.start(
            random_id(kind), prompts, params, priority, renames, lora, trace_headers
        )
        try:
            return [await _final(stream) for stream in streams]
        except (RequestFailedError, EngineDeadError) as e:
            raise failure_to_api_error(e) from e
        finally:
            self.serving.abort_unfinished(streams)


async def _final(stream) -> PoolingRequestOutput:
    """A pooling request's one output, when it finishes."""
    return [out async for out in stream][-1]


def _encoded(vector, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector.tolist()
