"""The registry's CPU a replayed lease: a full snapshot replayed into an empty registry.

A restart's cost is the holders' replays (issue 37: 100k leases back in 5 s). This replays
``--leases`` leases of 32 blocks with prefix hashes of ``BLOCK_HASH_BYTES`` (as ``bench
registry`` populates them: lease ids and epochs of a registry before the restart, so every
lease is recreated), spread over ``--nodes`` decode nodes, one full-snapshot report a node,
into a registry started in process on the memory store. The reports are the protobuf messages a
sidecar sends, handed to ``Registry.report_retention`` as the gRPC servicer does
(``api.convert.report_of``), so the figure is the registry's own CPU, not the transport's. Each
pass starts a fresh registry; ``--profile`` writes the last pass's cProfile stats. Run from the
repository root: ``.venv/bin/python scripts/replay_cost.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.logging import configure_logging
from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.controlplane.api import convert
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.records.lease_ids import new_lease_id
from kvbroker.controlplane.server import ServerOptions, start_registry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker_tools.harness.factories import node_spec, register

BLOCKS = 32
BLOCK_SIZE = 128
# Sessions outlive a pass: no heartbeats are sent.
CONFIG = dataclasses.replace(RegistryConfig(), session_ttl_s=600.0, heartbeat_interval_s=60.0)


def snapshot(
    spec: node_pb2.NodeSpec, leases: int, first: int
) -> registry_pb2.ReportRetentionRequest:
    """A node's full snapshot of ``leases`` leases a registry before the restart granted."""
    events = []
    for index in range(first, first + leases):
        hashes = os.urandom(BLOCKS * BLOCK_HASH_BYTES)
        retained = registry_pb2.RetainedBlocks(
            conversation_id=f"conv-{index}",
            handle=lease_pb2.KvHandle(
                remote_engine_id=spec.engine_id,
                remote_request_id=uuid.uuid4().hex,
                remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=range(BLOCKS))],
                remote_host=spec.side_channel_host,
                remote_port=spec.side_channel_port,
                remote_num_tokens=BLOCKS * BLOCK_SIZE,
                tp_size=1,
            ),
            block_hashes=[
                hashes[i : i + BLOCK_HASH_BYTES] for i in range(0, len(hashes), BLOCK_HASH_BYTES)
            ],
            token_count=BLOCKS * BLOCK_SIZE,
            lease_id=new_lease_id(time.time()),
            epoch=1,
        )
        events.append(registry_pb2.RetentionEvent(sequence=index - first + 1, retained=retained))
    return registry_pb2.ReportRetentionRequest(
        node_id=spec.node_id, incarnation=spec.incarnation, events=events, full_snapshot=True
    )


async def one_pass(leases: int, nodes: int, profile: cProfile.Profile | None) -> float:
    """Registry CPU seconds to replay ``leases`` leases into a fresh registry."""
    specs = [node_spec(f"decode-{i}") for i in range(nodes)]
    share = leases // nodes
    reports = [snapshot(spec, share, i * share) for i, spec in enumerate(specs)]
    running = await start_registry(ServerOptions(listen="127.0.0.1:0", config=CONFIG))
    registry = running.registry
    assert registry is not None
    try:
        async with open_channel(RegistryEndpoint.parse(running.address)) as channel:
            stub = registry_stub(channel)
            for spec in specs:
                await register(stub, spec)
        started = time.process_time()
        if profile is not None:
            profile.enable()
        for request in reports:
            response = await registry.report_retention(convert.report_of(request))
            assert len(response.leases) == share and not response.refused
        if profile is not None:
            profile.disable()
        return time.process_time() - started
    finally:
        await running.stop(grace=0)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--profile", help="write the last pass's cProfile stats here")
    args = parser.parse_args()
    configure_logging("warning")  # no debug lines, as ``registry serve`` runs; no registrations
    per_lease = []
    for index in range(args.passes):
        last = index == args.passes - 1
        profile = cProfile.Profile() if args.profile and last else None
        seconds = await one_pass(args.leases, args.nodes, profile)
        per_lease.append(1e6 * seconds / args.leases)
        if profile is not None:
            profile.dump_stats(args.profile)
    print(
        f"{args.leases:,} leases on {args.nodes} nodes: registry CPU a replayed lease "
        + ", ".join(f"{us:.1f}" for us in per_lease)
        + f" us (best {min(per_lease):.1f})"
    )


if __name__ == "__main__":
    asyncio.run(main())
