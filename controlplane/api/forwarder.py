"""A follower's ``RegistryApi``: each call is the leader's RPC of the same name, but for hints
that write nothing.

A hint that writes nothing (``hints.served_locally``: a dry run the routing rule alone
answers) the follower answers itself from its copy of the leader's state while that copy is
current (``Leadership.local_hint``); a batch of only such hints too. Everything else it
rebuilds from the call's arguments, sends to the leader within ``timeout``, and returns the
leader's answer as the leader's ``Registry`` would, so the servicer answers the same response
either way; the leader's errors are relayed with their reason. While no leader can be
reached, hints are answered from this replica's etcd cache (DEGRADED,
``Leadership.cached_hint``) and every other call fails with NO_LEADER. Each forwarded call's
outcome is counted in ``kvbroker_registry_forwarded_total``; ``served_by`` says which replica
answered the last hint.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import grpc

from kvbroker.common.client.grpc_client import from_grpc_error
from kvbroker.common.process.tasks import own_cancellation
from kvbroker.common.rules.clock import to_duration
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.api.interface import Leadership
from kvbroker.controlplane.config import MAX_HINT_BATCH
from kvbroker.controlplane.errors import NoLeader, RegistryError, hint_error
from kvbroker.controlplane.placement.hints import served_locally
from kvbroker.controlplane.placement.planner import UNSAID, TurnRequest
from kvbroker.controlplane.placement.prefix_match import PrefixMatch
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.answers import LeaseAnswer, NodeAnswer, Registration
from kvbroker.controlplane.records.model import Conversation, CostProfile, EngineWork, NodeLoad
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

Resp = TypeVar("Resp")

_LEADER_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_NO_LEADER = "no replica leads (election pending)"


class _LeaderAway(Exception):
    """No leader answers a hint: the hint comes from the cache instead (never leaves here)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Forwarder:
    """Calls the leader that ``leadership`` names, each call within ``timeout`` seconds."""

    def __init__(self, leadership: Leadership, timeout: float) -> None:
        self._leadership = leadership
        self._timeout = timeout
        self._outcomes = leadership.metrics.forwarded
        # The replica whose answer the last hint is: this one, or the leader.
        self.served_by = leadership.address

    def _stub(self, hint: bool = False) -> RegistryServiceStub:
        stub = self._leadership.leader_stub()
        if stub is None:
            self._outcomes.labels("no_leader").inc()
            if hint:
                raise _LeaderAway(_NO_LEADER)
            raise NoLeader(f"{_NO_LEADER}; retry shortly")
        return stub

    async def _call(
        self, rpc: Callable[..., Awaitable[Resp]], request: Any, hint: bool = False
    ) -> Resp:
        """The leader's answer; its error relayed, except that a hint whose leader is away
        raises ``_LeaderAway`` (the leader's word that no node is ready is an answer, not
        its absence)."""
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

    # ----------------------------------------------------------------- nodes

    async def register_node(self, spec: node_pb2.NodeSpec) -> Registration:
        request = registry_pb2.RegisterNodeRequest(spec=spec)
        response: registry_pb2.RegisterNodeResponse = await self._call(
            self._stub().RegisterNode, request
        )
        return convert.registration_of(response)

    async def heartbeat(
        self,
        node_id: str,
        incarnation: str,
        engine_ready: bool,
        load: NodeLoad,
        work: EngineWork | None = None,
    ) -> NodeAnswer:
        request = registry_pb2.HeartbeatRequest(
            node_id=node_id, incarnation=incarnation, engine_ready=engine_ready
        )
        codec.load_into(load, request.load)
        if work is not None:
            codec.work_into(work, request.work)
        response: registry_pb2.HeartbeatResponse = await self._call(self._stub().Heartbeat, request)
        return convert.node_of(response.node)

    async def deregister_node(self, node_id: str, incarnation: str) -> NodeAnswer:
        request = registry_pb2.DeregisterNodeRequest(node_id=node_id, incarnation=incarnation)
        response: registry_pb2.DeregisterNodeResponse = await self._call(
            self._stub().DeregisterNode, request
        )
        return convert.node_of(response.node)

    async def drain_node(self, node_id: str) -> NodeAnswer:
        request = registry_pb2.DrainNodeRequest(node_id=node_id)
        response: registry_pb2.DrainNodeResponse = await self._call(self._stub().DrainNode, request)
        return convert.node_of(response.node)

    async def set_cost_profile(self, node_id: str, cost: CostProfile | None) -> NodeAnswer:
        request = registry_pb2.SetCostProfileRequest(node_id=node_id)
        if cost is not None:
            codec.cost_into(cost, request.cost)
        response: registry_pb2.SetCostProfileResponse = await self._call(
            self._stub().SetCostProfile, request
        )
        return convert.node_of(response.node)

    async def get_node(self, node_id: str) -> NodeAnswer:
        request = registry_pb2.GetNodeRequest(node_id=node_id)
        response: registry_pb2.GetNodeResponse = await self._call(self._stub().GetNode, request)
        return convert.node_of(response.node)

    async def list_nodes(self, role: int = 0, model: str = "") -> list[NodeAnswer]:
        request = registry_pb2.ListNodesRequest(role=cast(node_pb2.NodeRole, role), model=model)
        response: registry_pb2.ListNodesResponse = await self._call(self._stub().ListNodes, request)
        return [convert.node_of(node) for node in response.nodes]

    # ----------------------------------------------------------------- leases

    async def grant_lease(
        self,
        conversation_id: str,
        node_id: str,
        incarnation: str,
        handle: lease_pb2.KvHandle,
        block_hashes: Sequence[bytes],
        token_count: int,
        ttl: float | None = None,
        block_hash_stride: int = 1,
    ) -> LeaseAnswer:
        request = registry_pb2.GrantLeaseRequest(
            conversation_id=conversation_id,
            node_id=node_id,
            node_incarnation=incarnation,
            handle=handle,
            block_hashes=block_hashes,
            token_count=token_count,
            block_hash_stride=block_hash_stride,
        )
        _stamp_ttl(request, ttl)
        response: registry_pb2.GrantLeaseResponse = await self._call(
            self._stub().GrantLease, request
        )
        return convert.lease_of(response.lease)

    async def renew_lease(
        self, lease_id: str = "", conversation_id: str = "", ttl: float | None = None
    ) -> LeaseAnswer:
        request = registry_pb2.RenewLeaseRequest(lease_id=lease_id, conversation_id=conversation_id)
        _stamp_ttl(request, ttl)
        response: registry_pb2.RenewLeaseResponse = await self._call(
            self._stub().RenewLease, request
        )
        return convert.lease_of(response.lease)

    async def release_lease(
        self, lease_id: str, node_id: str, incarnation: str, reason: str
    ) -> LeaseAnswer:
        request = registry_pb2.ReleaseLeaseRequest(
            lease_id=lease_id, node_id=node_id, node_incarnation=incarnation, reason=reason
        )
        response: registry_pb2.ReleaseLeaseResponse = await self._call(
            self._stub().ReleaseLease, request
        )
        return convert.lease_of(response.lease)

    async def revoke_lease(
        self, lease_id: str = "", conversation_id: str = "", reason: str = ""
    ) -> LeaseAnswer:
        request = registry_pb2.RevokeLeaseRequest(
            **_target(lease_id, conversation_id), reason=reason
        )
        response: registry_pb2.RevokeLeaseResponse = await self._call(
            self._stub().RevokeLease, request
        )
        return convert.lease_of(response.lease)

    async def get_lease(self, lease_id: str) -> LeaseAnswer:
        request = registry_pb2.GetLeaseRequest(lease_id=lease_id)
        response: registry_pb2.GetLeaseResponse = await self._call(self._stub().GetLease, request)
        return convert.lease_of(response.lease)

    async def list_leases(
        self,
        node_id: str = "",
        conversation_id: str = "",
        states: Sequence[int] = (),
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[LeaseAnswer], str]:
        request = registry_pb2.ListLeasesRequest(
            node_id=node_id,
            conversation_id=conversation_id,
            states=cast(Sequence[lease_pb2.LeaseState], states),
            page_size=page_size,
            page_token=page_token,
        )
        response: registry_pb2.ListLeasesResponse = await self._call(
            self._stub().ListLeases, request
        )
        return [convert.lease_of(lease) for lease in response.leases], response.next_page_token

    async def get_conversation(self, conversation_id: str) -> Conversation:
        request = registry_pb2.GetConversationRequest(conversation_id=conversation_id)
        response: registry_pb2.GetConversationResponse = await self._call(
            self._stub().GetConversation, request
        )
        return codec.conversation_of(response.conversation)

    async def report_retention(
        self,
        node_id: str,
        incarnation: str,
        events: Sequence[registry_pb2.RetentionEvent],
        full_snapshot: bool,
    ) -> registry_pb2.ReportRetentionResponse:
        request = registry_pb2.ReportRetentionRequest(
            node_id=node_id, incarnation=incarnation, events=events, full_snapshot=full_snapshot
        )
        return await self._call(self._stub().ReportRetention, request)

    async def watch_commands(
        self, node_id: str, incarnation: str
    ) -> AsyncIterator[registry_pb2.LeaseCommand]:
        """The leader's stream, for as long as it runs (no timeout: it is meant to last)."""
        request = registry_pb2.WatchLeaseCommandsRequest(node_id=node_id, incarnation=incarnation)
        async for response in self._stub().WatchLeaseCommands(request):
            yield response.command

    # ----------------------------------------------------------------- hints

    async def routing_hint(
        self,
        conversation_id: str,
        model: str,
        dry_run: bool = False,
        asked: TurnRequest = UNSAID,
        time_remaining: float | None = None,
    ) -> registry_pb2.RoutingHint:
        """``time_remaining`` is already in this forwarder's timeout."""
        if served_locally(dry_run, asked):
            local = self._leadership.local_hint(conversation_id, model)
            if local is not None:
                return local
        request = _hint_request(conversation_id, model, dry_run, asked)
        try:
            stub = self._stub(hint=True)
            response: registry_pb2.GetRoutingHintResponse = await self._call(
                stub.GetRoutingHint, request, hint=True
            )
        except _LeaderAway as away:
            return await self._leadership.cached_hint(conversation_id, model, away.why)
        self.served_by = self._leadership.leader_address or ""
        return response.hint

    async def routing_hints(
        self,
        requests: Sequence[registry_pb2.GetRoutingHintRequest],
        time_remaining: float | None = None,
    ) -> registry_pb2.BatchGetRoutingHintsResponse:
        # A batch over the limit goes to the leader, which refuses it.
        if len(requests) <= MAX_HINT_BATCH and all(
            served_locally(r.dry_run, TurnRequest.of(r)) for r in requests
        ):
            local = self._local_hints(requests)
            if local is not None:
                return local
        request = registry_pb2.BatchGetRoutingHintsRequest(requests=requests)
        try:
            stub = self._stub(hint=True)
            response: registry_pb2.BatchGetRoutingHintsResponse = await self._call(
                stub.BatchGetRoutingHints, request, hint=True
            )
        except _LeaderAway as away:
            return await self._cached_hints(requests, away.why)
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

    async def match_prefix(
        self,
        node_id: str,
        conversation_id: str,
        model: str,
        block_size: int,
        probes: Sequence[bytes],
    ) -> PrefixMatch:
        request = registry_pb2.MatchPrefixRequest(
            node_id=node_id,
            conversation_id=conversation_id,
            model=model,
            block_size=block_size,
            probe_hashes=probes,
        )
        response: registry_pb2.MatchPrefixResponse = await self._call(
            self._stub().MatchPrefix, request
        )
        return convert.match_of(response)

    async def end_read_pin(self, node_id: str, lease_id: str, pin_id: str) -> None:
        request = registry_pb2.EndReadPinRequest(node_id=node_id, lease_id=lease_id, pin_id=pin_id)
        await self._call(self._stub().EndReadPin, request)

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


def _target(lease_id: str, conversation_id: str) -> dict[str, str]:
    """The one field of a request's ``target`` oneof that the caller set (setting both would
    leave only the last)."""
    if conversation_id and not lease_id:
        return {"conversation_id": conversation_id}
    return {"lease_id": lease_id}


def _stamp_ttl(
    request: registry_pb2.GrantLeaseRequest | registry_pb2.RenewLeaseRequest, ttl: float | None
) -> None:
    if ttl is not None:
        request.time_to_live.CopyFrom(to_duration(ttl))


def _hint_request(
    conversation_id: str, model: str, dry_run: bool, asked: TurnRequest
) -> registry_pb2.GetRoutingHintRequest:
    return registry_pb2.GetRoutingHintRequest(
        conversation_id=conversation_id,
        model=model,
        dry_run=dry_run,
        prompt_tokens=asked.prompt_tokens,
        new_tokens=asked.new_tokens,
        path=asked.wanted,
        on_node_id=asked.on_node_id,
    )
