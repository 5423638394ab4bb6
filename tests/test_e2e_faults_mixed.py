"""The fault matrix's mixed fleet, end to end on real vLLM CPU servers: one decode engine
retains, the other does not (a rollout of reuse, or an A/B of it). Every turn is served with
the registry's exact word, token-identical with reuse off, with no hint cut short waiting
for a retention report (``kvbroker_tools.harness.turns``).

The rule a mixed fleet is promised (``routing.choose``): a conversation's turn goes to a
retaining decode node whenever one is as free as any other, so what it retains is reused; it
lands on the node that keeps nothing only while every retaining node is busier (by more than
the noise in the registry's count of requests), and leaves it again once one is as free.
Before that rule, retention counted as usage sent every new conversation to the node that
keeps nothing and kept it there: on a busy CI machine 12 turns of 12 were MISS (issue 43). A
failure here says where each turn ran and what the registry held."""

from __future__ import annotations

import contextlib
import itertools
import time

import httpx

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules import routing
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker_tools.harness.turns import Answer, ask, checked_turn, current_lease
from kvbroker_tools.stack import Stack
from tests.e2e_stack import e2e_marks, stack_fixture, user_message

pytestmark = e2e_marks()

RETAINING, KEEPS_NOTHING = "decode-0", "decode-1"


stack = stack_fixture(extra_decodes=(False,))


async def listed_nodes(stack: Stack) -> dict[str, node_pb2.Node]:
    async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
        listed = await registry_stub(channel).ListNodes(registry_pb2.ListNodesRequest(), timeout=5)
    return {node.spec.node_id: node for node in listed.nodes}


async def what_it_saw(stack: Stack, turns: dict[str, list[Answer]]) -> str:
    """Where each turn ran and what the registry holds now: the message of a failed check."""
    lines = []
    for session, answers in turns.items():
        lease = await current_lease(stack.registry_address, session)
        held = "no lease" if lease is None else f"lease epoch {lease.epoch} on {lease.node_id}"
        ran = ", ".join(f"{a.decision}/{a.path} on {a.decode}" for a in answers)
        lines.append(f"{session}: {ran}; {held}")
    for node in (await listed_nodes(stack)).values():
        load = node.load
        lines.append(
            f"{node.spec.node_id}: retention {node.spec.kv_retention}, running "
            f"{load.running_requests}, waiting {load.waiting_requests}, "
            f"kv {load.kv_cache_usage:.2f}, {node.live_leases} live leases of "
            f"{node.retained_blocks} blocks"
        )
    return "\n".join(lines)


def conversation(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": user_message(20 * i, lines=20)},
        {"role": "user", "content": user_message(20 * i + 1, lines=10)},
    ]


def answered(messages: list[dict[str, str]], answer: Answer, turn: int) -> None:
    messages += [
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": f"and after step {turn}?"},
    ]


async def test_every_turn_on_a_fleet_half_retaining(stack: Stack, http: httpx.AsyncClient) -> None:
    """Turns one at a time (neither node busy when a turn is placed): every conversation runs
    on the retaining node, and every turn after its first there reuses what it kept."""
    retention = {i: node.spec.kv_retention for i, node in (await listed_nodes(stack)).items()}
    assert retention[RETAINING] == node_pb2.KV_RETENTION_ON
    assert retention[KEEPS_NOTHING] == node_pb2.KV_RETENTION_OFF

    histories = {f"conv-mixed-{i}": conversation(i) for i in range(4)}
    turns: dict[str, list[Answer]] = {session: [] for session in histories}
    for turn in range(3):
        for session, messages in histories.items():
            answer = await checked_turn(stack, http, messages, session)
            assert answer.consistency == "EXACT", (session, turn, answer)
            turns[session].append(answer)
            answered(messages, answer, turn)
    saw = await what_it_saw(stack, turns)
    for answers in turns.values():
        # Its KV was kept wherever it ran on the retaining node: the next turn there reuses it.
        for previous, answer in itertools.pairwise(answers):
            if previous.decode == answer.decode == RETAINING:
                assert answer.decision == "REUSE", saw
        # It ran there: a node one or two requests busier (counting noise) is still preferred.
        assert "REUSE" in [a.decision for a in answers], saw


async def test_a_conversation_leaves_the_node_that_keeps_nothing(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """While the retaining node is busy (long answers stream there), a new conversation goes
    to the node that keeps nothing: a MISS, served all the same. Once the retaining node is as
    free again, the conversation moves there (nothing to reuse yet: MISS) and its next turn
    reuses what that node kept."""
    session, messages = "conv-mixed-moved", conversation(7)
    turns: dict[str, list[Answer]] = {session: []}
    busy_body = {
        "model": stack.config.served_model,
        "prompt": user_message(3),
        "max_tokens": stack.config.max_model_len - 512,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    retaining_url = stack.url(stack.decodes[0])
    busy_requests = routing.RETAINING_PREFERENCE + 1  # busier than counting noise
    async with contextlib.AsyncExitStack() as busy:
        for _ in range(busy_requests):
            long_answer = await busy.enter_async_context(
                http.stream("POST", f"{retaining_url}/v1/completions", json=busy_body)
            )
            assert long_answer.status_code == 200
        await heartbeats_show(stack, running_on_retaining=busy_requests)
        first = await ask(stack, http, messages, session)
        assert first.status == 200, first.text
        turns[session].append(first)
        assert (first.decision, first.decode) == ("MISS", KEEPS_NOTHING), await what_it_saw(
            stack, turns
        )
    # The long answers' streams are closed: vLLM aborts them.
    await heartbeats_show(stack, running_on_retaining=0)
    for turn, expected in enumerate(["MISS", "REUSE"]):
        answered(messages, turns[session][-1], turn)
        answer = await checked_turn(stack, http, messages, session)
        turns[session].append(answer)
        assert (answer.decision, answer.decode) == (expected, RETAINING), await what_it_saw(
            stack, turns
        )


async def heartbeats_show(stack: Stack, running_on_retaining: int) -> None:
    """Waits until the retaining node's heartbeat reports ``running_on_retaining`` requests,
    the node that keeps nothing's reports none, and both decode nodes have heartbeated since
    (which also clears the turns the registry counted as sent to them since their previous
    heartbeat): the registry places the next turn by the load as it is now. A heartbeat carries
    the sidecar's latest probe of the engine, up to an interval older than the heartbeat: one
    sent after ``since`` can still show the previous test's last turn running on the node that
    keeps nothing, which would tie the two nodes."""
    since = time.time()

    def heartbeat_after(node: node_pb2.Node) -> bool:
        return node.last_heartbeat_time.ToNanoseconds() > since * 1e9

    async def shown() -> bool:
        nodes = await listed_nodes(stack)
        retaining, keeps_nothing = nodes[RETAINING], nodes[KEEPS_NOTHING]
        return (
            heartbeat_after(retaining)
            and heartbeat_after(keeps_nothing)
            and retaining.load.running_requests == running_on_retaining
            and keeps_nothing.load.running_requests + keeps_nothing.load.waiting_requests == 0
        )

    await poll_until(
        shown,
        60,
        f"{RETAINING}'s heartbeat showing {running_on_retaining} running, {KEEPS_NOTHING}'s none",
    )
