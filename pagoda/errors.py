"""Errors a caller can act on, shared by the Python API and the HTTP server."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be served as given. `param` names the field (in
    SamplingParams' or the prompt's terms), `code` is OpenAI's code where it has
    one (e.g. "context_length_exceeded"). The server answers it with a 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class RequestFailedError(RuntimeError):
    """A request that was accepted but failed while running (an error in its own
    step inputs, sampling or detokenization). Only that request ends; the engine
    goes on. `client_error` is True when its input was the cause (a 400, not a 500)."""

    def __init__(self, message: str, client_error: bool = False) -> None:
        super().__init__(message)
        self.client_error = client_error


class EngineDeadError(RuntimeError):
    """The engine stopped after an error it could not pin on one request (`__cause__`
    says which). Every unfinished request ends with this error; a server exits."""


class QueueFullError(RuntimeError):
    """More requests are queued than `max_queue_len` allows; retry after `retry_after` s."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineNotAcceptingError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class DeadlineUnmeetableError(ValueError):
    """A request with a latency target (SLO) that the engine, by its measured step cost,
    cannot meet now: refused before it was queued (load shedding). `param` names the
    target ("slo_ttft_ms" or "slo_tpot_ms"); `retry_after`: whole seconds until it could
    be met, by the same estimate. The server answers it with a 429 and Retry-After."""

    def __init__(self, message: str, param: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
