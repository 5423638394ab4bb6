"""The placement hop (``kvbroker placement``) in a real Envoy on loopback, before a picker that
honours the subset hint as GIE's endpoint-picker protocol says, then ORIGINAL_DST to fake
engines, against a real registry: a conversation's turns go to the decode node holding its KV;
a registry that is stopped, slow or says MISS changes nothing (fail open, never a 5xx); SSE
streams pass intact; and the GIE conformance assertions that apply to a hop before the
picker (the hop away with ``failure_mode_allow``, the destination the picker names is the one
served, routing follows the picker, an empty subset is a 503)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.credentials import fresh_credential, token_digest
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Announces, ChildProcess
from kvbroker.common.rules.tenants import (
    ApiKeys,
    ScopedSessions,
    SessionKeys,
    Tenant,
    session_key,
    sign_session,
)
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.gateway.config import EXT_PROC_SERVICE, Mode, PlacementConfig
from kvbroker.gateway.envoy_v3.envoy.config.core.v3 import base_pb2
from kvbroker.gateway.envoy_v3.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvbroker.gateway.ext_proc import HintBudget, PlacementProcessor, session_of
from kvbroker.gateway.server import RunningPlacement, start_placement
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.envoy import TEST_SELECTION_HEADER, Envoy, SubsetPicker
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from kvbroker_tools.stack import KVBROKER

# The prefill node's endpoint (from its URL: it registers no gateway endpoint).
PREFILL = "127.0.0.1:6700"
CHAT = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Chain:
    """Two decode engines, the picker over both, the hop (when given) and Envoy."""

    def __init__(self, engines: list[FakeEngine], picker: SubsetPicker, envoy: Envoy) -> None:
        self.engines, self.picker, self.envoy = engines, picker, envoy

    def endpoint(self, index: int) -> str:
        return f"127.0.0.1:{self.engines[index].port}"

    async def chat(self, http: httpx.AsyncClient, **headers: str) -> httpx.Response:
        return await http.post(f"{self.envoy.url}/v1/chat/completions", json=CHAT, headers=headers)


async def start_chain(
    stack: AsyncExitStack,
    tmp_path: Path,
    placement: str | None,
    picker_fail_open: bool = False,
    placement_token: str | None = None,
) -> Chain:
    engines = [FakeEngine(f"decode-{i}") for i in range(2)]
    for engine in engines:
        await stack.enter_async_context(engine)
    picker = SubsetPicker([f"127.0.0.1:{e.port}" for e in engines])
    await picker.start()
    stack.push_async_callback(picker.stop)
    envoy = Envoy(
        tmp_path, picker.address, placement, picker_fail_open, placement_token=placement_token
    )
    await envoy.start()
    stack.push_async_callback(envoy.stop)
    return Chain(engines, picker, envoy)


async def start_hop(
    stack: AsyncExitStack,
    registry: str,
    mode: Mode = Mode.PRE_EPP,
    timeout_s: float = 1.0,
    **settings: Any,
) -> RunningPlacement:
    """The hop, with a deadline that a loaded test machine cannot miss (but in the test of
    the deadline itself): a missed one is a request sent on unchanged, by design."""
    config = PlacementConfig(listen="127.0.0.1:0", mode=mode, hint_timeout_s=timeout_s, **settings)
    hop = await start_placement(RegistryEndpoint.parse(registry), config)
    stack.push_async_callback(hop.stop)
    return hop


def decode_nodes(chain: Chain) -> list[node_pb2.NodeSpec]:
    """The engines as their sidecars register them (the endpoint the gateway sees included),
    and a prefill node, which the registry needs to answer hints."""
    specs = [node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)]
    for index in range(2):
        spec = node_spec(f"decode-{index}", port=5600 + 10 * index)
        spec.gateway_endpoint = chain.endpoint(index)
        spec.dynamo_worker_id = f"77{index}"
        specs.append(spec)
    return specs


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as exits:
        yield exits


async def test_turns_go_to_the_decode_node_holding_the_kv(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    hop = await start_hop(stack, registry_server.address)
    chain = await start_chain(stack, tmp_path, hop.address)
    nodes = decode_nodes(chain)
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=10) as http:
        await grant(stub, nodes[2], "conv-1", "req-1", tokens=512)
        for _ in range(6):
            answer = await chain.chat(http, **{"x-session-id": "conv-1"})
            assert answer.status_code == 200, answer.text
        assert [len(e.received) for e in chain.engines] == [0, 6]
        # The hop sees no body, so no prompt size: the planner answers READ, whose subset is
        # the decode node holding the KV and the prefill node (outside this picker's pool).
        pick = chain.picker.picks[-1]
        assert pick.subset == [chain.endpoint(1), PREFILL]
        assert pick.headers["x-kvbroker-decode"] == "decode-1"
        assert pick.headers["x-kvbroker-prefill"] == "prefill-0"
        assert pick.headers["x-gateway-destination-endpoint-subset"] == ",".join(pick.subset)

        # An agent's own session header names the conversation too.
        await grant(stub, nodes[1], "agent-7", "req-2", tokens=512)
        await chain.chat(http, **{"x-claude-code-session-id": "agent-7"})
        assert chain.picker.picks[-1].endpoint == chain.endpoint(0)

        # A conversation with nothing retained (MISS), and a request with no session: no
        # mutation, the picker spreads them as it would.
        before = len(chain.picker.picks)
        for headers in ({"x-session-id": "conv-new"}, {}, {"x-session-id": "conv-new"}, {}):
            assert (await chain.chat(http, **headers)).status_code == 200
        for pick in chain.picker.picks[before:]:
            assert pick.subset is None
            assert not any(name.startswith("x-kvbroker") for name in pick.headers)
        assert {p.endpoint for p in chain.picker.picks[before:]} == {
            chain.endpoint(0),
            chain.endpoint(1),
        }


async def test_dynamo_mode_writes_the_pin_headers_only(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    hop = await start_hop(stack, registry_server.address, Mode.DYNAMO_HEADERS)
    chain = await start_chain(stack, tmp_path, hop.address)
    nodes = decode_nodes(chain)
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=10) as http:
        await grant(stub, nodes[2], "conv-1", "req-1", tokens=512)
        assert (await chain.chat(http, **{"x-session-id": "conv-1"})).status_code == 200
        pick = chain.picker.picks[-1]
        assert pick.headers["x-worker-instance-id"] == "771"
        assert pick.subset is None  # no metadata: Dynamo's frontend reads headers
        assert "x-kvbroker-decode" not in pick.headers
        assert "x-gateway-destination-endpoint-subset" not in pick.headers


async def test_a_stopped_registry_changes_nothing_and_serves_every_request(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    hop = await start_hop(stack, registry_server.address)
    chain = await start_chain(stack, tmp_path, hop.address)
    nodes = decode_nodes(chain)
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=10) as http:
        await grant(stub, nodes[2], "conv-1", "req-1", tokens=512)
        assert (await chain.chat(http, **{"x-session-id": "conv-1"})).status_code == 200
        assert chain.picker.picks[-1].subset == [chain.endpoint(1), PREFILL]
        await registry_server.stop(grace=0)
        answers = [await chain.chat(http, **{"x-session-id": "conv-1"}) for _ in range(20)]
    assert [a.status_code for a in answers] == [200] * 20
    for pick in chain.picker.picks[1:]:
        assert pick.subset is None
        assert "x-kvbroker-decode" not in pick.headers


async def silent_registry(stack: AsyncExitStack) -> str:
    """A registry that takes every hint and answers none until the test ends."""
    released = asyncio.Event()
    stack.callback(released.set)

    async def hint(request: registry_pb2.GetRoutingHintRequest, context: object) -> object:
        await released.wait()
        return registry_pb2.GetRoutingHintResponse()

    server = grpc.aio.server()
    method = grpc.unary_unary_rpc_method_handler(
        hint,
        request_deserializer=registry_pb2.GetRoutingHintRequest.FromString,
        response_serializer=registry_pb2.GetRoutingHintResponse.SerializeToString,
    )
    name = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(name, {"GetRoutingHint": method}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stack.push_async_callback(server.stop, 0)
    return f"127.0.0.1:{port}"


async def test_a_slow_registry_fails_open_within_the_deadline(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    registry = await silent_registry(stack)
    hop = await start_hop(stack, registry, timeout_s=0.05)
    chain = await start_chain(stack, tmp_path, hop.address)
    async with httpx.AsyncClient(timeout=10) as http:
        await chain.chat(http)  # Envoy's first connections
        for _ in range(5):
            started = time.perf_counter()
            answer = await chain.chat(http, **{"x-session-id": "conv-1"})
            took = time.perf_counter() - started
            assert answer.status_code == 200
            # The hop's deadline (50 ms) bounds the wait for a registry that never answers.
            assert took < 1.0, took
    assert all(pick.subset is None for pick in chain.picker.picks)


async def test_server_sent_events_pass_through_intact(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    hop = await start_hop(stack, registry_server.address)
    chain = await start_chain(stack, tmp_path, hop.address)
    nodes = decode_nodes(chain)
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=10) as http:
        await grant(stub, nodes[2], "conv-1", "req-1", tokens=512)
        direct = await http.post(
            f"{chain.engines[0].url}/v1/chat/completions", json={**CHAT, "stream": True}
        )
        async with http.stream(
            "POST",
            f"{chain.envoy.url}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-session-id": "conv-1"},
        ) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = [line async for line in streamed.aiter_lines()]
    assert events == direct.text.splitlines()
    assert events[-2:] == ["data: [DONE]", ""]
    assert len(chain.engines[1].received) == 1  # the pinned node served it


# GIE conformance (v1.6.0), the assertions that apply to a hop before the picker.


async def test_conformance_the_hop_away_fails_open(stack: AsyncExitStack, tmp_path: Path) -> None:
    """``epp_unavailable_fail_open``, for this hop: its filter has failure_mode_allow, so
    with nothing listening at its address every request is still served by the picker."""
    chain = await start_chain(stack, tmp_path, f"127.0.0.1:{free_port()}")
    async with httpx.AsyncClient(timeout=10) as http:
        answers = [await chain.chat(http, **{"x-session-id": "conv-1"}) for _ in range(10)]
    assert [a.status_code for a in answers] == [200] * 10
    assert sum(len(e.received) for e in chain.engines) == 10


async def test_conformance_routing_follows_the_picker_and_its_destination_is_served(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    """``gateway_following_epp_routing`` and ``gateway_destination_endpoint_served``: the
    endpoint the picker names is the one that serves, the hop before it notwithstanding."""
    hop = await start_hop(stack, registry_server.address)
    chain = await start_chain(stack, tmp_path, hop.address)
    async with Heartbeats(stub, *decode_nodes(chain)), httpx.AsyncClient(timeout=10) as http:
        for target in (0, 1, 1, 0):
            selection = {TEST_SELECTION_HEADER: chain.endpoint(target), "x-session-id": "c"}
            answer = await chain.chat(http, **selection)
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["message"]["content"] == f"from decode-{target}"
    assert [len(e.received) for e in chain.engines] == [2, 2]


async def test_conformance_an_empty_subset_is_a_503(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    """The picker chooses only inside the subset: a holder registered with an endpoint the
    gateway does not know leaves nothing to choose, and the picker answers 503 (so a
    sidecar's --gateway-endpoint must be the address the gateway sees)."""
    hop = await start_hop(stack, registry_server.address)
    chain = await start_chain(stack, tmp_path, hop.address)
    nodes = decode_nodes(chain)
    nodes[2].gateway_endpoint = "10.255.0.7:8000"
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=10) as http:
        await grant(stub, nodes[2], "conv-1", "req-1", tokens=512)
        answer = await chain.chat(http, **{"x-session-id": "conv-1"})
    assert answer.status_code == 503
    assert chain.picker.picks[-1].subset == ["10.255.0.7:8000", PREFILL]
    assert sum(len(e.received) for e in chain.engines) == 0


