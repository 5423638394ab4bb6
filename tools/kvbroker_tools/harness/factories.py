"""Builders for the proto messages that sidecars and engines send, a stand-in for their
heartbeats, and a clock a test moves by hand."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, registry_pb2_grpc


class ManualClock:
    """A clock (a call that gives the time in seconds) that stands still until the test sets
    ``t``: what the registry and its deadline queue take in place of the monotonic one."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def node_spec(
    node_id: str,
    role: node_pb2.NodeRole = node_pb2.NODE_ROLE_DECODE,
    port: int = 5600,
    model: str = "tiny-qwen3",
) -> node_pb2.NodeSpec:
    return node_pb2.NodeSpec(
        node_id=node_id,
        role=role,
        engine_id=f"engine-{node_id}",
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        http_base_url=f"http://127.0.0.1:{port + 1000}",
        model=model,
        block_size=16,
        capacity_blocks=4096,
        bytes_per_block=65536,
        incarnation=uuid.uuid4().hex,
    )


def block_hashes(tokens: int, block_size: int = 16, salt: str = "") -> list[bytes]:
    return [
        hashlib.sha256(f"{salt}{i}".encode()).digest()[:BLOCK_HASH_BYTES]
        for i in range(tokens // block_size)
    ]


def handle(request_id: str, tokens: int, spec: node_pb2.NodeSpec) -> lease_pb2.KvHandle:
    blocks = -(-tokens // spec.block_size)
    return lease_pb2.KvHandle(
        remote_engine_id=spec.engine_id,
        remote_request_id=request_id,
        remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=range(blocks))],
        remote_host=spec.side_channel_host,
        remote_port=spec.side_channel_port,
        remote_num_tokens=tokens,
        tp_size=1,
    )


async def register(
    stub: registry_pb2_grpc.RegistryServiceStub, spec: node_pb2.NodeSpec
) -> node_pb2.Node:
    request = registry_pb2.RegisterNodeRequest(spec=spec)
    response: registry_pb2.RegisterNodeResponse = await stub.RegisterNode(request, timeout=5)
    return response.node


async def grant(
    stub: registry_pb2_grpc.RegistryServiceStub,
    spec: node_pb2.NodeSpec,
    conversation: str,
    request_id: str,
    tokens: int = 256,
    ttl_s: float | None = None,
) -> lease_pb2.Lease:
    request = registry_pb2.GrantLeaseRequest(
        conversation_id=conversation,
        node_id=spec.node_id,
        node_incarnation=spec.incarnation,
        handle=handle(request_id, tokens, spec),
        block_hashes=block_hashes(tokens),
        token_count=tokens,
    )
    if ttl_s is not None:
        request.time_to_live.FromNanoseconds(int(ttl_s * 1e9))
    response: registry_pb2.GrantLeaseResponse = await stub.GrantLease(request, timeout=5)
    return response.lease


async def hint(
    stub: registry_pb2_grpc.RegistryServiceStub, conversation: str, dry_run: bool = False
) -> registry_pb2.RoutingHint:
    request = registry_pb2.GetRoutingHintRequest(conversation_id=conversation, dry_run=dry_run)
    response: registry_pb2.GetRoutingHintResponse = await stub.GetRoutingHint(request, timeout=5)
    return response.hint


class Heartbeats:
    """Heartbeats nodes in the background, as their sidecars would, until closed."""

    def __init__(
        self, stub: registry_pb2_grpc.RegistryServiceStub, *specs: node_pb2.NodeSpec
    ) -> None:
        self._stub = stub
        self._specs = list(specs)
        # What every beat reports; tests change it to steer the least-loaded choice.
        self.load = node_pb2.NodeLoad()
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            for spec in self._specs:
                await self._stub.Heartbeat(
                    registry_pb2.HeartbeatRequest(
                        node_id=spec.node_id,
                        incarnation=spec.incarnation,
                        engine_ready=True,
                        load=self.load,
                    ),
                    timeout=5,
                )
            await asyncio.sleep(0.1)

    async def __aenter__(self) -> Heartbeats:
        for spec in self._specs:
            await register(self._stub, spec)
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def replayed(lease: lease_pb2.Lease, sequence: int = 1) -> registry_pb2.RetentionEvent:
    """The retention event a holder's sidecar replays for a lease it still retains."""
    return registry_pb2.RetentionEvent(
        sequence=sequence,
        retained=registry_pb2.RetainedBlocks(
            conversation_id=lease.conversation_id,
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            handle=lease.handle,
            block_hashes=lease.block_hashes,
            token_count=lease.token_count,
        ),
    )
