"""What the router answers instead of a completion, in OpenAI's error shape.

Every refusal is an ``ApiError``: an HTTP status, a ``type`` and a machine-readable ``code``
that clients (and tests) decide on, and a sentence for people. The body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``. Once a streamed answer has started its
status line is sent and cannot change, so a failure after that is the same object as a
server-sent event (``sse``), the way vLLM and OpenAI end a stream that failed.
"""

from __future__ import annotations

import json
from enum import StrEnum

import structlog
from starlette.responses import JSONResponse

log = structlog.get_logger("kvbroker.router")


class ErrorType(StrEnum):
    """OpenAI's ``error.type``: whose fault it is, broadly."""

    INVALID_REQUEST = "invalid_request_error"
    # The registry cannot route the request now (no ready node, registry and node list gone).
    UNAVAILABLE = "unavailable"
    # An engine failed, timed out or answered something that is not an answer.
    UPSTREAM = "upstream_error"
    # A session route's lease call was refused.
    SESSION = "session_error"
    # A bug in the router.
    SERVER = "server_error"


class ErrorCode(StrEnum):
    """OpenAI's ``error.code``: what exactly went wrong."""

    INVALID_JSON = "invalid_json"
    INVALID_VALUE = "invalid_value"
    INVALID_SESSION_ID = "invalid_session_id"
    # No API key, or one the router does not hold (401).
    INVALID_API_KEY = "invalid_api_key"
    REQUEST_TOO_LARGE = "request_too_large"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NO_READY_NODE = "no_ready_node"
    REGISTRY_UNAVAILABLE = "registry_unavailable"
    # No connection to the engine.
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    # The connection broke (the engine died mid-answer) or did not speak HTTP.
    UPSTREAM_FAILED = "upstream_failed"
    # An HTTP answer whose body is not a JSON object.
    UPSTREAM_INVALID_RESPONSE = "upstream_invalid_response"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_CONFLICT = "session_conflict"
    INTERNAL_ERROR = "internal_error"


class ApiError(Exception):
    """A request the router answers itself; raised anywhere under a route, answered by the
    route's guard (``router.handlers``)."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: ErrorType,
        code: ErrorCode,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type.value,
                "param": self.param,
                "code": self.code.value,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)

    def answer(self, path: str) -> JSONResponse:
        """The response, logged (``log_answer``): what every route answers it with."""
        log_answer(path, self.status, self.code.value, self.message)
        return self.response()

    def sse(self) -> bytes:
        """The error as a stream's last event but for ``[DONE]``."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


# The reason code logged for an engine's own error answer, passed through as it came.
UPSTREAM_ANSWER = "upstream_answer"


def log_answer(path: str, status: int, code: str, message: str) -> None:
    """Every answer of the router's that is not a 2xx, logged once, with its reason code: a
    client's fault at info, the router's or an engine's at warning."""
    emit = log.warning if status >= 500 else log.info
    emit("answered_error", path=path, status=status, code=code, error=message)


def internal_error() -> ApiError:
    """A bug in the router (logged with its traceback where it is caught)."""
    return ApiError(
        500,
        "the router failed on this request (a bug; it is logged)",
        ErrorType.SERVER,
        ErrorCode.INTERNAL_ERROR,
    )


def invalid_request(message: str, code: ErrorCode, param: str | None = None) -> ApiError:
    return ApiError(400, message, ErrorType.INVALID_REQUEST, code, param)


def upstream_failed(message: str, code: ErrorCode) -> ApiError:
    """An engine's failure: 504 when it timed out, 502 otherwise (unreachable, or an answer
    that is not one)."""
    status = 504 if code is ErrorCode.UPSTREAM_TIMEOUT else 502
    return ApiError(status, message, ErrorType.UPSTREAM, code)
