"""Two tenants behind the real ``vllm-router``, on real vLLM CPU engines given the tenants'
keys and session keys (``kvbroker_api_keys``, ``kvbroker_session_keys``): a session is its
tenant's at the engine's door (``kvbroker.common.rules.tenants.ScopedSessions``).

``vllm-router`` forwards no client header, so clients name their sessions with signed session
ids (``sign_session``). Tenant A, holding only its own key, sends B's conversation id every
way it can (signed with A's key in B's name, B's raw id, B's scoped id): each is a plain turn
that resolves nothing of B's (no read, the same tokens as without a session) and leaves B's
lease as it was (same id, epoch and state); B's own next turn reads it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from kvbroker.common.process.credentials import token_digest
from kvbroker.common.rules.tenants import Tenant, session_key, sign_session
from kvbroker_tools.harness.turns import current_lease, retained_after
from kvbroker_tools.harness.vllm_router import running_vllm_router
from kvbroker_tools.stack import Stack, StackConfig
from tests.e2e_stack import e2e_marks
from tests.test_e2e_fleets import ACCEPTED, chat, lines_with, opening, text

pytestmark = e2e_marks()

KEYS = {"acme": "acme-secret-api-key", "globex": "globex-secret-api-key"}
A, B = Tenant("acme"), Tenant("globex")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("tenants")
    api_keys, session_keys = workdir / "api-keys", workdir / "session-keys"
    api_keys.write_text("".join(f"{t} {token_digest(k)}\n" for t, k in KEYS.items()))
    session_keys.write_text("".join(f"{t} {session_key(k)}\n" for t, k in KEYS.items()))
    config = StackConfig(
        workdir=workdir,
        connector_extra={
            "kvbroker_api_keys": str(api_keys),
            "kvbroker_session_keys": str(session_keys),
        },
    )
    async with Stack(config) as running:
        yield running


async def test_another_tenant_s_session_resolves_nothing_behind_vllm_router(
    stack: Stack, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    registry = stack.registry_address
    conversation = B.conversation("conv-b")
    own = sign_session(KEYS["globex"], B, "conv-b")
    async with running_vllm_router(
        [stack.url(stack.prefill)], [stack.url(stack.decode)], tmp_path / "vllm-router.log"
    ) as url:

        async def turn(messages: list[dict[str, str]], session: str) -> tuple[str, int]:
            """The answer through vllm-router, and the reads the prefill engine accepted."""
            before = lines_with(stack, "prefill", ACCEPTED)
            answer = text(await chat(http, url, messages, session, session_in_body=True))
            return answer, lines_with(stack, "prefill", ACCEPTED) - before

        messages = opening(11)
        first, reads = await turn(messages, own)
        assert reads == 0
        epoch = await retained_after(registry, conversation, 0)
        messages += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ]
        leased = await current_lease(registry, conversation)
        assert leased is not None

        plain = text(await chat(http, url, messages, None))
        for session in (
            sign_session(KEYS["acme"], B, "conv-b"),  # A's key, B's name
            "conv-b",
            conversation,
            sign_session(KEYS["acme"], A, conversation),  # A's own conversation, not B's
        ):
            answer, reads = await turn(messages, session)
            assert (answer, reads) == (plain, 0), session
        # A's own signed session was retained as A's: once it is, every turn above has
        # reached the registry, and B's lease is as it was.
        await retained_after(registry, A.conversation(conversation), 0)
        untouched = await current_lease(registry, conversation)
        assert untouched is not None
        assert (untouched.lease_id, untouched.epoch, untouched.state) == (
            leased.lease_id,
            leased.epoch,
            leased.state,
        )

        # B's own next turn reads its conversation's KV.
        second, reads = await turn(messages, own)
        assert (second, reads) == (plain, 1)
        await retained_after(registry, conversation, epoch)
