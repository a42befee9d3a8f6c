"""One error shape, `{"error": {message, type, param, code}}`, and one table from exceptions to it."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.admission import QueueFullError, ShuttingDown
from service.api.protocol import ErrorInfo, ErrorResponse
from service.engine.base import EngineError, RequestTooLargeError, SamplingError

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable",
               500: "internal_server_error"}


class ServingError(Exception):
    """An expected failure of one request, carrying the HTTP status it maps to."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.code = code  # OpenAI's error code where it names one (model_not_found); else the status

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "error"),
                                             param=self.param, code=self.code or self.status))


def bad_request(message: str, param: str | None = None) -> ServingError:
    """400: malformed JSON, wrong types, out-of-range values, prompts over the context."""
    return ServingError(400, message, param)


def empty_prompt() -> ServingError:
    """A completions text prompt of no tokens (an empty text without special tokens): the torch
    runtime would queue it forever; vLLM 0.32 fails inside the stream. Both runtimes refuse it."""
    return bad_request("the prompt has no tokens (an empty text, without special tokens)", "prompt")


def allowed_beside(param: str) -> ServingError:
    """allowed_token_ids beside a constraint of the reply (`param`): where the two admit no common
    token, vLLM 0.32 samples a token the grammar rejects and answers 500. Both runtimes refuse it."""
    return bad_request(f"allowed_token_ids cannot be combined with {param}: both restrict the reply's tokens",
                       "allowed_token_ids")


def error_response(error: ServingError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status, headers=error.headers)


def sse_error(error: ServingError) -> str:
    return f"data: {json.dumps(error.body().model_dump())}\n\n"


def from_exception(exc: BaseException) -> ServingError:
    """Map any exception to the ServingError a client sees; unknown ones are 500s and logged."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, RequestTooLargeError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, SamplingError):
        return bad_request(str(exc))
    if isinstance(exc, QueueFullError):
        return ServingError(503, f"server busy: {exc}", headers={"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(exc, ShuttingDown):
        return ServingError(503, str(exc), headers={"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(exc, EngineError):
        return ServingError(503, f"engine unavailable: {exc}", headers={"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc)
    if isinstance(exc, StarletteHTTPException):
        return ServingError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    log.error("unexpected error", exc_info=exc)
    return ServingError(500, f"internal error: {type(exc).__name__}")


# Parts of a pydantic error location that name a union's member type, not a field: `str`,
# `list[int]`, `function-after[_unicode(), str]`, `TextPart` (our fields are lower-case words).
UNION_MEMBER = re.compile(r"\[|^(str|int|float|bool|dict|list|none|[A-Z]\w*)$")


def _validation_error(exc: RequestValidationError) -> ServingError:
    """The first error, but a value's own error before a union's type mismatches: `"prompt":
    "\\ud800"` fails the `str` member for its surrogate and the `list` members for its type."""
    errors = exc.errors()
    error = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [str(part) for part in error.get("loc", ()) if part != "body" and not UNION_MEMBER.search(str(part))]
    if error.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {error.get('ctx', {}).get('error', error['msg'])}")
    if error.get("type") == "extra_forbidden":
        return bad_request(f"unsupported parameter: {'.'.join(loc)}", ".".join(loc))
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{error['msg']}", param)


def install_error_handlers(app: FastAPI) -> None:
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        return error_response(from_exception(exc))

    # Every type `from_exception` maps is registered by name: Starlette answers a bare `Exception`
    # handler's catch and then re-raises it (logged as a 500 with a traceback) even when the answer
    # was a 400.
    for exc_type in (ServingError, RequestValidationError, StarletteHTTPException, EngineError, RequestTooLargeError,
                     SamplingError, Exception):
        app.add_exception_handler(exc_type, handle)