async def test_with_credentials_only_an_authenticated_envoy_gets_pins(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    """A hop given tokens refuses a stream without one (UNAUTHENTICATED): the Envoy that
    lacks it serves every request unchanged (the hop fails open, as when it is away); the
    Envoy that sends it in its initial metadata gets its requests pinned."""
    token, line = fresh_credential("envoy")
    hop = await start_hop(
        stack, registry_server.address, token_digests=frozenset({line.split()[1]})
    )
    with_token = await start_chain(stack, tmp_path, hop.address, placement_token=token)
    without = await start_chain(stack, tmp_path, hop.address, placement_token="not-the-token")
    nodes = decode_nodes(with_token)
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=10) as http:
        await grant(stub, nodes[2], "conv-1", "req-1", tokens=512)
        assert (await with_token.chat(http, **{"x-session-id": "conv-1"})).status_code == 200
        assert with_token.picker.picks[-1].subset == [with_token.endpoint(1), PREFILL]
        for _ in range(2):
            assert (await without.chat(http, **{"x-session-id": "conv-1"})).status_code == 200
        assert [pick.subset for pick in without.picker.picks] == [None, None]
    async with grpc.aio.insecure_channel(hop.address) as channel:
        process = channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )
        call = process(iter([headers_message("conv-1")]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_with_tenants_keys_a_session_is_pinned_only_for_its_own_tenant(
    stack: AsyncExitStack,
    tmp_path: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    """Given the tenants' keys, the hop asks about a session as its client's tenant's: tenant
    B's session id sent with A's key, with no key, with a key the file does not hold, or
    signed with A's key in B's name pins nothing (the request is served unchanged); B's own
    key, or B's signed session id, pins B's conversation to the node holding its KV. B's lease
    keeps its id and epoch throughout."""
    keys = {"acme": "acme-api-key", "globex": "globex-api-key"}
    sessions = ScopedSessions(
        ApiKeys({token_digest(key): Tenant(name) for name, key in keys.items()}),
        SessionKeys.of({session_key(key): Tenant(name) for name, key in keys.items()}),
    )
    hop = await start_hop(stack, registry_server.address, sessions=sessions)
    chain = await start_chain(stack, tmp_path, hop.address)
    nodes = decode_nodes(chain)
    globex = Tenant("globex")
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=10) as http:
        lease = await grant(stub, nodes[2], globex.conversation("conv-b"), "req-1", tokens=512)
        refused = (
            {"x-session-id": "conv-b", "authorization": f"Bearer {keys['acme']}"},
            {"x-session-id": "globex/conv-b", "authorization": f"Bearer {keys['acme']}"},
            {"x-session-id": "conv-b"},
            {"x-session-id": "globex/conv-b"},
            {"x-session-id": "conv-b", "authorization": "Bearer not-a-key"},
            {"x-session-id": sign_session(keys["acme"], globex, "conv-b")},
            {
                "x-session-id": sign_session(keys["globex"], globex, "conv-b"),
                "authorization": f"Bearer {keys['acme']}",
            },
        )
        for headers in refused:
            assert (await chain.chat(http, **headers)).status_code == 200
            assert chain.picker.picks[-1].subset is None, headers
        for headers in (
            {"x-session-id": "conv-b", "authorization": f"Bearer {keys['globex']}"},
            {"x-session-id": "conv-b", "x-api-key": keys["globex"]},
            {"x-session-id": sign_session(keys["globex"], globex, "conv-b")},
        ):
            assert (await chain.chat(http, **headers)).status_code == 200
            assert chain.picker.picks[-1].subset == [chain.endpoint(1), PREFILL], headers
        after = await stub.GetLease(registry_pb2.GetLeaseRequest(lease_id=lease.lease_id))
    assert (after.lease.lease_id, after.lease.epoch) == (lease.lease_id, lease.epoch)


def headers_message(session: str) -> ep.ProcessingRequest:
    """The request-headers message Envoy sends for a request of ``session``."""
    header = base_pb2.HeaderValue(key="x-session-id", raw_value=session.encode())
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[header]))
    )


