"""Placement hints anyone can send: ``GET /v1/placement`` answers where a conversation's next
turn should go, as the affinity headers the routers fleets run already honour
(``kvbroker.common.rules.placement``), for a router or a gateway filter to ask before it picks
nodes.

The engines resolve their own handles (``engine_ext/session_reuse.py``), so reuse is correct
whatever a fleet's router picks; these hints make it fast, by steering the turn to the node
holding the conversation's KV. The answer is the registry's dry run (no lease claimed, no
turn counted): the engine the turn reaches claims for itself.
"""

from __future__ import annotations

from typing import Any

from kvbroker.common.rules.labels import label
from kvbroker.common.rules.placement import pins
from kvbroker.v1 import registry_pb2


def answer(session: str, hint: registry_pb2.RoutingHint) -> dict[str, Any]:
    """The placement as JSON: the registry's decision and path, the nodes, and the headers."""
    return {
        "session_id": session,
        "decision": label(registry_pb2.HintDecision, hint.decision),
        "path": label(registry_pb2.TurnPath, hint.path) if hint.path else None,
        "no_reuse": label(registry_pb2.NoReuseReason, hint.no_reuse) if hint.no_reuse else None,
        "reason": hint.reason,
        "decode": hint.decode.node_id or None,
        "prefill": hint.prefill.node_id or None,
        "retained_tokens": hint.lease.token_count,
        "headers": pins(hint),
    }
