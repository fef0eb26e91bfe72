"""OpenAI's error body for what a client caused (or may retry), and server-sent
events framing (a stream's error event included)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

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


def _is_type(loc_part) -> bool:
    """A union arm's name in a validation error's location ("str", "list[...]")."""
    return isinstance(loc_part, str) and (
        loc_part in ("str", "int", "float", "bool", "none") or loc_part.endswith("]")
    )


def from_validation(errors: list[dict]) -> APIError:
    """A 400 for a body that failed its pydantic model (`ValidationError.errors()`),
    naming the field."""
    # The deepest first: of a union's arms, the one the body meant went furthest.
    errors = sorted(errors, key=lambda err: -len(err.get("loc", ())))
    param, parts = None, []
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type(x)]
        where = ".".join(loc) or "body"
        if err.get("type") == "json_invalid":
            parts.append(f"Malformed JSON in the request body: {err.get('msg')}")
            continue
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "extra_forbidden":  # OpenAI's words for an unknown field
            parts.append(f"Unrecognized request argument supplied: {where}")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return bad_request("; ".join(parts) or "invalid request", param)


def validated(body_type: type, renames: dict[str, str], **fields: Any):
    """`body_type(**fields)` for a body translated onto another API's (chat completions for
    Messages and Responses): a field that fails the model's own checks is a 400 naming
    it as the client's body does."""
    try:
        return body_type(**fields)
    except ValidationError as e:
        raise renamed(from_validation(e.errors()), renames) from None


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
