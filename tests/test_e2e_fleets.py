"""Reuse behind the routers fleets already run, end to end on real vLLM CPU servers, with
kvbroker's router out of the path: vLLM's example P/D proxy, llm-d's decode-side sidecar and
coordinator (``kvbroker_tools.harness.pd_proxies``), and the real ``vllm-router`` from the package
index. The engines resolve their own handles (``engine_ext/session_reuse.py``).

Each conversation's turns are token-identical with reuse off (the same turn without a session
id, at temperature 0); from turn 2 the prefill engine reads the conversation's KV from the
decode engine (its log says so, once per read) or the decode engine serves the turn from its
own cache (decode-first); a lease that was revoked, or a fenced handle sent by hand, is never
read; a conditional decode-first request D cannot serve is refused with 412 at once, having
computed nothing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.engine_metrics import Totals
from kvbroker.common.rules.handles import prefill_params
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker_tools.bench.turns import prefill_totals
from kvbroker_tools.harness.pd_proxies import ProxyKind, running_proxy
from kvbroker_tools.harness.turns import current_lease, retained_after
from kvbroker_tools.harness.vllm_router import running_vllm_router
from kvbroker_tools.stack import Stack, StackConfig
from tests.conftest import eventually
from tests.test_e2e import user_message

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.asyncio(loop_scope="module"),
]

MODEL = StackConfig.served_model
ACCEPTED = "kvbroker remote KV accepted for"
NOT_READ = "kvbroker remote KV not read for"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with Stack(StackConfig(workdir=tmp_path_factory.mktemp("stack"))) as running:
        yield running


def engine_log(stack: Stack, engine: str) -> Path:
    return stack.config.workdir / f"vllm-{engine}.log"


def lines_with(stack: Stack, engine: str, marker: str) -> int:
    return engine_log(stack, engine).read_text(errors="replace").count(marker)


async def chat(
    http: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, str]],
    session: str | None,
    session_in_body: bool = False,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
    }
    sent = dict(headers or {})
    if session:
        sent["X-Session-ID"] = session
        if session_in_body:
            body["session_id"] = session
    return await http.post(url + "/v1/chat/completions", json=body, headers=sent)


def text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["message"]["content"])


def opening(seed: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": user_message(seed, lines=20)},
        {"role": "user", "content": user_message(seed + 1, lines=10)},
    ]


async def conversation(
    stack: Stack,
    http: httpx.AsyncClient,
    url: str,
    session: str,
    turns: int = 3,
    session_in_body: bool = False,
) -> list[int]:
    """The conversation's turns through ``url``, each checked token-identical with the same
    turn without a session id; returns the reads the prefill engine accepted in each turn."""
    messages = opening(len(session))
    reads: list[int] = []
    epoch = 0
    for turn in range(turns):
        before = lines_with(stack, "prefill", ACCEPTED)
        reused = text(await chat(http, url, messages, session, session_in_body))
        reads.append(lines_with(stack, "prefill", ACCEPTED) - before)
        assert reused == text(await chat(http, url, messages, None)), (session, turn)
        # The next turn starts once the decode engine's retention has reached the registry,
        # as a client's next message would after reading the answer.
        epoch = await retained_after(stack.registry_address, session, epoch)
        messages += [
            {"role": "assistant", "content": reused},
            {"role": "user", "content": f"and after step {turn}?"},
        ]
    return reads


@pytest.mark.parametrize("kind", ["toy", "llmd"])
async def test_behind_a_pd_proxy_follow_ups_read(
    stack: Stack, http: httpx.AsyncClient, kind: ProxyKind
) -> None:
    async with running_proxy(kind, [stack.url(stack.prefill)], [stack.url(stack.decode)]) as (
        url,
        proxy,
    ):
        reads = await conversation(stack, http, url, f"conv-{kind}")
        assert proxy.stats.prefill_legs == proxy.stats.decode_legs > 0
    assert reads[0] == 0
    assert reads[1:] == [1, 1], reads


async def test_behind_vllm_router_follow_ups_read(
    stack: Stack, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """vllm-router forwards no client header to the engines and the body's session id to the
    prefill leg only: the session goes in the body, and the prefill engine carries it on."""
    async with running_vllm_router(
        [stack.url(stack.prefill)], [stack.url(stack.decode)], tmp_path / "vllm-router.log"
    ) as url:
        reads = await conversation(stack, http, url, "conv-vllm-router", session_in_body=True)
    assert reads == [0, 1, 1], reads


async def test_a_revoked_or_fenced_lease_is_never_read(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    session = "conv-fenced"
    prefill_url = stack.url(stack.prefill)
    async with running_proxy("toy", [prefill_url], [stack.url(stack.decode)]) as (url, _):
        messages = opening(7)
        first = text(await chat(http, url, messages, session))
        epoch = await retained_after(stack.registry_address, session, 0)
        stale = await current_lease(stack.registry_address, session)
        assert stale is not None and stale.epoch == epoch
        async with open_channel(RegistryEndpoint.parse(stack.registry_address)) as channel:
            await registry_stub(channel).RevokeLease(
                registry_pb2.RevokeLeaseRequest(lease_id=stale.lease_id, reason="test"),
                timeout=5,
            )
        messages += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ]
        reads = lines_with(stack, "prefill", ACCEPTED)
        second = text(await chat(http, url, messages, session))
        assert lines_with(stack, "prefill", ACCEPTED) == reads  # revoked: recomputed
        assert second == text(await chat(http, url, messages, None))
        await retained_after(stack.registry_address, session, epoch)

    # The revoked lease's handle, sent to the prefill engine by hand: fenced, never read.
    refused = lines_with(stack, "prefill", NOT_READ)
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "session_id": session,
        "kv_transfer_params": prefill_params(stale),
    }
    answer = await http.post(prefill_url + "/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    await eventually(lambda: lines_with(stack, "prefill", NOT_READ) == refused + 1)
    assert lines_with(stack, "prefill", ACCEPTED) == reads


async def prompt_tokens_computed(http: httpx.AsyncClient, engine_url: str) -> float:
    """vLLM's own count of prompt tokens an engine has processed."""
    metrics = (await http.get(engine_url + "/metrics")).text
    found = re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)
    return sum(float(value) for value in found)


