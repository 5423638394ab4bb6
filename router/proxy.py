"""The KV-aware, OpenAI-compatible proxy: its routing and its legs (its HTTP face is
``router.handlers``).

Stateless toward conversations: everything it knows about one comes from the registry, so any
number of replicas can serve alternate turns of the same conversation. Per request it asks
for a routing hint, sends the prefill leg (``max_tokens=1`` with the reuse handle) to the
chosen prefill node, then the decode leg (with P's params and the session id) to the chosen
decode node, and streams the answer back. The retention report comes from the decode engine
through its sidecar, never from the response, so streaming works.

If the registry gives no hint (unreachable, overloaded, failing: anything but its own word on
the request) the request is still served as plain P/D from the last known node list,
labelled DEGRADED in metrics and logs, and ``/health`` says ``degraded``.

Errors follow OpenAI's conventions (``router.errors``): 400 for a request that is not valid,
404 ``model_not_found`` for a model no node serves, 413 for a body over the limit, 502 for an
engine that failed or answered garbage, 503 when nothing can route the request, 504 for an
engine that timed out; an engine's own error answer passes through with its status. A 500 is
a bug in the router, logged with its traceback.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import structlog

from kvbroker.common.client.grpc_client import (
    RegistryCallError,
    RegistryEndpoint,
    open_channel,
    registry_stub,
)
from kvbroker.common.client.hint_batcher import HintBatcher
from kvbroker.common.rules import routing
from kvbroker.common.rules.handles import prefill_params
from kvbroker.common.rules.labels import label
from kvbroker.common.rules.prompt_size import PromptSize, PromptText
from kvbroker.router.auth import ApiKeys
from kvbroker.router.config import RouterConfig
from kvbroker.router.errors import engine_answer
from kvbroker.router.local_hints import HintSource, LocalHints
from kvbroker.router.metrics import RouterMetrics
from kvbroker.router.requests import Turn, encode
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2

log = structlog.get_logger("kvbroker.router")

# The registry's own word on a request, which the router passes on rather than route around:
# no ready node (waited for, or 404 for a model no node serves) and a request it refused (400).
# Any other failure to get a hint (the registry away, overloaded, failing) is served plain P/D.
_REGISTRY_ANSWERS = (
    registry_pb2.ERROR_REASON_NO_READY_NODE,
    registry_pb2.ERROR_REASON_INVALID_ARGUMENT,
)
# How often a request waiting for a ready node asks the registry again.
_READY_NODE_POLL_S = 0.1
# The background refresh of the node list may take this long.
_NODE_LIST_TIMEOUT_S = 2.0
# A hint that names a node the node list does not hold as ready shows the list is stale (read
# while the nodes rejoined a restarted registry, say): it is read again at once, at most this
# often, rather than at the next background refresh.
_STALE_LIST_REFRESH_S = 0.5
# A registry's answer that this router's credential is not accepted (configuration).
_CREDENTIAL_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
JSON_HEADERS = {"content-type": "application/json"}


class RegistryCall(enum.Enum):
    """The registry calls a router depends on, each of which its credential may be refused."""

    NODES = "ListNodes"
    HINTS = "BatchGetRoutingHints"


class RegistryDown(Exception):
    pass


class ModelNotFound(Exception):
    """No node the registry lists serves the model asked for."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


@dataclass
class Plan:
    """One request's plan: where each leg goes and what the registry said."""

    prefill: node_pb2.NodeSpec
    decode: node_pb2.NodeSpec
    lease: lease_pb2.Lease | None
    decision: str
    consistency: str
    reason: str
    # How the turn gets its KV (``TurnPath`` label): with DECODE_LOCAL there is no prefill leg.
    path: str = "RECOMPUTE"


