"""The floor of a replayed lease: what each step a recreated lease cannot do without costs, on
its own, with nothing between the steps.

``scripts/replay_cost.py`` measures the registry's CPU a lease of a full snapshot replayed into
an empty registry (a restart). This takes the same reports and calls, one step at a time over
all of their leases, only the pieces that replay must run for every lease however it is
arranged: checking the event, building the record, three look-ups that miss, storing the lease
and its conversation in the state cache's rows, the prefix index's keys and their entry, the
lease's deadlines, and its ack. What ``replay_cost`` measures beyond the sum is the path
between them (the lessor's and the store's layers, the batch's bookkeeping); the sum is what a
replay written as one pass over the rows could at best come down to with these structures.
Run from the repository root: ``.venv/bin/python scripts/replay_floor.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.controlplane.deadlines import DeadlineKind, DeadlineQueue
from kvbroker.controlplane.lessor.prefix_index import PrefixIndex, Scope, indexed_hashes
from kvbroker.controlplane.records import codec
from kvbroker.controlplane.records.model import ACTIVE, Conversation, Lease
from kvbroker.controlplane.records.validation import Validation
from kvbroker.controlplane.storage.state_cache import RecordKind, StateCache
from kvbroker.v1 import registry_pb2
from kvbroker_tools.harness.factories import node_spec
from scripts.replay_cost import BLOCK_SIZE, CONFIG, snapshot


def floor(leases: int) -> dict[str, float]:
    """Microseconds of CPU a lease for each step, over ``leases`` leases of one snapshot."""
    spec = node_spec("decode-0")
    events = list(snapshot(spec, leases, 0).events)
    validation = Validation(CONFIG)
    cache = StateCache()
    index = PrefixIndex()
    scope = Scope("", spec.model, BLOCK_SIZE)
    deadlines = DeadlineQueue(time.monotonic)
    response = registry_pb2.ReportRetentionResponse()
    blocks: list[int] = []
    records: list[Lease] = []
    keys: list[list[tuple[int, bytes]]] = []

    def check() -> None:
        blocks.extend(validation.event(event) for event in events)

    def build() -> None:
        for event, block_count in zip(events, blocks, strict=True):
            retained = event.retained
            checkpoints = Checkpoints.of(retained.block_hashes, retained.block_hash_stride)
            records.append(
                Lease(
                    lease_id=retained.lease_id,
                    conversation_id=retained.conversation_id,
                    node_id=spec.node_id,
                    node_incarnation=spec.incarnation,
                    epoch=retained.epoch,
                    handle=codec.handle_of(retained.handle, block_count),
                    checkpoints=codec.checkpoints(checkpoints.hashes),
                    block_hash_stride=checkpoints.stride,
                    token_count=retained.token_count,
                    state=ACTIVE,
                    grant_time=1.0,
                    renew_time=1.0,
                    expire_time=600.0,
                )
            )

    def look_up() -> None:
        for lease in records:
            cache.lease(lease.lease_id)
            cache.conversation(lease.conversation_id)
            cache.find_lease(lease.node_id, lease.handle.remote_request_id)

    def store_leases() -> None:
        for lease in records:
            cache.put(RecordKind.LEASE, lease.lease_id, lease)

    def store_conversations() -> None:
        for lease in records:
            conversation = Conversation(
                lease.conversation_id, lease.epoch, lease.lease_id, lease.node_id
            )
            cache.put(RecordKind.CONVERSATION, lease.conversation_id, conversation)

    def index_keys() -> None:
        keys.extend(
            indexed_hashes(
                lease.checkpoints, lease.block_hash_stride, lease.token_count, BLOCK_SIZE
            )
            for lease in records
        )

    def index_entries() -> None:
        index.reserve(sum(map(len, keys)))
        for lease, lease_keys in zip(records, keys, strict=True):
            index.add(lease.lease_id, scope, lease_keys)

    def file_deadlines() -> None:
        for lease in records:
            deadlines.schedule((DeadlineKind.LEASE_EXPIRY, lease.lease_id), 600.0)
            deadlines.cancel((DeadlineKind.CLAIM_END, lease.lease_id))
            deadlines.cancel((DeadlineKind.FORGET_LEASE, lease.lease_id))
            deadlines.cancel((DeadlineKind.FORGET_CONVERSATION, lease.conversation_id))

    def ack() -> None:
        for lease in records:
            response.leases.add(lease_id=lease.lease_id, state=ACTIVE, epoch=lease.epoch)

    steps: dict[str, Callable[[], None]] = {
        "check the event": check,
        "build the record": build,
        "look up lease, conversation, request": look_up,
        "store the lease's row": store_leases,
        "store the conversation's row": store_conversations,
        "the index's keys": index_keys,
        "the index's entry": index_entries,
        "the deadlines (expiry filed, three cancelled)": file_deadlines,
        "the ack": ack,
    }
    costs: dict[str, float] = {}
    for name, run in steps.items():
        started = time.process_time()
        run()
        costs[name] = 1e6 * (time.process_time() - started) / leases
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=20_000)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    passes = [floor(args.leases) for _ in range(args.passes)]
    # The best pass of each step: the floor is what the machine allows at its quietest.
    best = {name: min(p[name] for p in passes) for name in passes[0]}
    for name, micros in best.items():
        print(f"{name:48s} {micros:7.2f} us")
    print(f"{'sum: the floor of a recreated lease':48s} {sum(best.values()):7.2f} us")


if __name__ == "__main__":
    main()
