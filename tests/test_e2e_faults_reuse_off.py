"""The fault matrix's first row, end to end on real vLLM CPU servers: `kvbroker up --reuse off`
(the decode engine does not retain) with clients that send session ids. Every turn is served
plain P/D with the registry's exact word (MISS, EXACT, RECOMPUTE), token-identical with the
same turn sent without a session id, and no hint waits for a retention report that a
decode node that does not retain never sends (before, the second turn's hint waited past the
router's deadline and the client got a 503)."""

from __future__ import annotations

import httpx
import pytest

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker_tools.harness.turns import checked_turn
from kvbroker_tools.stack import Stack
from tests.e2e_stack import e2e_marks, stack_fixture, user_message

pytestmark = e2e_marks()


stack = stack_fixture(reuse=False)


async def test_the_decode_node_registers_as_not_retaining(stack: Stack) -> None:
    async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
        listed = await registry_stub(channel).ListNodes(registry_pb2.ListNodesRequest(), timeout=5)
    retention = {node.spec.role: node.spec.kv_retention for node in listed.nodes}
    assert retention[node_pb2.NODE_ROLE_DECODE] == node_pb2.KV_RETENTION_OFF


@pytest.mark.parametrize("conversations", [1, 2])
async def test_every_turn_with_a_session_id_is_served_exactly(
    stack: Stack, http: httpx.AsyncClient, conversations: int
) -> None:
    """Three turns of each conversation, back to back, as a client sends them."""
    histories = {
        f"conv-off-{conversations}-{i}": [
            {"role": "system", "content": user_message(10 * i, lines=20)},
            {"role": "user", "content": user_message(10 * i + 1, lines=10)},
        ]
        for i in range(conversations)
    }
    for turn in range(3):
        for session, messages in histories.items():
            answer = await checked_turn(stack, http, messages, session)
            assert (answer.decision, answer.consistency, answer.path) == (
                "MISS",
                "EXACT",
                "RECOMPUTE",
            ), (session, turn)
            messages += [
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": f"and after step {turn}?"},
            ]
