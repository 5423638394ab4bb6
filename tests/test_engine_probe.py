"""The sidecar's probe of its engine (``sidecar/engine_probe.py``) against a fake vLLM HTTP
server on loopback: a heartbeat's load is read as the heartbeat goes (``fresh_load``), a slow
engine holds it back a bounded while and then the last known load goes instead, and probes
never overlap."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvbroker.sidecar.config import SidecarConfig
from kvbroker.sidecar.engine_probe import EngineProbe
from kvbroker.sidecar.metrics import SidecarMetrics
from kvbroker.v1 import node_pb2
from kvbroker_tools.harness.engine import FakeEngine


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine("decode-0") as engine:
        yield engine


@pytest.fixture
async def probe(engine: FakeEngine) -> AsyncIterator[EngineProbe]:
    config = SidecarConfig("decode-0", node_pb2.NODE_ROLE_DECODE, engine.url, health_timeout_s=5)
    probe = EngineProbe(config, SidecarMetrics())
    yield probe
    await probe.close()


async def test_a_fresh_load_is_the_engine_s_as_it_is_now(
    engine: FakeEngine, probe: EngineProbe
) -> None:
    await probe.probe()
    assert probe.load.running_requests == 0
    engine.running = 7  # a turn began after the last probe
    assert (await probe.fresh_load(5.0)).running_requests == 7
    assert probe.ready


async def test_a_slow_engine_gets_the_last_known_load_and_one_probe_at_a_time(
    engine: FakeEngine, probe: EngineProbe
) -> None:
    engine.running = 2
    await probe.probe()
    engine.running, engine.health_delay_s = 5, 1.0
    probes = engine.health_probes
    # The probe begun for it is not back in time: the heartbeat goes with the last known load.
    assert (await probe.fresh_load(0.05)).running_requests == 2
    # The probe goes on; a second caller waits for it rather than asking the engine again.
    assert (await probe.fresh_load(0.05)).running_requests == 2
    await probe.probe()
    assert probe.load.running_requests == 5
    assert engine.health_probes == probes + 1
    assert probe.ready
