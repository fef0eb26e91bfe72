"""Where /v1/responses keeps stored responses, for `previous_response_id` and GET."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagoda.entrypoints.openai.errors import APIError

DEFAULT_STORE_SIZE = 1000
DEFAULT_STORE_TTL_S = 3600.0


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as it was answered
    conversation: list[dict]  # its input and output as chat messages, without instructions
    stored_at: float = field(default_factory=time.monotonic)


class ResponseStore:
    """Stored responses by id: the newest `max_size`, each for `ttl_s` seconds."""

    def __init__(self, max_size: int = DEFAULT_STORE_SIZE, ttl_s: float = DEFAULT_STORE_TTL_S):
        if max_size < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_size}.")
        if not ttl_s > 0:
            raise ValueError(f"stored_response_ttl must be > 0 seconds, got {ttl_s}.")
        self.max_size, self.ttl_s = max_size, ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response; a 404 naming the id if it is unknown or expired."""
        entry = self._entries.get(response_id)
        if entry is not None and time.monotonic() - entry.stored_at > self.ttl_s:
            del self._entries[response_id]
            entry = None
        if entry is None:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found (it was not stored, or it "
                f"expired or was deleted).",
                "invalid_request_error",
                param,
                "response_not_found",
            )
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]
