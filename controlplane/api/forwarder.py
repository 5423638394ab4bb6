"""A follower's answer to a call: the leader's, relayed whole, but for the hints it answers
itself.

On a follower the servicer hands each call to a ``Forwarder`` (``service._served`` decides).
``relay`` sends the request message as it arrived to the leader's RPC of the same name and
returns the leader's response message unchanged; it names no field of either, so a call or a
field added to the proto needs nothing here, and nothing is unpacked, rebuilt or converted on
the way (as etcd forwards a follower's proposals below its gRPC face, the request whole).

Whole messages rather than raw bytes through a generic handler: the servicer has decoded the
request already, to authorize it where it entered (``identity.authorize``) and to tell a hint
this replica answers itself, and it needs the response decoded to hide the incarnations a
caller may not see (``identity.hide_incarnations``). Raw bytes would save the follower one
re-encoding of the request and one decoding of the response, microseconds beside the hop to
the leader, at the cost of a second way in. Nothing is lost by decoding: protobuf keeps the
fields this replica's schema does not know and writes them back, so a request from a newer
client reaches the leader with them, and the leader's response comes back as it was sent.

The hint path is the follower's own. A hint that writes nothing (``fed_hints.served_locally``: a
dry run the routing rule alone answers) it answers from its copy of the leader's state while
that copy is current (``Leadership.local_hint``); a batch of only such hints too. While no
leader can be reached, hints are answered from this replica's etcd cache (DEGRADED,
``Leadership.cached_hint``) and every other call fails with NO_LEADER; the leader's errors are
relayed with their reason. The leader's stream of lease commands is relayed as it comes. Each
relayed call's outcome is counted in ``kvbroker_registry_forwarded_total``; ``served_by`` says
which replica answered the last hint.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from kvbroker.common.client.grpc_client import from_grpc_error
from kvbroker.common.process.tasks import own_cancellation
from kvbroker.common.rules.fed_hints import served_locally
from kvbroker.controlplane.api.interface import Leadership
from kvbroker.controlplane.config import MAX_HINT_BATCH
from kvbroker.controlplane.errors import NoLeader, RegistryError, hint_error
from kvbroker.v1 import registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

_LEADER_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_NO_LEADER = "no replica leads (election pending)"


class _LeaderAway(Exception):
    """No leader answers a hint: the hint comes from the cache instead (never leaves here)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Forwarder:
    """Relays calls to the leader that ``leadership`` names, each within ``timeout`` seconds."""

    def __init__(self, leadership: Leadership, timeout: float) -> None:
        self._leadership = leadership
        self._timeout = timeout
        self._outcomes = leadership.metrics.forwarded
        # The replica whose answer the last hint is: this one, or the leader.
        self.served_by = leadership.address

    async def answer(self, method: str, request: Any) -> Message:
        """The follower's answer to ``method``: a hint by its own path (``HINT_CALLS``),
        every other call relayed whole."""
        own = _OWN_PATHS.get(method)
        return await (own(self, request) if own is not None else self.relay(method, request))

    async def relay(self, method: str, request: Message, hint: bool = False) -> Any:
        """The leader's response to ``request``, as it sent it; its error relayed, except
        that a hint whose leader is away raises ``_LeaderAway`` (the leader's word that no
        node is ready is an answer, not its absence)."""
        rpc: Callable[..., Awaitable[Message]] = getattr(self._leader(hint), method)
        try:
            response = await rpc(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            failure = from_grpc_error(error)
            if (
                hint
                and failure.code() in _LEADER_UNREACHABLE
                and failure.reason != registry_pb2.ERROR_REASON_NO_READY_NODE
            ):
                self._outcomes.labels("leader_unreachable").inc()
                raise _LeaderAway(f"leader: {error.details()}") from error
            self._outcomes.labels("relayed_error").inc()
            raise failure from error
        except asyncio.CancelledError as error:
            # A change of leader closes the channel under the calls in flight, and grpc.aio
            # ends them with a bare CancelledError: a failed call, which would otherwise reach
            # the caller as the server's CANCELLED, not one to retry.
            if own_cancellation():
                raise
            self._outcomes.labels("leader_changed").inc()
            why = "the leader changed while the call was forwarded"
            if hint:
                raise _LeaderAway(why) from error
            raise NoLeader(f"{why}; retry shortly") from error
        self._outcomes.labels("ok").inc()
        return response

    def _leader(self, hint: bool = False) -> RegistryServiceStub:
        stub = self._leadership.leader_stub()
        if stub is None:
            self._outcomes.labels("no_leader").inc()
            if hint:
                raise _LeaderAway(_NO_LEADER)
            raise NoLeader(f"{_NO_LEADER}; retry shortly")
        return stub

    async def watch(
        self, request: registry_pb2.WatchLeaseCommandsRequest
    ) -> AsyncIterator[registry_pb2.WatchLeaseCommandsResponse]:
        """The leader's stream, for as long as it runs (no timeout: it is meant to last)."""
        async for response in self._leader().WatchLeaseCommands(request):
            yield response

    # ----------------------------------------------------------------- hints

    async def routing_hint(
        self, request: registry_pb2.GetRoutingHintRequest
    ) -> registry_pb2.GetRoutingHintResponse:
        if served_locally(request):
            local = self._leadership.local_hint(request.conversation_id, request.model)
            if local is not None:
                return registry_pb2.GetRoutingHintResponse(hint=local)
        try:
            response: registry_pb2.GetRoutingHintResponse = await self.relay(
                "GetRoutingHint", request, hint=True
            )
        except _LeaderAway as away:
            cached = await self._leadership.cached_hint(
                request.conversation_id, request.model, away.why
            )
            return registry_pb2.GetRoutingHintResponse(hint=cached)
        self.served_by = self._leadership.leader_address or ""
        return response

    async def routing_hints(
        self, request: registry_pb2.BatchGetRoutingHintsRequest
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        items = request.requests
        # A batch over the limit goes to the leader, which refuses it.
        if len(items) <= MAX_HINT_BATCH and all(served_locally(r) for r in items):
            local = self._local_hints(items)
            if local is not None:
                return local
        try:
            response: registry_pb2.BatchGetRoutingHintsResponse = await self.relay(
                "BatchGetRoutingHints", request, hint=True
            )
        except _LeaderAway as away:
            return await self._cached_hints(items, away.why)
        self.served_by = self._leadership.leader_address or ""
        return response

    def _local_hints(
        self, requests: Sequence[registry_pb2.GetRoutingHintRequest]
    ) -> registry_pb2.BatchGetRoutingHintsResponse | None:
        """Each hint from this follower's copy, each failing alone as the leader's would;
        None when the copy is too far behind (checked once: the batch is answered at once)."""
        response = registry_pb2.BatchGetRoutingHintsResponse()
        for item in requests:
            try:
                hint = self._leadership.local_hint(item.conversation_id, item.model)
            except RegistryError as error:
                response.results.add().error.CopyFrom(hint_error(error))
                continue
            if hint is None:
                return None
            response.results.add().hint.CopyFrom(hint)
        return response

    async def _cached_hints(
        self, requests: Sequence[registry_pb2.GetRoutingHintRequest], why: str
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        response = registry_pb2.BatchGetRoutingHintsResponse()
        for item in requests:
            result = response.results.add()
            try:
                hint = await self._leadership.cached_hint(item.conversation_id, item.model, why)
                result.hint.CopyFrom(hint)
            except RegistryError as error:
                result.error.CopyFrom(hint_error(error))
        return response


# The calls a follower answers by a path of its own; it relays every other whole.
_OWN_PATHS: dict[str, Callable[[Forwarder, Any], Awaitable[Message]]] = {
    "GetRoutingHint": Forwarder.routing_hint,
    "BatchGetRoutingHints": Forwarder.routing_hints,
}
# The calls whose answer names the replica that gave it (``SERVED_BY_METADATA_KEY``).
HINT_CALLS = frozenset(_OWN_PATHS)
