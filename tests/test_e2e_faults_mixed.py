"""The fault matrix's mixed fleet, end to end on real vLLM CPU servers: one decode engine
retains, the other does not (a rollout of reuse, or an A/B of it). Conversations land on
either; every turn is served with the registry's exact word, token-identical with reuse off
and as fast (``kvbroker.testing.turns``), and those on the retaining engine reuse their KV."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.stack import Stack, StackConfig
from kvbroker.testing.turns import checked_turn
from kvbroker.v1 import node_pb2, registry_pb2
from tests.test_e2e import user_message

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    config = StackConfig(workdir=tmp_path_factory.mktemp("stack"), extra_decodes=(False,))
    async with Stack(config) as running:
        yield running


async def test_every_turn_on_a_fleet_half_retaining(stack: Stack, http: httpx.AsyncClient) -> None:
    async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
        listed = await registry_stub(channel).ListNodes(registry_pb2.ListNodesRequest(), timeout=5)
    retention = {node.spec.node_id: node.spec.kv_retention for node in listed.nodes}
    assert retention["decode-0"] == node_pb2.KV_RETENTION_ON
    assert retention["decode-1"] == node_pb2.KV_RETENTION_OFF

    histories = {
        f"conv-mixed-{i}": [
            {"role": "system", "content": user_message(20 * i, lines=20)},
            {"role": "user", "content": user_message(20 * i + 1, lines=10)},
        ]
        for i in range(4)
    }
    decisions: list[str] = []
    for turn in range(3):
        for session, messages in histories.items():
            answer = await checked_turn(stack, http, messages, session)
            assert answer.consistency == "EXACT", (session, turn, answer)
            decisions.append(answer.decision)
            messages += [
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": f"and after step {turn}?"},
            ]
    # Turns on the retaining engine reuse what it kept; the others are computed anew.
    assert "REUSE" in decisions and "MISS" in decisions[len(histories) :]
