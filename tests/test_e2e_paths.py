"""Each turn on its path, end to end on real vLLM CPU servers: DECODE_LOCAL (the turn goes
straight to the decode node that holds the conversation), READ (P reads D's KV over NIXL) and
RECOMPUTE give the same tokens at temperature 0, also when the client has stripped part of
the previous answer; the registry's planner switches from
DECODE_LOCAL to a prefill-node path as the new suffix grows; a DECODE_LOCAL turn keeps the
conversation retained for the next, and one whose lease ended or whose prefix changed still
answers correctly; `kvbroker bench multiturn`'s arms, on a tiny configuration, each take
their path.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from rich.console import Console

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.tasks import poll_until
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.bench.multiturn import (
    ARMS,
    FIXED_PATHS,
    MultiturnConfig,
    run_multiturn,
    summarise,
)
from kvbroker_tools.harness.turns import current_lease as newest_lease
from kvbroker_tools.harness.turns import retained_after
from kvbroker_tools.stack import Stack
from tests.conftest import run_cli
from tests.e2e_stack import MODEL, e2e_marks, stack_fixture, user_message
from tests.test_e2e import current_lease, metric, reads_by_prefill

pytestmark = e2e_marks()


stack = stack_fixture()


async def turn(
    stack: Stack,
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str | None,
    path: str | None = None,
    stream: bool = False,
) -> tuple[str, str]:
    """One turn through the router, and with a session id, until D's retention report of it
    has reached the registry; returns the answer and the path it took."""
    if session is None:
        return await _ask(stack, http, messages, session, path, stream)
    before = await newest_lease(stack.registry_address, session)
    answered = await _ask(stack, http, messages, session, path, stream)
    await retained_after(stack.registry_address, session, before.epoch if before else 0)
    return answered


async def _ask(
    stack: Stack,
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str | None,
    path: str | None,
    stream: bool,
) -> tuple[str, str]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "stream": stream,
    }
    if session is not None:
        body["session_id"] = session
    headers = {"x-kvbroker-path": path} if path else {}
    url = f"{stack.router_url}/v1/chat/completions"
    if not stream:
        response = await http.post(url, json=body, headers=headers)
        assert response.status_code == 200, response.text
        taken = response.headers["x-kvbroker-path"]
        return response.json()["choices"][0]["message"]["content"], taken
    parts: list[str] = []
    async with http.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200
        taken = response.headers["x-kvbroker-path"]
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                parts.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(parts), taken


async def tail_tokens_reused(stack: Stack, http: httpx.AsyncClient) -> float:
    """Tokens the decode node took from a retained tail rather than computing them (vLLM counts
    them as the connector's cache hits; D's connector loads nothing else)."""
    return await metric(http, stack.url(stack.decode), "vllm:external_prefix_cache_hits_total")


def opening(seed: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": user_message(seed, lines=20)},
        {"role": "user", "content": user_message(seed + 1, lines=20)},
    ]


async def test_every_path_gives_the_same_tokens(stack: Stack, http: httpx.AsyncClient) -> None:
    """The same follow-up asked on each path, streamed and not: identical answers; only READ
    makes P read from D; every path leaves the conversation retained for the next turn."""
    messages = opening(10)
    answer, taken = await turn(stack, http, messages, "conv-paths")
    assert taken == "RECOMPUTE"  # the first turn: nothing retained yet
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and what follows from that?"},
    ]
    answers: dict[tuple[str, bool], str] = {}
    for stream in (False, True):
        for path in ("DECODE_LOCAL", "READ", "RECOMPUTE"):
            before_reads = await reads_by_prefill(stack, http)
            before_tail = await tail_tokens_reused(stack, http)
            before = await current_lease(stack, "conv-paths")
            answers[path, stream], taken = await turn(
                stack, http, messages, "conv-paths", path, stream
            )
            assert taken == path
            read = await reads_by_prefill(stack, http) - before_reads
            assert read == (1 if path == "READ" else 0), path
            if path == "DECODE_LOCAL":
                # The unfinished last block of the previous turn came from its retained KV.
                assert await tail_tokens_reused(stack, http) > before_tail
            after = await current_lease(stack, "conv-paths")
            assert after.state == lease_pb2.LEASE_STATE_ACTIVE  # retained for the next turn
            assert after.epoch > before.epoch
    plain, _ = await turn(stack, http, messages, None)
    assert set(answers.values()) == {plain}, answers
    await assert_costs_corrected_live(stack)


async def test_every_path_gives_the_same_tokens_after_the_client_strips_the_answer(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """The client drops the first half of the previous answer (as clients drop reasoning
    traces), so what D retains matches the new prompt only up to there: each path still
    answers as plain P/D does, token for token."""
    first = opening(90)
    openings: set[str] = set()
    answers: dict[str, str] = {}
    for path in ("DECODE_LOCAL", "READ", "RECOMPUTE"):
        # A conversation per path, each the same text: each path starts from the same state.
        answer, _ = await turn(stack, http, first, f"conv-strip-{path}")
        openings.add(answer)
        stripped = [*first, {"role": "assistant", "content": answer[len(answer) // 2 :]},
                    {"role": "user", "content": "and then?"}]  # fmt: skip
        answers[path], taken = await turn(stack, http, stripped, f"conv-strip-{path}", path)
        assert taken == path
    assert len(openings) == 1, openings
    plain, _ = await turn(stack, http, stripped, None)
    assert set(answers.values()) == {plain}, answers


async def assert_costs_corrected_live(stack: Stack) -> None:
    """Real vLLM metrics parse: every node has reported prefills and some node NIXL reads,
    and the registry's correction of its costs moved on them (within a few heartbeats)."""

    async def reported() -> list[node_pb2.Node] | None:
        async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
            response = await registry_stub(channel).ListNodes(
                registry_pb2.ListNodesRequest(), timeout=5
            )
        nodes = list(response.nodes)
        done = all(n.cost_correction.prefill_samples for n in nodes) and any(
            n.cost_correction.read_samples for n in nodes
        )
        return nodes if done else None

    nodes = await poll_until(reported, 15, "live cost corrections", every_s=0.5, retrying=())
    assert nodes is not None
    for node in nodes:
        for factor in (node.cost_correction.prefill, node.cost_correction.read):
            assert 0.25 <= factor <= 4.0