@dataclass
class Router:
    registry: RegistryEndpoint
    config: RouterConfig = field(default_factory=RouterConfig)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    # The API keys clients must present, and their tenants (None: an open router).
    api_keys: ApiKeys | None = None

    def __post_init__(self) -> None:
        self.known_nodes: list[node_pb2.Node] = []
        # The nodes the last list holds as routable (``routing.routable``), and their ids.
        self._ready: list[routing.RoutedNode[node_pb2.Node]] = []
        self._ready_ids: frozenset[str] = frozenset()
        # When a hint last found the list stale (``_note_hinted_nodes``).
        self._stale_list_at = -math.inf
        # Why the registry could not be reached at the last call to it (None: it answered).
        self.registry_away: str | None = "not reached yet"
        # Why the registry refused this router's credential, by the call it refused (a
        # credential may allow one call and not another: a node's lists nodes but gets no
        # hints): a configuration error, said in /health and the log, not the registry's
        # absence. A refusal ends only when the same call is answered.
        self._refused: dict[RegistryCall, str] = {}
        # Whether the registry has answered a hint call of this router (until then /health
        # cannot say ``ok``: its node list alone does not show the router may ask for hints).
        self._hints_answered = False
        self._turn = 0
        self.prompt_size = PromptSize()
        self._refresher: asyncio.Task[None] | None = None
        self._refreshing: asyncio.Future[None] | None = None
        self.local_hints = (
            LocalHints(self.config.hint_staleness_s, self.metrics)
            if self.config.local_hints
            else None
        )

    async def start(self) -> None:
        """Opens the clients on the serving event loop (grpc.aio binds to the loop)."""
        self._channel = open_channel(self.registry)
        self.stub = registry_stub(self._channel)
        # Concurrent turns share BatchGetRoutingHints calls; an idle router sends each alone.
        self.hints = HintBatcher(self.stub, self.config.hint_timeout_s)
        # The decode leg's timeouts are the client's; the prefill leg passes its own.
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                self.config.decode_timeout_s, connect=self.config.connect_timeout_s
            )
        )
        self._prefill_timeout = httpx.Timeout(
            self.config.prefill_timeout_s, connect=self.config.connect_timeout_s
        )
        self._refresher = asyncio.create_task(self._refresh_nodes())
        if self.local_hints is not None:
            self.local_hints.start(self.stub)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.local_hints is not None:
            await self.local_hints.close()
        await self.http.aclose()
        await self._channel.close()

    async def _refresh_nodes(self) -> None:
        while True:
            if not self._hints_answered:
                await self.check_hints()  # first: a node list read says the check was made
            await self.refresh_nodes()
            await asyncio.sleep(self.config.node_refresh_s)

    @property
    def registry_refused(self) -> str | None:
        """Why the registry refuses this router's credential for a call it needs (None: it
        refuses none that was made)."""
        return next(iter(self._refused.values()), None)

    @property
    def registry_confirmed(self) -> bool:
        """The registry has answered both calls the router depends on: its node list and a
        hint (what /health's ``ok`` means)."""
        return self._hints_answered and self.registry_away is None and not self._refused

    async def check_hints(self) -> None:
        """An empty batch of hints: whether the registry takes this router's hint calls,
        before any client's turn depends on it (an empty batch costs it nothing)."""
        try:
            await self.stub.BatchGetRoutingHints(
                registry_pb2.BatchGetRoutingHintsRequest(), timeout=_NODE_LIST_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in _CREDENTIAL_REFUSED:
                self._registry_failed(error, RegistryCall.HINTS)
            return  # away: asked again at the next refresh
        self._registry_answered(RegistryCall.HINTS)

    async def refresh_nodes(self, timeout_s: float = _NODE_LIST_TIMEOUT_S) -> None:
        """The registry's node list, for routing while it is away and for telling an unknown
        model; on failure the last list stays."""
        try:
            response = await self.stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            self._registry_failed(error, RegistryCall.NODES)
            return
        self.known_nodes = list(response.nodes)
        self._ready = [
            routed
            for routed in map(routing.RoutedNode.of_node, self.known_nodes)
            if routing.routable(routed, "")
        ]
        self._ready_ids = frozenset(routed.node_id for routed in self._ready)
        self._registry_answered(RegistryCall.NODES)

    def _refresh_now(self, timeout_s: float) -> asyncio.Future[None]:
        """A refresh of the node list, shared by every request that needs one now (a
        registry already failing hints gets one listing, not one per request)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh_nodes(timeout_s))
        return self._refreshing

    async def _fresh_nodes(self) -> None:
        await asyncio.shield(self._refresh_now(self.config.hint_timeout_s))

    def _note_hinted_nodes(self, hint: registry_pb2.RoutingHint) -> None:
        """Reads the node list again, in the background, when the hint names a node the list
        does not hold as ready. The list is what the router routes by should the registry then
        hang, when it can read no fresh one: a list read while the nodes rejoined a restarted
        registry would otherwise refuse every turn until the next background refresh."""
        hinted = (hint.decode.node_id, hint.prefill.node_id)
        if all(not node_id or node_id in self._ready_ids for node_id in hinted):
            return
        now = time.monotonic()
        if now - self._stale_list_at < _STALE_LIST_REFRESH_S:
            return
        self._stale_list_at = now
        self._refresh_now(_NODE_LIST_TIMEOUT_S)

    def ready_nodes(self) -> dict[str, int]:
        """How many nodes of each role the last list holds as routable: what the router
        can route by while the registry is away (/health says it)."""
        return {
            "prefill": sum(1 for routed in self._ready if routed.prefills),
            "decode": sum(1 for routed in self._ready if routed.decodes),
        }

    def _registry_answered(self, call: RegistryCall) -> None:
        self.registry_away = None
        if call is RegistryCall.HINTS:
            self._hints_answered = True
        if self._refused.pop(call, None) is not None and not self._refused:
            log.info("registry_credential_accepted")

    def _registry_failed(self, error: grpc.aio.AioRpcError, call: RegistryCall) -> None:
        """A call to the registry failed: it is away, or it refused this router's
        credential for that call (logged once, as the configuration error it is)."""
        why = error.details() or error.code().name
        self.registry_away = why
        if error.code() not in _CREDENTIAL_REFUSED:
            return
        if not self._refused:
            log.error(
                "registry_refused_credential",
                code=error.code().name,
                error=why,
                fix="give the router a credential the registry accepts (--token or --token-file, "
                "or --tls-client-cert and --tls-client-key); meanwhile turns are served plain "
                "P/D, without reuse",
            )
        self._refused[call] = why

    async def dry_run_hint(
        self, request: registry_pb2.GetRoutingHintRequest
    ) -> tuple[registry_pb2.RoutingHint, HintSource]:
        """A hint that claims nothing (``request.dry_run``): from this router's copy of the
        leader's state when it keeps a current one (``RouterConfig.local_hints``), else the
        registry's. Raises ``RegistryCallError`` (the registry's refusal) and
        ``routing.NoReadyNode`` (the copy's)."""
        source = HintSource.FORWARDED
        if self.local_hints is not None:
            hint, source = self.local_hints.answer(request)
            if hint is not None:
                return hint, source
        return await self.hints.hint(request), source

    def can_route_alone(self) -> bool:
        """Whether the last node list has a ready prefill and decode node (of any model): what
        the router needs to serve plain P/D while the registry is away."""
        return self._routes("") is not None

    # ------------------------------------------------------------ routing

    async def plan(
        self,
        conversation: str,
        model: str,
        text: PromptText | None = None,
        wanted: registry_pb2.TurnPath = registry_pb2.TURN_PATH_UNSPECIFIED,
    ) -> Plan:
        """The request's plan. While the registry has no ready node for the model, the request
        waits up to ``ready_node_wait_s`` for one: a node re-establishing its session after a
        registry failover, or an engine restarting, is a gap of a second or two that should
        delay requests, not fail them. A model no listed node serves is not waited for
        (``ModelNotFound``)."""
        deadline = time.monotonic() + self.config.ready_node_wait_s
        while True:
            try:
                return await self._plan_once(conversation, model, text, wanted)
            except RegistryCallError as error:
                if error.reason != registry_pb2.ERROR_REASON_NO_READY_NODE:
                    raise
                if not await self.may_serve(model):
                    raise ModelNotFound(model) from error
                if time.monotonic() + _READY_NODE_POLL_S > deadline:
                    raise
                self.metrics.ready_node_waits.inc()
            await asyncio.sleep(_READY_NODE_POLL_S)

    def _known_model(self, model: str) -> bool:
        """True unless the node list names nodes and none of them serves ``model``. The
        registry says only that no node is ready; a fleet with no nodes listed yet (starting)
        or with the model's nodes all down is not "no such model"."""
        return (
            not model
            or not self.known_nodes
            or any(node.spec.model == model for node in self.known_nodes)
        )

    async def may_serve(self, model: str) -> bool:
        """``_known_model`` on a fresh list when the last one says no (its nodes may have
        registered since)."""
        if self._known_model(model):
            return True
        await self.refresh_nodes()
        return self._known_model(model)

    async def _plan_once(
        self,
        conversation: str,
        model: str,
        text: PromptText | None,
        wanted: registry_pb2.TurnPath,
    ) -> Plan:
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=conversation, model=model, path=wanted
        )
        if text is not None:
            request.prompt_tokens, request.new_tokens = self.prompt_size.estimate(text)
        try:
            # Queued behind a batch in flight, a hint may wait up to one more call.
            hint = await asyncio.wait_for(self.hints.hint(request), 2 * self.config.hint_timeout_s)
        except TimeoutError:
            return await self._degraded_plan(model, "the registry did not answer in time")
        except RegistryCallError as error:
            if error.reason in _REGISTRY_ANSWERS:
                self._registry_answered(RegistryCall.HINTS)
                raise  # the registry answered: nowhere to send it, or a request at fault
            # Away (UNAVAILABLE, DEADLINE_EXCEEDED), overloaded (RESOURCE_EXHAUSTED), failing
            # (INTERNAL, UNKNOWN), this router's credential refused, or anything else: no
            # hint, but the turn can still be served.
            self._registry_failed(error, RegistryCall.HINTS)
            why = f"{error.code().name}: {error.message}" if error.message else error.code().name
            return await self._degraded_plan(model, why)
        self._registry_answered(RegistryCall.HINTS)
        self._note_hinted_nodes(hint)
        return Plan(
            prefill=hint.prefill,
            decode=hint.decode,
            lease=hint.lease if hint.HasField("lease") else None,
            decision=label(registry_pb2.HintDecision, hint.decision),
            consistency=label(registry_pb2.HintConsistency, hint.consistency),
            reason=hint.reason,
            path=label(registry_pb2.TurnPath, hint.path) if hint.path else "READ",
        )

    async def _degraded_plan(self, model: str, why: str) -> Plan:
        """Plain P/D by the registry's own routing rule, over the last node list it gave; when
        that list has no ready node for the model (taken before the nodes were ready, say),
        over a fresh one. Only when both have none is the request refused (``RegistryDown``).
        When no prefill node can hand KV to the decode node (a fleet mid-upgrade,
        ``routing.pairs``), the decode node computes the turn alone (DECODE_LOCAL), as a
        registry's degraded hint says."""
        routes = self._routes(model)
        if routes is None:
            await self._fresh_nodes()
            routes = self._routes(model)
        self.registry_away = why  # the hint failed, whatever a listing did
        if routes is None:
            raise ModelNotFound(model) if not self._known_model(model) else RegistryDown(why)
        self._turn += 1
        prefill, decode = routing.choose(routes, self._turn)
        if routing.pairs(prefill, decode):
            path, served = "RECOMPUTE", "plain P/D"
        else:
            path, served = "DECODE_LOCAL", "no prefill node can hand KV to the decode node"
        return Plan(
            prefill=prefill.spec,
            decode=decode.spec,
            lease=None,
            decision="MISS",
            consistency="DEGRADED",
            reason=f"no hint from the registry ({why}): {served}, without reuse",
            path=path,
        )

    def _routes(self, model: str) -> routing.Routes[routing.RoutedNode[node_pb2.Node]] | None:
        """Where the last node list can route the model (None: nowhere)."""
        try:
            return routing.candidates(map(routing.RoutedNode.of_node, self.known_nodes), model)
        except routing.NoReadyNode:
            return None

    def other_prefill(self, failed: str, model: str) -> node_pb2.NodeSpec | None:
        """A ready prefill node other than ``failed`` ("" for any), by the registry's routing
        rule."""
        others = [
            routed
            for routed in map(routing.RoutedNode.of_node, self.known_nodes)
            if routed.prefills and routed.node_id != failed and routing.routable(routed, model)
        ]
        if not others:
            return None
        self._turn += 1
        return routing.pick(others, self._turn).spec

    # ------------------------------------------------------------ legs

    async def prefill(
        self, node: node_pb2.NodeSpec, turn: Turn, lease: lease_pb2.Lease | None
    ) -> Any:
        """P's ``kv_transfer_params``, from the engine's endpoint of the turn's API. Raises
        ``httpx.HTTPError`` when P cannot be reached or does not answer within
        ``prefill_timeout_s``."""
        response = await self.http.post(
            node.http_base_url + turn.api.path,
            content=encode(turn.prefill_leg(prefill_params(lease))),
            headers=JSON_HEADERS,
            timeout=self._prefill_timeout,
        )
        answer = engine_answer(response, "prefill", node)
        prompt_tokens = turn.prompt_tokens(answer)
        if prompt_tokens is not None:
            self.prompt_size.learn(turn.text, prompt_tokens)
        return answer.get("kv_transfer_params")
