"""Placement hints as the affinity headers the routers fleets run already honour: the rule
that turns a registry hint into them, shared by kvbroker's router (``GET /v1/placement``) and
any gateway hop that sets them on a request.

- llm-d: ``x-session-token`` / ``x-session-token-prefill`` (base64 of the pod's
  ``namespace/name``, read by its session-affinity filter and scorer), and
  ``x-gateway-destination-endpoint-subset`` (the endpoints its picker may choose from: the
  decode node alone for DECODE_LOCAL, with the prefill node for READ);
- Dynamo: ``x-worker-instance-id`` / ``x-prefill-instance-id`` (its pin headers; both for
  DECODE_LOCAL too when the prefill node is a Dynamo worker, as its frontend needs);
- any router: ``x-kvbroker-decode`` / ``x-kvbroker-prefill`` (node ids).

A turn that reuses nothing gets no pins: the fleet's router places it as it would.
"""

from __future__ import annotations

import base64
from urllib.parse import urlsplit

from kvbroker.v1 import node_pb2, registry_pb2

READ = registry_pb2.TURN_PATH_READ
DECODE_LOCAL = registry_pb2.TURN_PATH_DECODE_LOCAL
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
# Dynamo's pins: the decode worker, the prefill worker.
DYNAMO_DECODE_PIN = "x-worker-instance-id"
DYNAMO_PREFILL_PIN = "x-prefill-instance-id"
DYNAMO_PINS = (DYNAMO_DECODE_PIN, DYNAMO_PREFILL_PIN)


def endpoint(spec: node_pb2.NodeSpec) -> str:
    """The node's ip:port as a gateway sees it: as registered, else its URL's."""
    if spec.gateway_endpoint:
        return spec.gateway_endpoint
    url = urlsplit(spec.http_base_url)
    return f"{url.hostname}:{url.port}" if url.hostname and url.port else ""


def pinned_endpoints(hint: registry_pb2.RoutingHint) -> list[str]:
    """The endpoints a turn that reuses retained KV should go to: the decode node holding it,
    and for READ the prefill node too; none for a turn that reuses nothing."""
    if hint.decision != registry_pb2.HINT_DECISION_REUSE or hint.path not in (READ, DECODE_LOCAL):
        return []
    nodes = [hint.decode, hint.prefill] if hint.path == READ else [hint.decode]
    return [e for e in (endpoint(node) for node in nodes) if e]


def pins(hint: registry_pb2.RoutingHint) -> dict[str, str]:
    """The affinity headers that send the turn to the nodes the hint names, for a turn that
    reuses retained KV (READ or DECODE_LOCAL); none otherwise."""
    endpoints = pinned_endpoints(hint)
    if not endpoints:
        return {}
    decode = hint.decode
    headers = {"x-kvbroker-decode": decode.node_id}
    if decode.kubernetes_pod:
        headers["x-session-token"] = _encoded(decode.kubernetes_pod)
    prefill = hint.prefill
    if decode.dynamo_worker_id:
        headers[DYNAMO_DECODE_PIN] = decode.dynamo_worker_id
    # A disaggregated Dynamo frontend refuses a decode pin without a prefill pin (400) and
    # cannot skip the prefill leg of a pinned turn, so where the prefill node is a Dynamo
    # worker a DECODE_LOCAL turn is pinned as a READ through it.
    if prefill.dynamo_worker_id and (hint.path == READ or decode.dynamo_worker_id):
        headers[DYNAMO_PREFILL_PIN] = prefill.dynamo_worker_id
    if hint.path == READ:
        headers["x-kvbroker-prefill"] = prefill.node_id
        if prefill.kubernetes_pod:
            headers["x-session-token-prefill"] = _encoded(prefill.kubernetes_pod)
    headers[SUBSET_HEADER] = ",".join(endpoints)
    return headers


def _encoded(pod: str) -> str:
    return base64.b64encode(pod.encode()).decode()