async def test_the_planner_moves_off_the_decode_node_as_the_suffix_grows(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    messages = opening(30)
    answer, _ = await turn(stack, http, messages, "conv-grow")
    short = [*messages, {"role": "assistant", "content": answer},
             {"role": "user", "content": "why?"}]  # fmt: skip
    answer_short, taken = await turn(stack, http, short, "conv-grow")
    assert taken == "DECODE_LOCAL"
    # A bulk tool result (about 3,000 tokens): over the decode node's local limit.
    bulk = [*short, {"role": "assistant", "content": answer_short},
            {"role": "tool", "content": user_message(50, lines=150)}]  # fmt: skip
    answer_bulk, taken = await turn(stack, http, bulk, "conv-grow")
    assert taken in ("READ", "RECOMPUTE")
    assert answer_bulk == (await turn(stack, http, bulk, None))[0]
    assert answer_short == (await turn(stack, http, short, None))[0]


async def test_decode_local_after_the_lease_ended_or_the_prefix_changed_is_still_right(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    messages = opening(70)
    answer, _ = await turn(stack, http, messages, "conv-gone")
    follow = [*messages, {"role": "assistant", "content": answer},
              {"role": "user", "content": "go on"}]  # fmt: skip
    async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
        await registry_stub(channel).RevokeLease(
            registry_pb2.RevokeLeaseRequest(conversation_id="conv-gone", reason="closed"),
            timeout=5,
        )
    gone, taken = await turn(stack, http, follow, "conv-gone", "DECODE_LOCAL")
    assert taken == "RECOMPUTE"  # nothing usable is retained: the ask cannot be honoured
    assert gone == (await turn(stack, http, follow, None))[0]
    # An earlier turn edited: the registry cannot know, the decode node's cache matches less.
    edited = [dict(m) for m in follow]
    edited[1]["content"] = user_message(71, lines=19) + " (edited)"
    changed, taken = await turn(stack, http, edited, "conv-gone", "DECODE_LOCAL")
    assert taken == "DECODE_LOCAL"
    assert changed == (await turn(stack, http, edited, None))[0]


async def test_calibrate_measures_the_real_engines(stack: Stack, http: httpx.AsyncClient) -> None:
    """`kvbroker calibrate` on the running stack: every node's prefill costs are measured and
    stored; the prefill node has read over NIXL (a READ turn first), so its read cost is its
    own."""
    messages = opening(90)
    answer, _ = await turn(stack, http, messages, "conv-calibrate")
    follow = [*messages, {"role": "assistant", "content": answer},
              {"role": "user", "content": "more"}]  # fmt: skip
    assert (await turn(stack, http, follow, "conv-calibrate", "READ"))[1] == "READ"
    result = await run_cli(
        "calibrate", "--registry", stack.registry_address, "--repeats", "1", "--output", "json"
    )
    assert result.code == 0, result.stderr
    measured = {m["node_id"]: m for m in json.loads(result.stdout)}
    assert len(measured) == 2  # the prefill and the decode node
    for node in measured.values():
        assert node["stored"]
        # Prefill grows with the prompt: NNLS may put it all in the per-token or all in the
        # context term, depending on the probes' noise, but not in the fixed cost alone.
        costs = node["costs"]
        assert costs["prefill_us_per_token"] > 0 or costs["prefill_ns_per_token_context"] > 0
        assert [p["tokens"] for p in node["probes"]] == sorted(p["tokens"] for p in node["probes"])
    assert any(node["reads_measured"] for node in measured.values())


async def test_the_multiturn_bench_arms_take_their_paths(stack: Stack) -> None:
    """A tiny run of the benchmark, the nodes calibrated after its warm-up: every arm at every
    point, each fixed arm on its path (READ alone reading from D), reuse off without a
    session, and a summary of it all."""
    config = MultiturnConfig(
        lengths=(300,),
        repeats=2,
        max_tokens=4,
        calibrate=True,
        suffix_tokens={"one-line": 8, "bulk": 200},
    )
    records = await run_multiturn(stack, config, Console(quiet=True))
    follow_ups = [r for r in records if r.kind == "follow-up"]
    assert len(follow_ups) == len(ARMS) * 2 * 2
    assert len(records) == 2 * len(follow_ups)  # each after its opening
    for record in follow_ups:
        if record.arm in FIXED_PATHS:
            assert record.path == FIXED_PATHS[record.arm], record
        assert (record.kv_reads > 0) == (record.path == "READ"), record
        if record.arm == "off":
            assert record.path != "DECODE_LOCAL" and record.decision == "MISS", record
        assert 0 < record.ttft_ms <= record.e2e_ms
    # The same conversation for every arm at a point and repetition: the prompts differ by
    # the answers to the opening at most.
    for suffix in ("one-line", "bulk"):
        for repetition in range(config.repeats):
            prompts = [
                r.input_num_tokens
                for r in follow_ups
                if (r.suffix, r.repetition) == (suffix, repetition)
            ]
            assert max(prompts) - min(prompts) <= config.max_tokens, prompts
    rows = summarise(records)
    assert [(row["length"], row["suffix"]) for row in rows] == [(300, "one-line"), (300, "bulk")]
    assert all(set(row["arms"]) == set(ARMS) for row in rows)
