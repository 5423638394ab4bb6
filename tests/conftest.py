"""The layer of every test module, and fixtures that start real registry servers on loopback
and talk to them over gRPC. The harness itself (fake engine, message builders, kvbroker's
servers as processes) is kvbroker_tools.harness, which the benchmarks use too."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

import grpc
import httpx
import pytest
import pytest_asyncio

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.tasks import poll_until
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.server import RunningRegistry, ServerOptions, start_registry
from kvbroker.v1 import registry_pb2_grpc
from kvbroker_tools.harness.processes import RegistryProcess
from kvbroker_tools.stack import KVBROKER

# Short times so expiry tests finish in about a second.
FAST = RegistryConfig(
    default_lease_ttl_s=30.0,
    claim_timeout_s=1.0,
    revoke_grace_s=0.5,
    heartbeat_interval_s=0.2,
    session_ttl_s=0.8,
    turn_settle_timeout_s=0.2,
)

# Each test module's layer, as a marker (`pytest -m unit` runs one layer):
# - unit: pure code in one process, time from a clock the test moves;
# - conformance: one suite run against every implementation of an interface;
# - integration: gRPC servers, HTTP servers and processes on loopback;
# - e2e: real vLLM engines (slow);
# - soak: what the `soak` marker marks, whatever its module (slow).
# CI runs everything but e2e and soak first, in parallel, then those two on their own.
LAYERS = {
    "test_admission_blocks": "unit",
    "test_agentic_bench": "unit",
    "test_aiperf_bench": "unit",
    "test_batcher": "unit",
    "test_bench_nixl_read": "integration",
    "test_bulk_replay": "integration",
    "test_calibration": "integration",
    "test_checkpoints": "unit",
    "test_codec": "unit",
    "test_lease_rows": "unit",
    "test_id_rows": "unit",
    "test_connector_metrics": "unit",
    "test_connector_scheduler": "unit",
    "test_cost_correction": "unit",
    "test_demo": "unit",
    "test_deadlines": "unit",
    "test_docs_reference": "unit",
    "test_drain_unit": "unit",
    "test_engine_load": "unit",
    "test_engine_probe": "integration",
    "test_engine_rules": "unit",
    "test_engine_work": "unit",
    "test_fleet_bench": "integration",
    "test_fragmentation": "unit",
    "test_labels": "unit",
    "test_layers": "unit",
    "test_multiturn_bench": "unit",
    "test_planner": "unit",
    "test_ports": "integration",
    "test_prompt_size": "unit",
    "test_readiness": "unit",
    "test_registry_endpoint": "unit",
    "test_registry_failover": "integration",
    "test_registry_unit": "unit",
    "test_prefix_match": "unit",
    "test_prefix_match_scheduler": "unit",
    "test_request_validation": "unit",
    "test_retention_policy": "unit",
    "test_retention_mirror": "unit",
    "test_retention_sim": "unit",
    "test_retained_tail": "unit",
    "test_session_reuse": "unit",
    "test_sessionless": "unit",
    "test_router_degraded": "integration",
    "test_router_requests": "unit",
    "test_routing": "unit",
    "test_stats_bench": "unit",
    "test_testmodel": "unit",
    "test_vllm_compat": "unit",
    "test_vllm_handles": "unit",
    "test_vllm_stream_handle": "integration",
    "test_vllm_surface": "unit",
    "test_cli": "integration",
    "test_wheel": "integration",
    "test_deploy": "integration",
    "test_drain": "integration",
    "test_election": "integration",
    "test_engine_core_idle": "integration",
    "test_error_reasons": "integration",
    "test_forwarder": "integration",
    "test_turns": "integration",
    "test_registry_placed": "integration",
    "test_placement": "integration",
    "test_gateway": "integration",
    "test_identity": "integration",
    "test_leader_resilience": "integration",
    "test_replica_hints": "integration",
    "test_router_hints": "integration",
    "test_router_hints_identity": "integration",
    "test_long_context": "integration",
    "test_reclaim": "integration",
    "test_registry_bench": "integration",
    "test_registry_grpc": "integration",
    "test_registry_health": "integration",
    "test_registry_lists": "integration",
    "test_replicas": "integration",
    "test_retention_reports": "integration",
    "test_router": "integration",
    "test_router_agents": "integration",
    "test_sidecar": "integration",
    "test_supervisor": "integration",
    "test_store_conformance": "conformance",
    "test_e2e": "e2e",
    "test_e2e_agents": "e2e",
    "test_e2e_claude_code": "e2e",
    "test_e2e_demo": "e2e",
    "test_e2e_deploy": "e2e",
    # Dynamo's mocker workers stand in for engines: no vLLM, so it runs with the fast layers.
    "test_e2e_dynamo": "integration",
    "test_e2e_images": "e2e",
    "test_e2e_kv_events": "e2e",
    "test_e2e_faults": "e2e",
    "test_e2e_faults_mixed": "e2e",
    "test_e2e_faults_reuse_off": "e2e",
    "test_e2e_fleets": "e2e",
    "test_e2e_tenants": "e2e",
    "test_e2e_forks": "e2e",
    "test_e2e_gateway": "e2e",
    "test_e2e_metrics": "e2e",
    "test_e2e_paths": "e2e",
    "test_e2e_pressure": "e2e",
    "test_e2e_replicas": "e2e",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("soak") is not None:
            continue
        layer = LAYERS.get(item.path.stem)
        if layer is None:
            raise pytest.UsageError(
                f"{item.path.name} has no layer: add it to LAYERS in tests/conftest.py"
            )
        item.add_marker(layer)


T = TypeVar("T")


@overload
async def eventually(
    check: Callable[[], Awaitable[T]], within: float = ..., what: str = ..., every: float = ...
) -> T: ...
@overload
async def eventually(
    check: Callable[[], T], within: float = ..., what: str = ..., every: float = ...
) -> T: ...
async def eventually(
    check: Callable[[], Any], within: float = 10.0, what: str = "the condition", every: float = 0.02
) -> Any:
    """Waits for something to have happened, never for a fixed time: calls ``check`` (plain or
    async) every ``every`` seconds until it returns something truthy, and returns that. An
    error of the check (a failed assertion in it) fails the test at once; TimeoutError naming
    ``what`` when ``within`` seconds pass first."""

    async def checked() -> Any:
        result = check()
        return await result if inspect.isawaitable(result) else result

    return await poll_until(checked, within, what, every_s=every, retrying=())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """One HTTP client for a module's tests (the e2e modules send their turns with it)."""
    async with httpx.AsyncClient(timeout=300) as client:
        yield client


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[LocalEtcd]:
    """A fresh single-member etcd for one test (the replica and election tests)."""
    server = LocalEtcd(tmp_path)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def registry_config() -> RegistryConfig:
    return FAST


@pytest.fixture
async def registry_server(registry_config: RegistryConfig) -> AsyncIterator[RunningRegistry]:
    running = await start_registry(
        ServerOptions(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", config=registry_config)
    )
    yield running
    await running.stop(grace=0.1)


@pytest.fixture
async def channel(registry_server: RunningRegistry) -> AsyncIterator[grpc.aio.Channel]:
    async with open_channel(RegistryEndpoint.parse(registry_server.address)) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> registry_pb2_grpc.RegistryServiceStub:
    return registry_stub(channel)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


async def run_cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """Runs the installed ``kvbroker`` console script as a user would, without blocking the
    event loop that serves the in-process registry."""
    process = await asyncio.create_subprocess_exec(
        KVBROKER,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return CliResult(process.returncode, out.decode(), err.decode())


async def spawn_registry(*flags: str, listen: str = "") -> RegistryProcess:
    """``kvbroker registry serve`` in its own process; returns once it announced its address."""
    registry = RegistryProcess(*flags, listen=listen)
    await registry.start()
    return registry


@pytest.fixture
async def registry_process() -> AsyncIterator[RegistryProcess]:
    running = await spawn_registry()
    yield running
    await running.stop()
