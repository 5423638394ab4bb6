"""What the router answers instead of a completion, in the shape of the API it was asked in.

Every refusal is an ``ApiError``: an HTTP status, a ``type`` and a machine-readable ``code``
that clients (and tests) decide on, and a sentence for people. Its body is in the request's
API's own shape (``ErrorShape``), since each client's SDK parses only its own: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` for chat completions, completions and
Responses; Anthropic's ``{"type": "error", "error": {"type", "message"}}`` for Messages, whose
``type`` says the HTTP status's meaning in Anthropic's words (``ANTHROPIC_TYPES``). Once a
streamed answer has started its status line is sent and cannot change, so a failure after that
is the same object as a server-sent event (``sse``), the way each API ends a stream that failed.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import httpx
import structlog
from starlette.responses import JSONResponse, Response

from kvbroker.common.client.grpc_client import RegistryCallError
from kvbroker.v1 import node_pb2, registry_pb2

log = structlog.get_logger("kvbroker.router")


class ErrorShape(StrEnum):
    """How an API says an error, in a body and at the end of a stream."""

    # Chat completions and completions: ``{"error": {...}}``; a stream ends with it as a
    # ``data:`` event, then ``[DONE]``.
    OPENAI = "openai"
    # The Responses API: the same body; a stream ends with an ``error`` event
    # (``{"type": "error", "code", "message", "param"}``), and has no ``[DONE]``.
    OPENAI_RESPONSES = "openai_responses"
    # Anthropic's Messages API: ``{"type": "error", "error": {"type", "message"}}``, in a
    # stream as an ``error`` event.
    ANTHROPIC = "anthropic"


# Anthropic's ``error.type`` by HTTP status (docs.anthropic.com/en/api/errors); a status not
# here is the server's fault, ``api_error``.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "api_error")


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
    # A field the API requires is absent.
    MISSING_FIELD = "missing_required_parameter"
    # A field the router cannot honour (the Responses API's ``previous_response_id``: the
    # history it names is on no node the router can tell).
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
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

    def body(self, shape: ErrorShape = ErrorShape.OPENAI) -> dict[str, Any]:
        """The error in ``shape``'s body."""
        if shape is ErrorShape.ANTHROPIC:
            return anthropic_error(self.status, self.message)
        return {
            "error": {
                "message": self.message,
                "type": self.error_type.value,
                "param": self.param,
                "code": self.code.value,
            }
        }

    def response(self, shape: ErrorShape = ErrorShape.OPENAI) -> JSONResponse:
        return JSONResponse(self.body(shape), self.status, headers=self.headers)

    def answer(self, path: str, shape: ErrorShape = ErrorShape.OPENAI) -> JSONResponse:
        """The response, logged (``log_answer``): what every route answers it with."""
        log_answer(path, self.status, self.code.value, self.message)
        return self.response(shape)

    def sse(self, shape: ErrorShape = ErrorShape.OPENAI) -> bytes:
        """The error as the last of a stream's events, as ``shape``'s API ends a stream that
        failed."""
        if shape is ErrorShape.ANTHROPIC:
            return _event("error", self.body(shape))
        if shape is ErrorShape.OPENAI_RESPONSES:
            event = {"type": "error", "code": self.code.value, "message": self.message,
                     "param": self.param}  # fmt: skip
            return _event("error", event)
        return b"data: " + json.dumps(self.body(shape)).encode() + b"\n\ndata: [DONE]\n\n"


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an answer of ``status``."""
    return {"type": "error", "error": {"type": anthropic_type(status), "message": message}}


def in_shape(status: int, body: bytes, shape: ErrorShape) -> bytes:
    """An engine's own error answer in ``shape``: as it came, unless the API is Anthropic's and
    the engine answered in OpenAI's shape (vLLM does for a request its validation refuses
    before its Messages handler runs)."""
    if shape is not ErrorShape.ANTHROPIC:
        return body
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    if not isinstance(answer, dict) or answer.get("type") == "error":
        return body
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        return body
    return json.dumps(anthropic_error(status, message)).encode()


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


def registry_refusal(error: RegistryCallError) -> ApiError:
    """The client's answer when the registry refuses a hint: 400 for a bad argument (the
    client's to fix: retrying it never helps), 503 otherwise (no ready node, or the registry
    unreachable: worth a retry)."""
    if error.reason == registry_pb2.ERROR_REASON_INVALID_ARGUMENT:
        return invalid_request(error.message, ErrorCode.INVALID_VALUE)
    code = (
        ErrorCode.NO_READY_NODE
        if error.reason == registry_pb2.ERROR_REASON_NO_READY_NODE
        else ErrorCode.REGISTRY_UNAVAILABLE
    )
    message = error.message or error.code().name
    return ApiError(503, message, ErrorType.UNAVAILABLE, code)


class UpstreamError(Exception):
    """An engine's own error answer (a JSON object with a status other than 200): passed
    through as it is, since it speaks the API's shape already (vLLM's validation errors), but
    for an OpenAI-shaped answer to a Messages request (``in_shape``)."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self, shape: ErrorShape = ErrorShape.OPENAI) -> Response:
        body = in_shape(self.status, self.body, shape)
        return Response(body, self.status, media_type=self.content_type)


def engine_answer(response: httpx.Response, leg: str, node: node_pb2.NodeSpec) -> dict[str, Any]:
    """An engine's answer, read: a JSON object when it is 200; its own error answer (a JSON
    object) as ``UpstreamError``; anything else, which no client could use, as a 502."""
    try:
        answer = json.loads(response.content)
    except ValueError:  # not JSON, or not text
        answer = None
    if not isinstance(answer, dict):
        raise upstream_failed(
            f"the {leg} node {node.node_id} answered {response.status_code} with a body that "
            "is not a JSON object",
            ErrorCode.UPSTREAM_INVALID_RESPONSE,
        )
    if response.status_code != 200:
        raise UpstreamError(
            response.status_code,
            response.content,
            response.headers.get("content-type", "application/json"),
        )
    return answer


def leg_failed(leg: str, node: node_pb2.NodeSpec, error: httpx.HTTPError) -> ApiError:
    """A leg that got no answer: 504 when the engine timed out, 502 when it could not be
    reached or its connection broke."""
    if isinstance(error, httpx.TimeoutException):
        code, what = ErrorCode.UPSTREAM_TIMEOUT, f"timed out ({type(error).__name__})"
    elif isinstance(error, httpx.ConnectError):
        code, what = ErrorCode.UPSTREAM_UNREACHABLE, f"is unreachable ({error})"
    else:
        code, what = ErrorCode.UPSTREAM_FAILED, f"failed ({error!r})"
    return upstream_failed(f"the {leg} node {node.node_id} {what}", code)
