"""End to end with registry replicas: the whole stack on real parts (two vLLM CPU servers with
kvbroker's connector, NIXL reads, sidecars, the router), its registry two replicas on a real
etcd. The leading replica is SIGKILLed in the middle of a conversation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from kvbroker_tools.harness.turns import retained_after
from kvbroker_tools.stack import Stack, StackConfig
from tests.e2e_stack import user_message
from tests.test_e2e import chat, reads_by_prefill

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


async def test_killing_the_leading_replica_loses_no_turn_and_reuse_comes_back(
    tmp_path: Path,
) -> None:
    stack = Stack(
        StackConfig(
            workdir=tmp_path,
            registry_replicas=2,
            registry_flags=(
                "--revoke-grace",
                "0.5",
                "--claim-timeout",
                "5",
                "--heartbeat-interval",
                "0.5",
                "--session-ttl",
                "4",
                "--max-local-prefill-tokens",  # turns read, as this test checks
                "0",
            ),
        )
    )
    try:
        await stack.start()
        assert stack.etcd is not None
        async with httpx.AsyncClient(timeout=300) as http:
            messages = [{"role": "system", "content": user_message(98, lines=10)}]
            seen: list[tuple[str, str, float]] = []
            # The epoch of the conversation's newest retention the registry has reported.
            retained = [0]

            async def turn(index: int) -> None:
                before = await reads_by_prefill(stack, http)
                messages.append({"role": "user", "content": user_message(index)})
                # chat() asserts HTTP 200: a failed turn fails the test.
                answer, headers = await chat(stack, http, messages, "conv-ha")
                messages.append({"role": "assistant", "content": answer})
                reads = await reads_by_prefill(stack, http) - before
                seen.append(
                    (headers["x-kvbroker-decision"], headers["x-kvbroker-consistency"], reads)
                )
                # D's retention report of the turn has reached the registry.
                retained[0] = await retained_after(stack.registry_address, "conv-ha", retained[0])

            for index in range(3):
                await turn(index)
            assert [s[:2] for s in seen[1:]] == [("REUSE", "EXACT")] * 2
            assert [s[2] for s in seen] == [0, 1, 1]

            killed = await stack.kill_registry_leader()
            killed_at = asyncio.get_running_loop().time()
            index = 3
            # A REUSE hint from the new leader can still meet P's fence declining the read
            # while P's sidecar is reconnecting (it cannot confirm the lease, so P recomputes:
            # safe), so the wait is for a REUSE turn that really read.
            while seen[-1] != ("REUSE", "EXACT", 1) or index == 3:
                assert asyncio.get_running_loop().time() - killed_at < 60, seen
                await turn(index)
                index += 1
            print("turns (decision, consistency, NIXL reads) around the kill:", seen)
            # Reuse is back, with a real NIXL read of the history, served by the other replica.
            assert seen[-1][2] == 1
            leader = await stack.etcd.leader()
            assert leader and leader != killed
    finally:
        await stack.stop()