class CountingStub:
    """The registry's stub, counting the hints asked through it."""

    def __init__(self, stub: RegistryServiceStub) -> None:
        self.stub = stub
        self.hints = 0

    async def GetRoutingHint(
        self, request: registry_pb2.GetRoutingHintRequest, **options: Any
    ) -> registry_pb2.GetRoutingHintResponse:
        self.hints += 1
        response: registry_pb2.GetRoutingHintResponse = await self.stub.GetRoutingHint(
            request, **options
        )
        return response


class Context:
    """What the processor reads of a gRPC call's context: its metadata (none here)."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


async def test_a_stream_asks_one_hint_and_a_flood_stays_within_the_cap(
    registry_server: RunningRegistry, stub: RegistryServiceStub
) -> None:
    """A stream of 3,000 header messages asks the registry once (each answered, unchanged
    after the first); 200 streams at once against a cap of 20 hints a second ask at most the
    cap's burst, and every stream is answered."""
    counting = CountingStub(stub)
    config = PlacementConfig(listen="127.0.0.1:0", hint_timeout_s=1.0, max_hints_per_s=20)
    processor = PlacementProcessor(counting, config)  # type: ignore[arg-type]
    decode, prefill = node_spec("decode-0"), node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL)
    async with Heartbeats(stub, decode, prefill):
        await grant(stub, decode, "conv-1", "req-1", tokens=512)

        async def requests(count: int) -> AsyncIterator[ep.ProcessingRequest]:
            for _ in range(count):
                yield headers_message("conv-1")

        context: Any = Context()
        answers = [a async for a in processor.process(requests(3000), context)]
        assert len(answers) == 3000 and counting.hints == 1
        assert answers[0].request_headers.response.header_mutation.set_headers  # pinned
        assert not any(a.request_headers.response.header_mutation.set_headers for a in answers[1:])

        counting.hints = 0
        # The clock stands still: the cap's burst, and nothing refilled however long the 200
        # streams take on a busy machine.
        processor.budget = HintBudget(config.max_hints_per_s, now=lambda: 0.0)
        streams = await asyncio.gather(
            *(collect(processor.process(requests(1), context)) for _ in range(200))
        )
        assert all(len(answers) == 1 for answers in streams)
        assert counting.hints == 20