async def test_decode_first_serves_from_the_lease_or_refuses_at_once(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    decode_url = stack.url(stack.decode)
    # No lease for this conversation: 412 at once, with the hint, and nothing computed.
    computed = await prompt_tokens_computed(http, decode_url)
    refused = await chat(
        http, decode_url, opening(11), "conv-unknown", headers={"Prefer": "if-available"}
    )
    assert refused.status_code == 412, refused.text
    assert refused.json()["error"]["type"] == "precondition_failed"
    assert refused.headers["x-kvbroker-decision"] == "HINT_DECISION_MISS"
    assert refused.headers["x-kvbroker-prefill"] == "prefill-0"
    assert await prompt_tokens_computed(http, decode_url) == computed

    async with running_proxy("coordinator", [stack.url(stack.prefill)], [decode_url]) as (
        url,
        proxy,
    ):
        session = "conv-coordinator"
        messages = opening(13)
        first = text(await chat(http, url, messages, session))
        assert proxy.stats.refused_decode_first == 1 and proxy.stats.prefill_legs == 1
        epoch = await retained_after(stack.registry_address, session, 0)
        messages += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ]
        second = text(await chat(http, url, messages, session))
        # Served by D from its own cache: no prefill leg, nothing read.
        assert proxy.stats.served_decode_first == 1
        assert proxy.stats.prefill_legs == 1
        assert second == text(await chat(http, url, messages, None))
        lease = await current_lease(stack.registry_address, session)
        assert lease is not None and lease.epoch > epoch  # retained again for the next turn
        assert lease.state in (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED)


async def test_behind_vllm_router_a_fork_reads_its_parent_by_content(
    stack: Stack, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """A sub-agent behind vllm-router: its body names a new session id and its prompt is the
    parent's whole history plus a task of its own. The prefill engine knows no lease of it,
    asks the registry by the prompt's content, reads the parent's KV from the decode engine
    and computes only what follows; the answer is the one reuse off gives, and the parent's
    lease stays the parent's."""
    async with running_vllm_router(
        [stack.url(stack.prefill)], [stack.url(stack.decode)], tmp_path / "vllm-router.log"
    ) as url:
        parent = "conv-vllm-router-parent"
        messages = opening(21)
        first = text(await chat(http, url, messages, parent, session_in_body=True))
        epoch = await retained_after(stack.registry_address, parent, 0)
        messages += [{"role": "assistant", "content": first}]
        held = await current_lease(stack.registry_address, parent)
        assert held is not None and held.epoch == epoch

        fork_messages = [*messages, {"role": "user", "content": "Sub-task: list the names."}]
        reads = lines_with(stack, "prefill", ACCEPTED)
        before = await prefill_totals(http, stack.url(stack.prefill))
        fork = await chat(http, url, fork_messages, "conv-vllm-router-fork", True)
        prompt_tokens = int(fork.json()["usage"]["prompt_tokens"])

        async def counted() -> Totals | None:
            now = await prefill_totals(http, stack.url(stack.prefill))
            return now if now.prefills > before.prefills else None

        after = await poll_until(counted, 30, "P's metrics counting the fork's prefill")
        assert after is not None
        assert lines_with(stack, "prefill", ACCEPTED) == reads + 1
        computed = after.computed_tokens - before.computed_tokens
        # At most the prompt past the parent's retained tokens, plus the blocks a verified
        # prefix stops short of them (the parent's unfinished last block, the re-rendered
        # template tokens): far less than the whole prompt.
        block = stack.config.block_size
        assert block is not None
        assert computed <= prompt_tokens - held.token_count + 2 * block
        assert computed < prompt_tokens / 2, (computed, prompt_tokens)
        assert text(fork) == text(await chat(http, url, fork_messages, None))
    still = await current_lease(stack.registry_address, parent)
    assert still is not None and still.lease_id == held.lease_id and still.epoch == epoch
