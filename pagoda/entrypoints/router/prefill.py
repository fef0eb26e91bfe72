"""Policy "pd" (prefill/decode disaggregation): a generation request is first sent to a
prefill replica as a one-token request, whose answer comes once the prompt's full
blocks are in the disk tier it shares with the decode replicas (`pagoda serve
--kv-transfer-config '{"kv_role": "kv_producer"}'`); the request itself then goes to a
decode replica, which finds those blocks as tier hits and computes only the prompt's
last partial block before decoding. The prefill replica is chosen as "prefix" chooses
(the one that has the prompt's prefix, else the least loaded)."""

from __future__ import annotations

import json
import logging

import httpx
from fastapi.responses import Response

from pagoda.entrypoints.relay import error_code, relayed_headers
from pagoda.entrypoints.router.policy import Router

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")


def prefill_body(path: str, body: dict) -> dict:
    """The request as a one-token, unstreamed request of the same prompt."""
    one = {**body, "stream": False}
    for field in ("stream_options", "min_tokens", "use_beam_search", "best_of"):
        one.pop(field, None)
    one["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = 1
    if path != "/v1/messages":  # (Anthropic's API has no n)
        one["n"] = 1
    return one


async def prefill_first(
    client: httpx.AsyncClient,
    prefill: Router,
    path: str,
    body: dict,
    hashes: list[bytes],
    headers: dict[str, str],
) -> Response | None:
    """Run the request's prefill on a prefill replica. Returns the replica's error for
    a request it refused as invalid (4xx: the client's to see, and the decode replica
    would refuse it alike), else None: prefilled, or no prefill replica could take it
    (the decode replica then computes the prompt itself)."""
    content = json.dumps(prefill_body(path, body)).encode()
    tried = set()
    while (replica := prefill.choose(hashes, tried)) is not None:
        tried.add(replica)
        replica.in_flight += 1
        prefill.record(hashes, replica)
        try:
            r = await client.post(replica.url + path, content=content, headers=headers)
        except httpx.TransportError as e:
            logger.warning("router: prefill replica %s unreachable (%r)", replica.url, e)
            prefill.set_health(replica, False)
            prefill.metrics.retries.inc()
            continue
        finally:
            replica.in_flight -= 1
        if r.status_code == 503:
            if error_code(r.content) != "queue_full":
                prefill.set_health(replica, False)
            prefill.metrics.retries.inc()
            continue
        if 400 <= r.status_code < 500:
            return Response(r.content, r.status_code, relayed_headers(r))
        if r.status_code == 200:
            return None
        logger.warning("router: prefill replica %s answered %d", replica.url, r.status_code)
    logger.warning("router: no prefill replica took a request; its decode replica prefills it")
    return None
