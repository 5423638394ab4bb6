"""One chat turn through a stack's router, streamed and timed, and the checks every turn of the
fault matrix meets against the same turn with reuse off (``tests/test_e2e_faults*.py``).

Reuse off is the same request without a session id: plain P/D, every token computed, which
is what a client gets without kvbroker. A turn with reuse on must give the same tokens (at
temperature 0) and a 2xx, and its hint must not have waited out a deadline for a retention
report that never came (the registry counts each such wait by its outcome): the hidden wait
a fault most often costs, checked by the event that marks it rather than by the clock, which
a busy machine moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.tasks import poll_until
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker_tools.chat import streamed_turn
from kvbroker_tools.stack import Stack

# The outcomes of ``kvbroker_hint_settle_waits`` that mean a hint waited for a retention
# report and gave up (``settled`` is a wait that ended with the report: the feature).
CUT_SHORT_WAITS = ("timeout", "no_time")


@dataclass(frozen=True)
class Answer:
    text: str
    status: int
    ttft_s: float
    decision: str
    consistency: str
    path: str
    # The nodes the router says the turn ran on ("" for prefill: no prefill leg).
    decode: str = ""
    prefill: str = ""


async def ask(
    stack: Stack,
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str | None,
    max_tokens: int = 12,
    path: str | None = None,
) -> Answer:
    """One streamed turn (``kvbroker_tools.chat.streamed_turn``), as the fault matrix reads
    it."""
    turn = await streamed_turn(http, stack, messages, session, max_tokens, path)
    if turn.status != 200:
        return Answer(turn.error, turn.status, 0.0, "", "", "")
    return Answer(
        turn.text,
        turn.status,
        turn.ttft_s,
        turn.headers.get("x-kvbroker-decision", ""),
        turn.headers.get("x-kvbroker-consistency", ""),
        turn.headers.get("x-kvbroker-path", ""),
        turn.headers.get("x-kvbroker-decode", ""),
        turn.headers.get("x-kvbroker-prefill", ""),
    )


async def checked_turn(
    stack: Stack,
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    session: str,
    max_tokens: int = 12,
) -> Answer:
    """The turn with reuse on, checked against the same turn with reuse off asked just
    before it, and no hint of it cut short waiting for a retention report."""
    off = await ask(stack, http, messages, None, max_tokens)
    assert off.status == 200, off.text
    waits_before = await cut_short_waits(stack, http)
    on = await ask(stack, http, messages, session, max_tokens)
    assert on.status == 200, on.text
    assert on.text == off.text, (on, off)
    waits_after = await cut_short_waits(stack, http)
    assert waits_after == waits_before, (
        f"the turn's hint waited for a retention report that never came ({on}): "
        f"{waits_before} -> {waits_after}"
    )
    return on


async def cut_short_waits(stack: Stack, http: httpx.AsyncClient) -> dict[str, float]:
    """How many hints every registry replica has let wait for a retention report and then
    answered without it, by outcome."""
    counts = dict.fromkeys(CUT_SHORT_WAITS, 0.0)
    urls = stack.registry_metrics_urls()
    assert urls, "no registry of the stack announced a metrics page: nothing to check"
    for url in urls:
        text = (await http.get(url)).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                outcome = sample.labels.get("outcome", "")
                if sample.name == "kvbroker_hint_settle_waits_total" and outcome in counts:
                    counts[outcome] += sample.value
    return counts


async def current_lease(registry: str, session: str) -> lease_pb2.Lease | None:
    """The conversation's newest lease as the registry has it, ended or not (None: it knows
    none)."""
    every_state = [
        lease_pb2.LeaseState.Name(state) for state in lease_pb2.LeaseState.values() if state
    ]
    async with open_channel(RegistryEndpoint.parse(registry)) as channel:
        stub = registry_stub(channel)
        found = await stub.ListLeases(
            registry_pb2.ListLeasesRequest(conversation_id=session, states=every_state),
            timeout=5,
        )
    leases: list[lease_pb2.Lease] = list(found.leases)
    return max(leases, key=lambda lease: lease.epoch) if leases else None


async def retained_after(registry: str, session: str, epoch: int, within_s: float = 30) -> int:
    """Waits until the decode node has reported to ``registry`` the retention of the
    conversation's turn that followed ``epoch`` (a lease of a higher epoch is live); returns
    that epoch."""

    async def newer() -> int:
        lease = await current_lease(registry, session)
        live = lease is not None and lease.state in (
            lease_pb2.LEASE_STATE_ACTIVE,
            lease_pb2.LEASE_STATE_CLAIMED,
        )
        return lease.epoch if lease is not None and live and lease.epoch > epoch else 0

    return await poll_until(newer, within_s, f"{session}'s retention after epoch {epoch}")
