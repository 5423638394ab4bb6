"""The placement hop in front of NVIDIA Dynamo 1.6.1, every part real but the engines: a
registry, ``kvbroker placement serve --mode dynamo-headers`` in Envoy, Dynamo's frontend with
its KV router behind it, and Dynamo's mocker workers (its simulated engines) behind that. The
decode nodes the registry knows carry a mocker's instance id as ``dynamo_worker_id``, as their
sidecars' ``--dynamo-worker-id`` would; which workers served each request is Dynamo's own
answer (``nvext.extra_fields: ["worker_id"]``), what the hop wrote is Envoy's access log.

- Aggregated workers: every turn of a conversation holding a lease is served by the worker
  holding it; a conversation with no lease (or no session) gets no pin and is served; with the
  registry stopped, every request is still served, unpinned.
- Disaggregated workers: a turn that reads (READ) is pinned to its prefill worker too
  (``x-prefill-instance-id``), and Dynamo follows the registry's choice of prefill node as it
  moves. A prefill node registered without a worker id leaves the decode pin alone, which a
  disaggregated Dynamo 1.6.1 refuses (400): the limit the Dynamo page states.

Dynamo runs from ``.venv-dynamo`` (``make dynamo``); without it these tests skip, and fail in
CI (``$CI`` set), where ``make test`` builds it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbroker.common.rules.placement import DYNAMO_DECODE_PIN, DYNAMO_PREFILL_PIN
from kvbroker.controlplane.server import RunningRegistry
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.dynamo import (
    DynamoFleet,
    DynamoWorker,
    Role,
    chat_body,
    dynamo_python,
    served_by,
)
from kvbroker_tools.harness.envoy import Envoy
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from kvbroker_tools.harness.processes import PlacementProcess
from kvbroker_tools.stack import make_test_model
from tests.conftest import eventually

SESSION = "x-session-id"
BUSY = node_pb2.NodeLoad(running_requests=8)


@pytest.fixture(scope="module")
def python() -> Path:
    found = dynamo_python()
    if found is None:
        why = "no Dynamo venv (.venv-dynamo): run `make dynamo`"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; `make test` builds it, and CI must run these tests")
        pytest.skip(why)
    return found


@dataclass
class Chain:
    """Envoy (the hop in it) in front of Dynamo's frontend and workers."""

    envoy: Envoy
    fleet: DynamoFleet

    async def turn(self, http: httpx.AsyncClient, content: str, **headers: str) -> tuple[int, int]:
        """One request through Envoy, served; the (prefill, decode) workers that served it."""
        answer = await http.post(
            f"{self.envoy.url}/v1/chat/completions", json=chat_body(content), headers=headers
        )
        assert answer.status_code == 200, answer.text
        return served_by(answer.json())

    async def forwarded(self, count: int) -> list[dict[str, Any]]:
        """Envoy's access log once it holds ``count`` requests: what each went on with."""

        async def logged() -> list[dict[str, Any]] | None:
            log = self.envoy.forwarded()
            return log if len(log) >= count else None

        return await eventually(logged, what=f"{count} requests in Envoy's access log")


async def start_chain(
    stack: AsyncExitStack, tmp_path: Path, python: Path, registry: str, *roles: Role
) -> Chain:
    model = await asyncio.to_thread(make_test_model)
    fleet = DynamoFleet(python, tmp_path, model)
    stack.push_async_callback(fleet.stop)
    await fleet.start(*roles)
    # A deadline a loaded machine cannot miss: a missed one is an unpinned request, by design.
    hop = PlacementProcess(
        registry, "--mode", "dynamo-headers", "--hint-timeout", "1", log=tmp_path / "hop.log"
    )
    await hop.start()
    stack.push_async_callback(hop.stop)
    envoy = Envoy(
        tmp_path,
        picker=None,
        placement=hop.address,
        upstream=f"127.0.0.1:{fleet.frontend.port}",
        logged_headers=(SESSION, DYNAMO_DECODE_PIN, DYNAMO_PREFILL_PIN),
    )
    await envoy.start()
    stack.push_async_callback(envoy.stop)
    return Chain(envoy, fleet)


def node(
    node_id: str, role: node_pb2.NodeRole, port: int, worker: DynamoWorker | None = None
) -> node_pb2.NodeSpec:
    """A node as its sidecar registers it, with its Dynamo worker's id when it has one."""
    spec = node_spec(node_id, role, port=port)
    if worker is not None:
        spec.dynamo_worker_id = str(worker.instance_id)
    return spec


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as exits:
        yield exits


