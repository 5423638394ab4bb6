"""One measured chat turn through the router, as a client sees it.

TTFT is measured on the client (first streamed content); P's prefill leg comes from the
router's ``x-kvbroker-prefill-ms`` header; the KV read from D comes from the prefill server's
NIXL telemetry (only D->P reads are initiated by P, so every delta there is reuse).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvbroker.common.rules.engine_metrics import Totals, read_totals
from kvbroker_tools.bench.read_shapes import ShapeTotals, shape_totals, turn_shapes
from kvbroker_tools.chat import streamed_turn
from kvbroker_tools.stack import Stack


@dataclass
class TurnRecord:
    conversation_id: str
    # "opening" (the conversation's first turn) or "follow-up" (the measured point).
    kind: str
    # The benchmark arm (kvbroker_tools.bench.multiturn.ARMS), the new suffix's size and the
    # repetition of its point.
    arm: str
    suffix: str
    repetition: int
    target_tokens: int
    input_num_tokens: int
    output_num_tokens: int
    ttft_ms: float
    e2e_ms: float
    prefill_leg_ms: float
    kv_read_ms: float
    kv_read_bytes: float
    kv_reads: int
    decision: str
    # The path the turn took (READ, DECODE_LOCAL, RECOMPUTE).
    path: str = "?"
    # The hint's consistency (EXACT; DEGRADED: from a view that may be behind, or none).
    consistency: str = "?"
    # The NIXL READs issued during the turn, by direction (d_to_p: P reading retained KV;
    # p_to_d: D pulling the prefill leg): reads, blocks, runs (``bench.read_shapes``).
    read_shapes: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def read_shape_totals(client: httpx.AsyncClient, stack: Stack) -> dict[str, ShapeTotals]:
    """The READ shapes P and D have issued so far (each engine counts the READs it issues)."""
    totals: dict[str, ShapeTotals] = {}
    for engine in (stack.prefill, stack.decode):
        text = (await client.get(f"{stack.url(engine)}/metrics")).text
        for direction, found in shape_totals(text).items():
            totals[direction] = found.plus(totals.get(direction, ShapeTotals()))
    return totals


async def prefill_totals(client: httpx.AsyncClient, prefill_url: str) -> Totals:
    """P's running totals, its NIXL reads among them: a turn's reads are their difference."""
    totals = read_totals((await client.get(f"{prefill_url}/metrics")).text)
    if totals is None:
        raise RuntimeError(f"{prefill_url}/metrics reports totals that are not totals")
    return totals


async def measured_turn(
    client: httpx.AsyncClient,
    stack: Stack,
    messages: list[dict[str, str]],
    session: str | None,
    max_tokens: int,
    path: str | None = None,
    base_url: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Streams one chat completion through the stack's router, or the router at ``base_url``
    (asking for ``path``, if given); returns the answer and its measurements."""
    prefill_url = stack.url(stack.prefill)
    before = await prefill_totals(client, prefill_url)
    shapes_before = await read_shape_totals(client, stack)
    turn = await streamed_turn(client, stack, messages, session, max_tokens, path, base_url)
    if turn.status != 200:
        raise RuntimeError(f"router answered {turn.status}: {turn.error!r}")
    after = await prefill_totals(client, prefill_url)
    shapes_after = await read_shape_totals(client, stack)
    headers = turn.headers
    return turn.text, {
        "input_num_tokens": int(turn.usage.get("prompt_tokens", 0)),
        "output_num_tokens": int(turn.usage.get("completion_tokens", 0)),
        "ttft_ms": 1000 * turn.ttft_s,
        "e2e_ms": 1000 * turn.e2e_s,
        "prefill_leg_ms": float(headers.get("x-kvbroker-prefill-ms", "nan")),
        "kv_read_ms": 1000 * (after.read_seconds - before.read_seconds),
        "kv_read_bytes": after.read_bytes - before.read_bytes,
        "kv_reads": int(after.reads - before.reads),
        "decision": headers.get("x-kvbroker-decision", "?"),
        "path": headers.get("x-kvbroker-path", "?"),
        "consistency": headers.get("x-kvbroker-consistency", "?"),
        "read_shapes": turn_shapes(shapes_before, shapes_after),
    }
