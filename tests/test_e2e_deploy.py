"""The CPU overlay (deploy/kubernetes/overlays/cpu) as it renders, run on this machine: every
container of every pod started from its own command line and environment (the etcd
StatefulSet, three registry replicas on it, the test-model init container, a sidecar and a
vLLM CPU server per engine pod, the router), with only what a cluster provides mapped to
loopback (kvbroker_tools.harness.manifests), the Secrets from make-secrets.sh, and each container
ready when its own probe passes. A two-turn conversation through the router reuses the first
turn's KV on the second, read by P from D over NIXL.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest_asyncio

from kvbroker_tools.harness.manifests import DEPLOY, LocalCluster, make_secrets, render, workloads
from kvbroker_tools.stack import router_routing
from kvbroker_tools.testmodel import corpus
from tests.e2e_stack import e2e_marks

pytestmark = e2e_marks(timeout_s=1200)

MODEL = "kvbroker-tiny-qwen3"
LINES = corpus(lines=400, seed=11)
# In the order a rollout would have them ready; each waits for its probes.
ORDER = ["kvbroker-etcd", "kvbroker-registry", "kvbroker-prefill", "kvbroker-decode",
         "kvbroker-router"]  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    manifests = render(DEPLOY / "overlays" / "cpu")
    replicas = {w.name: w.replicas for w in workloads(manifests)}
    assert set(replicas) == set(ORDER)
    secrets = make_secrets(replicas["kvbroker-prefill"], replicas["kvbroker-decode"])
    # Short: unix socket paths must fit in 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="k8s-", dir="/tmp"))
    # The model at the same path for both engines, as /models/model is in every pod: vLLM's
    # NIXL handshake refuses engines whose model paths differ.
    local = LocalCluster(manifests, secrets, workdir, shared_volumes=frozenset({"models"}))
    try:
        await local.start(ORDER)
        await router_routing(local.url("kvbroker-router", 8080), MODEL, within_s=120).wait(
            local.children[-1]
        )
        yield local
    finally:
        await local.stop()


async def nixl_reads(client: httpx.AsyncClient, cluster: LocalCluster) -> float:
    """D→P reads P has made (P's own NIXL telemetry)."""
    port = cluster.pod_port("kvbroker-prefill-0", 8000)
    text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:nixl_xfer_time_seconds_count")
    )


async def test_the_rendered_cpu_overlay_serves_a_conversation_with_reuse(
    cluster: LocalCluster,
) -> None:
    router = cluster.url("kvbroker-router", 8080)
    messages = [{"role": "system", "content": " ".join(LINES[:10])}]
    decisions, reads = [], []
    async with httpx.AsyncClient(timeout=300) as client:
        reads.append(await nixl_reads(client, cluster))
        for turn in range(2):
            messages.append({"role": "user", "content": " ".join(LINES[10 + 14 * turn :][:14])})
            # A short follow-up would go DECODE_LOCAL; the read is what this checks.
            response = await client.post(
                f"{router}/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 12,
                      "temperature": 0, "session_id": "conv-k8s"},
                headers={"x-kvbroker-path": "READ"},
            )  # fmt: skip
            assert response.status_code == 200, response.text
            decisions.append(response.headers["x-kvbroker-decision"])
            answer = response.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            reads.append(await nixl_reads(client, cluster))
            await asyncio.sleep(0.3)  # D's retention report reaches the registry
    assert decisions == ["MISS", "REUSE"]
    assert reads[2] - reads[1] == 1  # the second turn read its history from D
    # Every sidecar kept its session with its node token (none was refused or lost).
    for log in cluster.workdir.glob("*-sidecar.log"):
        assert "registry_session_lost" not in log.read_text(), log.name
