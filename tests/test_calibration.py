"""Measuring a node's costs (``kvbroker.calibration``, ``kvbroker calibrate``): the fit alone,
and the command against a real registry process and an engine with a known prefill speed."""

from __future__ import annotations

import json

import pytest

from kvbroker.calibration import Probe, fit_prefill, read_cost_us_per_block
from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.v1 import registry_pb2
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.factories import Heartbeats, node_spec
from kvbroker_tools.harness.processes import RegistryProcess
from tests.conftest import run_cli


def test_the_fit_recovers_known_costs() -> None:
    fixed, per_token, per_context = 0.020, 300e-6, 40e-9  # s, s/token, s/token²

    def seconds(n: int) -> float:
        return fixed + n * per_token + n * n / 2 * per_context

    probes = [Probe(n, seconds(n)) for n in (64, 512, 2048, 4096)]
    a, b, c = fit_prefill(probes)
    assert a == pytest.approx(20.0, rel=1e-6)  # ms
    assert b == pytest.approx(300.0, rel=1e-6)  # µs per token
    assert c == pytest.approx(40.0, rel=1e-6)  # ns per token and context token
    with pytest.raises(ValueError, match="three different lengths"):
        fit_prefill([Probe(64, 0.1), Probe(64, 0.1), Probe(64, 0.1)])


def test_noise_never_makes_a_cost_negative_and_the_fit_stays_close() -> None:
    a, b, c = fit_prefill([Probe(64, 0.05), Probe(512, 0.04), Probe(2048, 0.2)])
    assert min(a, b, c) >= 0
    # A fit that cannot use the quadratic term still prices tokens.
    a, b, c = fit_prefill([Probe(64, 0.040), Probe(512, 0.150), Probe(2048, 0.600)])
    assert b > 200 and a >= 0


def test_read_cost_comes_from_the_node_s_nixl_telemetry() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:nixl_xfer_time_seconds histogram",
            'vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.5',
            'vllm:nixl_xfer_time_seconds_count{engine="0"} 10',
            "# TYPE vllm:nixl_bytes_transferred histogram",
            'vllm:nixl_bytes_transferred_sum{engine="0"} 1048576',
            'vllm:nixl_bytes_transferred_count{engine="0"} 10',
        ]
    )
    # 1 MiB in 64 KiB blocks = 16 blocks in 0.5 s.
    assert read_cost_us_per_block(text, 65536) == pytest.approx(0.5e6 / 16)
    assert read_cost_us_per_block("", 65536) is None


async def test_calibrate_measures_each_node_and_the_registry_keeps_it() -> None:
    registry = RegistryProcess()
    await registry.start()
    try:
        async with (
            FakeEngine("decode-0") as engine,
            open_channel(RegistryEndpoint.parse(registry.address)) as channel,
        ):
            engine.prefill_fixed_s, engine.prefill_s_per_token = 0.01, 0.0004  # 400 µs/token
            spec = node_spec("decode-0", port=engine.port)
            spec.http_base_url = engine.url
            async with Heartbeats(registry_stub(channel), spec):
                result = await run_cli(
                    "calibrate", "--registry", registry.address, "--repeats", "2",
                    "--output", "json",
                )  # fmt: skip
                assert result.code == 0, result.stderr
                (measured,) = json.loads(result.stdout)
                assert measured["stored"] and not measured["reads_measured"]
                per_token = measured["costs"]["prefill_us_per_token"]
                assert 300 < per_token < 520, measured
                node = (
                    await registry_stub(channel).GetNode(
                        registry_pb2.GetNodeRequest(node_id="decode-0"), timeout=5
                    )
                ).node
                assert node.cost.HasField("calibrated_time")
                assert node.cost.prefill_us_per_token == pytest.approx(per_token)
                listed = await run_cli("node", "ls", "--registry", registry.address)
                assert f"{per_token:.0f}" in listed.stdout
                missing = await run_cli(
                    "calibrate", "nope", "--registry", registry.address, "--dry-run"
                )
                assert missing.code == 1 and "no such node: nope" in missing.stderr
    finally:
        await registry.stop()
