"""The API key, for `pagoda serve` and the many-model server alike (torch-free)."""

from __future__ import annotations

import secrets

from fastapi import Request

from pagoda.entrypoints.relay import error

DASHBOARD_COOKIE = "pagoda_api_key"

# What the API key guards: the API, the dashboard, and which prefixes are cached.
PROTECTED = ("/v1", "/dashboard", "/kv_events")


class APIKeyMiddleware:
    """Every route under `protected` needs `Authorization: Bearer <key>` (or
    Anthropic's `x-api-key: <key>`); a browser opening the dashboard gives the key
    once as `?api_key=` (the page then keeps it in a cookie for its event stream). The
    rest stay open."""

    def __init__(self, app, api_key: str, protected: tuple[str, ...] = PROTECTED) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.expected = b"Bearer " + self.api_key
        self.protected = protected

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        if secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
            return True
        if secrets.compare_digest(headers.get(b"x-api-key", b""), self.api_key):
            return True  # Anthropic's clients send the key so
        if not scope["path"].startswith("/dashboard"):
            return False
        request = Request(scope)
        given = request.query_params.get("api_key") or request.cookies.get(DASHBOARD_COOKIE)
        return given is not None and secrets.compare_digest(given.encode(), self.api_key)

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith(self.protected) and not self._authorized(scope):
            response = error(
                401, "Incorrect or missing API key.", "invalid_request_error", "invalid_api_key"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
