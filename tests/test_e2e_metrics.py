"""The connector's series on each engine's own ``/metrics``, end to end on real vLLM CPU
servers (the stack of test_e2e, turns on the READ path): what a fleet's router scrapes with no
kvbroker code. D shows its retention and the reads it served; P the handles it did not read.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvbroker.common.rules.handles import prefill_params
from kvbroker_tools.harness.turns import retained_after
from kvbroker_tools.stack import Stack
from tests.conftest import eventually
from tests.e2e_stack import MODEL, e2e_marks, stack_fixture, user_message
from tests.test_e2e import chat, current_lease, reads_by_prefill

pytestmark = e2e_marks()


stack = stack_fixture(
    # Every follow-up turn reads from D, so D serves reads.
    registry_flags=("--max-local-prefill-tokens", "0"),
)


async def series(http: httpx.AsyncClient, base_url: str) -> dict[tuple[str, str], float]:
    """kvbroker's samples on one engine, by name and ``reason`` label ("" without one)."""
    text = (await http.get(f"{base_url}/metrics")).text
    return {
        (sample.name, sample.labels.get("reason", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvbroker_")
    }


async def test_engines_export_retention_reads_served_and_reads_declined(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    decode, prefill = stack.url(stack.decode), stack.url(stack.prefill)
    fresh = await series(http, decode)
    assert fresh[("kvbroker_retained_blocks", "")] == 0
    assert fresh[("kvbroker_retention_budget_free_ratio", "")] == 1.0
    assert fresh[("kvbroker_leases_live", "")] == 0
    assert fresh[("kvbroker_reads_served_total", "")] == 0
    declined_at_start = await series(http, prefill)
    assert declined_at_start[("kvbroker_reads_declined_total", "decline")] == 0
    assert declined_at_start[("kvbroker_reads_declined_total", "recompute")] == 0

    # Turn 1: D retains the conversation.
    session = "conv-metrics"
    messages = [{"role": "user", "content": user_message(140, lines=30)}]
    answer, _ = await chat(stack, http, messages, session)
    await retained_after(stack.registry_address, session, 0)
    turn1 = await current_lease(stack, session)

    async def retaining() -> dict[tuple[str, str], float] | None:
        now = await series(http, decode)
        return now if now[("kvbroker_retained_blocks", "")] > 0 else None

    held = await eventually(retaining, within=30, what="D's retained blocks on /metrics")
    assert held is not None
    assert held[("kvbroker_leases_live", "")] >= 1
    assert 0 < held[("kvbroker_retention_budget_free_ratio", "")] < 1

    # Turn 2: P reads turn 1's KV from D; D frees it after the read.
    reads = await reads_by_prefill(stack, http)
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": user_message(141)}]  # fmt: skip
    await chat(stack, http, messages, session)
    assert await reads_by_prefill(stack, http) == reads + 1

    async def served() -> float:
        return (await series(http, decode))[("kvbroker_reads_served_total", "")]

    assert await eventually(served, within=30, what="a read served on D's /metrics") >= 1

    # A handle of turn 1's lease, superseded by turn 2's, sent straight to P: declined.
    await retained_after(stack.registry_address, session, turn1.epoch)
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": prefill_params(turn1)}  # fmt: skip
    response = await http.post(f"{prefill}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text

    async def declined() -> float:
        return (await series(http, prefill))[("kvbroker_reads_declined_total", "decline")]

    assert await eventually(declined, within=30, what="a declined handle on P's /metrics") == 1