async def test_pinned_turns_are_served_by_the_worker_holding_the_kv_and_the_rest_fail_open(
    stack: AsyncExitStack,
    tmp_path: Path,
    python: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    agg = Role.AGGREGATED
    chain = await start_chain(stack, tmp_path, python, registry_server.address, agg, agg)
    workers = chain.fleet.workers
    holder = {"conv-0": workers[0].instance_id, "conv-1": workers[1].instance_id}
    # Aggregated Dynamo has no prefill workers: the registry's prefill node names none.
    nodes = [
        node("prefill-0", node_pb2.NODE_ROLE_PREFILL, 5700),
        node("decode-0", node_pb2.NODE_ROLE_DECODE, 5600, workers[0]),
        node("decode-1", node_pb2.NODE_ROLE_DECODE, 5610, workers[1]),
    ]
    async with Heartbeats(stub, *nodes), httpx.AsyncClient(timeout=30) as http:
        await grant(stub, nodes[1], "conv-0", "req-0", tokens=512)
        await grant(stub, nodes[2], "conv-1", "req-1", tokens=512)
        # The same prompts for both conversations: only the pins tell them apart.
        for turn in range(5):
            for conversation, worker in holder.items():
                served = await chain.turn(http, f"turn {turn}", **{SESSION: conversation})
                assert served == (worker, worker), (conversation, turn)

        # No lease, no session: nothing pinned, and Dynamo serves them as it would.
        for headers in ({SESSION: "conv-new"}, {}, {SESSION: "conv-new"}, {}):
            await chain.turn(http, "a new conversation", **headers)
        log = await chain.forwarded(14)
        assert [entry[DYNAMO_DECODE_PIN] for entry in log[:10]] == [
            str(holder[f"conv-{i % 2}"]) for i in range(10)
        ]
        assert all(entry[DYNAMO_DECODE_PIN] is None for entry in log[10:14])
        assert all(entry[DYNAMO_PREFILL_PIN] is None for entry in log)

        # The registry stopped: every request is still served, none pinned (fail open).
        await registry_server.stop(grace=0)
        for turn in range(3):
            for conversation in (*holder, "conv-new"):
                await chain.turn(http, f"turn {turn}", **{SESSION: conversation})
        log = await chain.forwarded(23)
    assert [entry["status"] for entry in log] == [200] * 23
    assert all(entry[DYNAMO_DECODE_PIN] is None for entry in log[14:])


async def test_disaggregated_the_prefill_pin_follows_the_registry(
    stack: AsyncExitStack,
    tmp_path: Path,
    python: Path,
    registry_server: RunningRegistry,
    stub: RegistryServiceStub,
) -> None:
    roles = (Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE)
    chain = await start_chain(stack, tmp_path, python, registry_server.address, *roles)
    prefills, decodes = chain.fleet.of(Role.PREFILL), chain.fleet.of(Role.DECODE)
    prefill_nodes = [
        node(f"prefill-{i}", node_pb2.NODE_ROLE_PREFILL, 5700 + 10 * i, worker)
        for i, worker in enumerate(prefills)
    ]
    decode_nodes = [
        node(f"decode-{i}", node_pb2.NODE_ROLE_DECODE, 5600 + 10 * i, worker)
        for i, worker in enumerate(decodes)
    ]
    # One heartbeat stream per prefill node, so that each reports a load of its own: a turn
    # reads on the least loaded.
    beats = [Heartbeats(stub, spec) for spec in prefill_nodes]
    for beat in [*beats, Heartbeats(stub, *decode_nodes)]:
        await stack.enter_async_context(beat)
    await grant(stub, decode_nodes[1], "conv-1", "req-1", tokens=512)
    holder = decodes[1].instance_id
    async with httpx.AsyncClient(timeout=30) as http:
        for chosen, busy in ((1, 0), (0, 1)):
            beats[busy].load, beats[chosen].load = BUSY, node_pb2.NodeLoad()
            await eventually(
                lambda: _idle_prefill_nodes(stub, {f"prefill-{chosen}"}),  # noqa: B023
                what=f"the registry seeing prefill-{chosen} the only idle prefill node",
            )
            for turn in range(4):
                served = await chain.turn(http, f"turn {turn}", **{SESSION: "conv-1"})
                assert served == (prefills[chosen].instance_id, holder), (chosen, turn)
        log = await chain.forwarded(8)
        assert [entry[DYNAMO_PREFILL_PIN] for entry in log] == [
            str(prefills[i].instance_id) for i in (1, 1, 1, 1, 0, 0, 0, 0)
        ]
        assert {entry[DYNAMO_DECODE_PIN] for entry in log} == {str(holder)}

        # No lease: no pins, served on whichever workers Dynamo picks.
        prefill, decode = await chain.turn(http, "a new conversation", **{SESSION: "conv-new"})
        assert prefill in {w.instance_id for w in prefills}
        assert decode in {w.instance_id for w in decodes}

        # A prefill node whose sidecar names no Dynamo worker, now the least loaded: the hop
        # can write the decode pin alone, and a disaggregated Dynamo 1.6.1 refuses that.
        unnamed = node("prefill-2", node_pb2.NODE_ROLE_PREFILL, 5720)
        await stack.enter_async_context(Heartbeats(stub, unnamed))
        for beat in beats:
            beat.load = BUSY
        await eventually(
            lambda: _idle_prefill_nodes(stub, {"prefill-2"}),
            what="the registry seeing prefill-2 the only idle prefill node",
        )
        refused = await http.post(
            f"{chain.envoy.url}/v1/chat/completions",
            json=chat_body("turn 4"),
            headers={SESSION: "conv-1"},
        )
        assert refused.status_code == 400, refused.text
        log = await chain.forwarded(10)
    assert (log[-1][DYNAMO_DECODE_PIN], log[-1][DYNAMO_PREFILL_PIN]) == (str(holder), None)


async def _idle_prefill_nodes(stub: RegistryServiceStub, idle: set[str]) -> bool:
    """Whether the loads the registry last heard of make ``idle`` the prefill nodes that run
    nothing (the others: BUSY): until it has, a hint may still go by the older loads."""
    listed = await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)
    prefills = [n for n in listed.nodes if n.spec.role == node_pb2.NODE_ROLE_PREFILL]
    return all((n.load.running_requests == 0) == (n.spec.node_id in idle) for n in prefills)
