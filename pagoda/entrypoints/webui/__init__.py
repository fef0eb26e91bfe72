"""The chat page at `/`: a conversation with the served models in a browser, as
llama.cpp's server has one.

Static files in this package (`chat.html`, `chat.css`, `chat.js`, `markdown.js`, `views.js`: plain code,
no build step, nothing fetched from elsewhere) that talk to the server's own API:
`GET /v1/models` for the model and adapter pickers, `POST /v1/chat/completions`
(streamed) for the answers. Conversations and settings live in the browser's
localStorage, the API key too (the page asks for it when /v1/models answers 401;
`/` and `/ui/` themselves stay open).

Torch-free, so `pagoda router` serves the page as `pagoda serve` does.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException

# The files /ui/ serves, with their types: nothing else in the package is reachable.
_ASSETS = {
    "chat.css": "text/css; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "views.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

# Model output is rendered as HTML by the page's own escaping renderer; should that
# ever let markup through, no inline script runs and nothing loads from elsewhere.
_CSP = (
    "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; "
    "script-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'"
)
_HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": _CSP}


def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


def add_chat_page(app: FastAPI) -> None:
    """Add `GET /` (the page) and `GET /ui/{name}` (its script, style and icon) to `app`."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return Response(_read("chat.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    async def chat_asset(name: str) -> Response:
        if name not in _ASSETS:
            raise HTTPException(404, f"no file /ui/{name}")
        return Response(_read(name), media_type=_ASSETS[name], headers=_HEADERS)
