"""OpenAI's error body for what a client caused (or may retry), and server-sent
events framing (a stream's error event included)."""

from __future__ import annotations

import json
from typing import Any

from pagoda.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagoda.errors import EngineDeadError, InvalidRequestError, RequestFailedError


class APIError(Exception):
    """An error the client caused (or may retry), rendered as OpenAI's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(
            message=_printable(self.message),
            type=self.type,
            param=None if self.param is None else _printable(self.param),
            code=self.code,
        )
        return ErrorResponse(error=info).model_dump()


def _printable(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate a client sent (say, in an unknown
    field's name) shows as \\udXXX instead of breaking the error response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_invalid(error: InvalidRequestError, renames: dict[str, str] | None = None) -> APIError:
    """The front door's error as a 400 naming the body's field (SamplingParams and
    prompt names mapped to the endpoint's, e.g. logprobs -> top_logprobs for chat)."""
    param = (renames or {}).get(error.param, error.param)
    message = error.message
    if param != error.param and message.startswith(error.param):
        message = param + message[len(error.param) :]
    return bad_request(message, param, error.code)


def renamed(error: APIError, renames: dict[str, str]) -> APIError:
    """`error` naming the field as another API's body names it (its param, and the
    message that starts with it): for endpoints translated onto chat completions."""
    name = renames.get(error.param or "")
    if name is not None:
        if error.message.startswith(error.param):
            error.message = name + error.message[len(error.param) :]
        error.param = name
    return error


def failure_to_api_error(error: BaseException) -> APIError:
    """What a client sees of a request that failed after it was accepted."""
    if isinstance(error, RequestFailedError):
        if error.client_error:
            return bad_request(str(error), code="request_failed")
        return APIError(500, str(error), "InternalServerError", code="request_failed")
    if isinstance(error, EngineDeadError):
        return APIError(
            500, f"the engine stopped: {error}", "InternalServerError", code="engine_dead"
        )
    raise error


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_error(error: APIError) -> str:
    """An error event inside a stream that has already answered 200."""
    return sse(error.body())


SSE_DONE = "data: [DONE]\n\n"
