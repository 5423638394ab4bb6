"""The state cache's own cost a lease: traced bytes, a read and an update.

20,000 leases of 32 blocks with their prefix hashes (``BLOCK_HASH_BYTES``), each decoded
from its stored bytes into a ``StateCache`` (so the cache's records and indexes alone: not
the prefix index or the deadlines), on 1,000 nodes, request ids as engines make them (uuid
hex); and as many conversations (ids ``conv-N``) in a cache of their own. CPU time, best of 5
passes. Run from the repository root: ``.venv/bin/python scripts/state_cache_cost.py``.
"""

from __future__ import annotations

import os
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.lease_ids import new_lease_id
from kvbroker.controlplane.records.model import Conversation
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache
from kvbroker.v1 import lease_pb2

LEASES = 20_000
NODES = 1_000
BLOCKS = 32
PASSES = 5


def stored_lease(index: int) -> tuple[str, bytes]:
    lease_id = new_lease_id(time.time())
    message = lease_pb2.Lease(
        lease_id=lease_id,
        conversation_id=f"conv-{index}",
        node_id=f"node-{index % NODES}",
        node_incarnation=f"incarnation-{index % NODES}",
        epoch=1,
        handle=lease_pb2.KvHandle(
            remote_engine_id=f"engine-{index % NODES}",
            remote_request_id=uuid.uuid4().hex,
            remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=range(BLOCKS))],
            remote_host="10.0.0.1",
            remote_port=5600,
            remote_num_tokens=BLOCKS * 128,
            tp_size=1,
        ),
        block_hashes=[os.urandom(BLOCK_HASH_BYTES) for _ in range(BLOCKS)],
        block_hash_stride=1,
        token_count=BLOCKS * 128,
        state=lease_pb2.LEASE_STATE_ACTIVE,
    )
    message.grant_time.FromNanoseconds(time.time_ns())
    message.expire_time.FromNanoseconds(time.time_ns())
    return lease_id, message.SerializeToString()


def conversation_bytes(lease_ids: list[str]) -> float:
    """Traced bytes a conversation (one a lease, as the bench's), in a cache of its own."""
    stored = [
        (
            f"conv-{i}",
            codec.conversation_bytes(
                Conversation(f"conv-{i}", 1, lease_id, f"node-{i % NODES}", time.time())
            ),
        )
        for i, lease_id in enumerate(lease_ids)
    ]
    tracemalloc.start()
    cache = StateCache()
    before = tracemalloc.get_traced_memory()[0]
    for conversation_id, raw in stored:
        cache.apply(RecordKind.CONVERSATION, conversation_id, raw)
    traced = (tracemalloc.get_traced_memory()[0] - before) / len(stored)
    tracemalloc.stop()
    return traced


def best(action: Callable[[str], object], ids: list[str]) -> float:
    """Seconds an id of ``action``'s pass over ``ids``, best of ``PASSES``."""
    times = []
    for _ in range(PASSES):
        start = time.process_time()
        for lease_id in ids:
            action(lease_id)
        times.append((time.process_time() - start) / len(ids))
    return min(times)


def main() -> None:
    stored = [stored_lease(i) for i in range(LEASES)]
    tracemalloc.start()
    cache = StateCache()
    before = tracemalloc.get_traced_memory()[0]
    for lease_id, raw in stored:
        cache.apply(RecordKind.LEASE, lease_id, raw)
    traced = (tracemalloc.get_traced_memory()[0] - before) / LEASES
    tracemalloc.stop()
    ids = [lease_id for lease_id, _ in stored]
    leases = {lease_id: cache.lease(lease_id) for lease_id in ids}
    read = best(cache.lease, ids)
    update = best(lambda i: cache.put(RecordKind.LEASE, i, leases[i]), ids)
    print(f"traced bytes a lease: {traced:,.0f}")
    print(f"traced bytes a conversation: {conversation_bytes(ids):,.0f}")
    print(f"a read (StateCache.lease): {read * 1e6:.2f} us")
    print(f"an update (StateCache.put): {update * 1e6:.2f} us")


if __name__ == "__main__":
    main()
