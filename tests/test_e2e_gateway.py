"""The placement hop end to end on real vLLM CPU servers, laid out as llm-d runs without
Kubernetes (``docs/discovery.md``): Envoy with kvbroker's ext_proc, then a picker that honours
the subset hint (``kvbroker_tools.harness.envoy.SubsetPicker``), then ORIGINAL_DST to the decode
pod's routing sidecar (the ``llmd`` stand-in of ``kvbroker_tools.harness.pd_proxies``, which runs
the prefill leg and then decodes, cloning the client's headers), kvbroker's router out of the
path. Multi-turn conversations: turn 1 is a MISS and is not steered; from turn 2 the hop pins
the decode node holding the KV, the prefill engine reads it (its log says so, once per turn),
and every answer is token-identical with the same turn sent without a session id."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.gateway.config import PlacementConfig
from kvbroker.gateway.server import start_placement
from kvbroker_tools.harness.envoy import Envoy, SubsetPicker
from kvbroker_tools.harness.pd_proxies import running_proxy
from kvbroker_tools.stack import Stack
from tests.e2e_stack import e2e_marks, stack_fixture
from tests.test_e2e_fleets import conversation

pytestmark = e2e_marks()


stack = stack_fixture()


async def test_through_envoy_and_the_picker_follow_ups_read_on_the_pinned_node(
    stack: Stack, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # The nodes as the registry knows them (their sidecars register no gateway endpoint, so
    # their engine's address); the picker's pool is the decode pod, reached through its
    # routing sidecar.
    decode = stack.url(stack.decode).removeprefix("http://")
    prefill = stack.url(stack.prefill).removeprefix("http://")
    config = PlacementConfig(listen="127.0.0.1:0", hint_timeout_s=1.0)
    hop = await start_placement(RegistryEndpoint.parse(stack.registry_address), config)
    try:
        async with running_proxy("llmd", [stack.url(stack.prefill)], [stack.url(stack.decode)]) as (
            sidecar,
            proxy,
        ):
            picker = SubsetPicker([decode], routes={decode: sidecar.removeprefix("http://")})
            await picker.start()
            envoy = Envoy(tmp_path, picker.address, hop.address)
            await envoy.start()
            try:
                for session in ("gw-conv-a", "gw-conv-bb"):
                    before = len(picker.picks)
                    reads = await conversation(stack, http, envoy.url, session)
                    assert reads == [0, 1, 1], (session, reads)
                    # Each turn and its reuse-off twin; the hop pinned the turns after the
                    # first to the decode node holding the KV (first in the subset; the
                    # prefill node after it for READ) and nothing else.
                    subsets = [p.subset for p in picker.picks[before:]]
                    pinned = [s is not None and s[:1] == [decode] for s in subsets]
                    assert pinned == [False, False, True, False, True, False], subsets
                    assert all(set(s or []) <= {decode, prefill} for s in subsets), subsets
                assert proxy.stats.prefill_legs == proxy.stats.decode_legs == 12
            finally:
                await envoy.stop()
                await picker.stop()
    finally:
        await hop.stop()
