"""The session routes: an agent keeps its conversation's KV retained through a long tool call
(``keepalive``), or frees it at once (``close``); each is the registry's lease call, answered
as the lease it leaves."""

from __future__ import annotations

from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvbroker.common.rules.labels import label
from kvbroker.router.auth import tenant_of
from kvbroker.router.errors import ApiError, ErrorCode, ErrorType, invalid_request
from kvbroker.router.proxy import Router
from kvbroker.router.requests import parse_object, read_body, session_id
from kvbroker.v1 import lease_pb2, registry_pb2

_LEASE_CALL_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, ErrorCode.INVALID_VALUE),
    grpc.StatusCode.NOT_FOUND: (404, ErrorCode.SESSION_NOT_FOUND),
    grpc.StatusCode.FAILED_PRECONDITION: (409, ErrorCode.SESSION_CONFLICT),
}


async def keepalive(router: Router, request: Request) -> Response:
    """An agent busy in a long tool call keeps its conversation's KV retained."""
    tenant = tenant_of(request)
    session = session_id(request.path_params["session_id"], limit=tenant.id_limit)
    raw = await read_body(
        request.stream(), request.headers.get("content-length"), router.config.max_body_bytes
    )
    payload = parse_object(raw) if raw else {}
    renew = registry_pb2.RenewLeaseRequest(conversation_id=tenant.conversation(session))
    ttl = payload.get("ttl_seconds")
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
            raise invalid_request(
                "ttl_seconds must be a positive number", ErrorCode.INVALID_VALUE, "ttl_seconds"
            )
        try:
            renew.time_to_live.FromNanoseconds(int(ttl * 1e9))
        except (ValueError, OverflowError):
            raise invalid_request(
                "ttl_seconds is out of range", ErrorCode.INVALID_VALUE, "ttl_seconds"
            ) from None
    return await _lease_call(router.stub.RenewLease(renew, timeout=2), session)


async def close(router: Router, request: Request) -> Response:
    """Explicit close: D frees the conversation's blocks at once."""
    tenant = tenant_of(request)
    session = session_id(request.path_params["session_id"], limit=tenant.id_limit)
    revoke = registry_pb2.RevokeLeaseRequest(
        conversation_id=tenant.conversation(session), reason="session closed by client"
    )
    return await _lease_call(router.stub.RevokeLease(revoke, timeout=2), session)


async def _lease_call(call: Any, session: str) -> Response:
    try:
        lease = (await call).lease
    except grpc.aio.AioRpcError as error:
        status, code = _LEASE_CALL_ERRORS.get(error.code(), (503, ErrorCode.REGISTRY_UNAVAILABLE))
        message = error.details() or error.code().name
        raise ApiError(status, message, ErrorType.SESSION, code) from error
    return JSONResponse(
        {
            "session_id": session,
            "lease_id": lease.lease_id,
            "epoch": lease.epoch,
            "state": label(lease_pb2.LeaseState, lease.state),
            "ttl_seconds": lease.time_to_live.ToNanoseconds() / 1e9,
        }
    )
