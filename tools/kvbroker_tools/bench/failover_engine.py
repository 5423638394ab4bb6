"""The failover soak's simulated engines: a decode engine that retains blocks per turn and
frees them on the registry's deadlines, a prefill engine that checks a lease before it reads,
and the ground truth both keep of what was held, hinted and read.

Apart from the fleet that runs them (``kvbroker_tools.bench.failover``) because they are the
one part of the soak that is not kvbroker's own processes: they stand in for vLLM and its
connector, through the real ``EngineLink``, and the drain and replica tests drive them too.
They know the fleet only as the ``Fleet`` protocol, so the import goes one way.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvbroker.common.client.engine_link import EngineLink
from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.common.rules.clock import to_duration
from kvbroker.common.rules.handles import EPOCH_KEY, LEASE_ID_KEY
from kvbroker.common.rules.retention_deadline import (
    LeaseDeadline,
    RetentionDeadline,
    first_deadline,
    next_deadline,
)
from kvbroker.v1 import lease_pb2, registry_pb2, sidecar_pb2
from kvbroker_tools.harness.engine import FakeEngine

MODEL = "sim-model"
BLOCK_SIZE = 16
TOKENS_PER_TURN = 256
# Like vLLM's decoder_kv_blocks_ttl: the longest a decode engine keeps blocks on its own.
HARD_CAP_S = 600.0


@dataclass
class Held:
    """Blocks a simulated decode engine holds for one request (its ground truth)."""

    conversation: str
    deadline: RetentionDeadline
    lease_id: str = ""
    epoch: int = 0


@dataclass
class Tally:
    turns: int = 0
    failed: list[str] = field(default_factory=list)
    reuse_exact: int = 0
    degraded: int = 0
    reads: int = 0
    declined: int = 0
    stale_hints: int = 0
    stale_reads: int = 0
    leases: set[str] = field(default_factory=set)


class Fleet(Protocol):
    """What an engine reads and keeps of the soak's fleet (``kvbroker_tools.bench.failover``
    implements it): the other engines by id, and the ground truth. A protocol, so that the
    engines do not import the fleet that runs them."""

    tally: Tally
    # Per conversation, the (engine id, request id) of each turn retained for it.
    retentions: dict[str, list[tuple[str, str]]]

    def engine(self, engine_id: str) -> SimEngine | None: ...


class SimEngine(FakeEngine):
    """A fake engine whose KV is simulated: a decode leg retains the conversation so far and
    reports it through the real EngineLink; the registry's deadlines free it."""

    def __init__(self, node_id: str, role: str, socket: Path, fleet: Fleet) -> None:
        super().__init__(node_id, model=MODEL)
        self.node_id, self.role, self.fleet = node_id, role, fleet
        self.engine_id = f"engine-{node_id}"
        self.held: dict[str, Held] = {}
        self.link = EngineLink(
            f"unix:{socket}",
            sidecar_pb2.EngineInfo(
                engine_id=self.engine_id,
                side_channel_host="127.0.0.1",
                side_channel_port=self.port,
                block_size=BLOCK_SIZE,
                capacity_blocks=65_536,
                bytes_per_block=65_536,
                model=MODEL,
            ),
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await super().start()
        self._tasks.append(asyncio.create_task(self._apply_deadlines()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().stop()
        await asyncio.to_thread(self.link.close)

    def kv_cache_usage(self) -> float:
        return len(self.held) / 65536

    async def kv_transfer_params(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return await self._prefill(params)
        return self._decode(str(body.get("session_id") or ""))

    async def _prefill(self, params: dict[str, Any]) -> dict[str, Any]:
        """A prefill leg; with a handle, the connector's fence, then the read."""
        lease_id = params.get(LEASE_ID_KEY)
        if lease_id:
            holder = self.fleet.engine(str(params.get("remote_engine_id")))
            held = holder.held.get(str(params.get("remote_request_id"))) if holder else None
            if held is None:
                self.fleet.tally.stale_hints += 1
            usable, _ = await asyncio.to_thread(
                self.link.check_lease, str(lease_id), int(params.get(EPOCH_KEY) or 0), 0.25
            )
            if usable:
                self.fleet.tally.reads += 1
                if holder is None or str(params.get("remote_request_id")) not in holder.held:
                    self.fleet.tally.stale_reads += 1
            else:
                self.fleet.tally.declined += 1
        return {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"p-{uuid.uuid4().hex[:12]}",
            "remote_block_ids": [[0]],
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
        }

    def _decode(self, conversation: str) -> dict[str, Any]:
        """A decode leg: the conversation so far stays retained under a lease."""
        request_id = f"d-{uuid.uuid4().hex[:12]}"
        if not conversation:
            return {}
        tokens = TOKENS_PER_TURN * (
            1 + sum(h.conversation == conversation for h in self.held.values())
        )
        blocks = -(-tokens // BLOCK_SIZE)
        self.held[request_id] = Held(conversation, first_deadline(time.monotonic(), HARD_CAP_S))
        self.fleet.retentions.setdefault(conversation, []).append((self.engine_id, request_id))
        self.link.retained(
            registry_pb2.RetainedBlocks(
                conversation_id=conversation,
                handle=lease_pb2.KvHandle(
                    remote_engine_id=self.engine_id,
                    remote_request_id=request_id,
                    remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=list(range(blocks)))],
                    remote_host="127.0.0.1",
                    remote_port=self.port,
                    remote_num_tokens=tokens,
                ),
                block_hashes=[os.urandom(BLOCK_HASH_BYTES) for _ in range(blocks)],
                token_count=tokens,
                time_to_live=to_duration(HARD_CAP_S),
            )
        )
        return {"do_remote_decode": False}

    async def _apply_deadlines(self) -> None:
        """What the connector does each scheduler step: deadlines in, expired blocks out."""
        while True:
            now = time.monotonic()
            for deadline in self.link.poll_deadlines():
                held = self.held.get(deadline.remote_request_id)
                if held is None:
                    continue
                if deadline.lease_live:
                    held.lease_id, held.epoch = deadline.lease_id, deadline.epoch
                    self.fleet.tally.leases.add(deadline.lease_id)
                lease = LeaseDeadline(deadline.lease_live, deadline.expires_at - now)
                held.deadline = next_deadline(held.deadline, lease, now, HARD_CAP_S)
            for request_id in [r for r, h in self.held.items() if h.deadline.free_at <= now]:
                del self.held[request_id]
                self.link.released(
                    request_id, "freed by the engine (deadline)", lease_pb2.LEASE_END_CAUSE_IDLE
                )
            await asyncio.sleep(0.02)