async def collect(answers: AsyncIterator[ep.ProcessingResponse]) -> list[ep.ProcessingResponse]:
    return [answer async for answer in answers]


def test_the_hint_budget_refills_at_its_rate() -> None:
    now = [0.0]
    budget = HintBudget(rate=10, now=lambda: now[0])
    assert sum(budget.take() for _ in range(50)) == 10  # a second's worth at once
    now[0] += 0.5
    assert sum(budget.take() for _ in range(50)) == 5
    now[0] += 100
    assert sum(budget.take() for _ in range(50)) == 10  # never more than a second's worth


def test_the_session_header_comes_before_the_agents_headers() -> None:
    both = {"x-claude-code-session-id": "agent", "x-session-id": "conv"}
    assert session_of(both) == "conv"
    assert session_of({"x-session-id": "  ", "session_id": "codex"}) == "codex"
    assert session_of({"x-session-affinity": "open"}) == "open"
    assert session_of({}) == ""


async def test_the_cli_serves_the_hop_with_health(
    tmp_path: Path, registry_server: RunningRegistry
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    hop = ChildProcess(
        "placement",
        [KVBROKER, "placement", "serve", "--listen", listen, "--registry", registry_server.address],
        tmp_path / "placement.log",
        ready=[Announces()],
    )
    await hop.start()
    try:
        assert hop.announced == {"placement": listen}
        async with grpc.aio.insecure_channel(listen) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", EXT_PROC_SERVICE):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await hop.stop()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--listen", "nowhere"], "HOST:PORT"),
        (["--hint-timeout", "0"], "0 is not above 0 seconds"),
        (["--mode", "epp"], "epp"),
        (["--api-keys", "/nonexistent/api-keys"], "cannot read /nonexistent/api-keys"),
        (["--session-keys", "/nonexistent/keys"], "cannot read /nonexistent/keys"),
    ],
)
async def test_the_cli_refuses_bad_flags_clearly(flags: list[str], says: str) -> None:
    process = await asyncio.create_subprocess_exec(
        KVBROKER,
        "placement",
        "serve",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 2
    assert says in (out + err).decode()
    assert "Traceback" not in (out + err).decode()


async def test_the_overhead_bench_runs_both_arms(tmp_path: Path) -> None:
    """`kvbroker bench placement`, short: both arms answered every request, files written."""
    process = await asyncio.create_subprocess_exec(
        KVBROKER, "bench", "placement", "--rate", "20", "--seconds", "2",
        "--output", str(tmp_path / "out"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await process.communicate()
    assert process.returncode == 0, out.decode()
    report = json.loads((tmp_path / "out" / "placement.json").read_text())
    assert [(a["arm"], a["requests"], a["errors"]) for a in report["arms"]] == [
        ("without", 40, 0),
        ("with", 40, 0),
    ]
    assert (tmp_path / "out" / "placement_latency.png").stat().st_size > 0
