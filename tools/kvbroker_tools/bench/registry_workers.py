"""The load of `kvbroker bench registry`: the turns at fixed rates and the saturating
callers, each run in processes of its own, and the retention reports both send.

Apart from the run (``kvbroker_tools.bench.registry_load``), which starts the registry and reads
its figures, because a spawned load process imports its target's module: this one keeps that
to the load and its gRPC client, without the registry process or the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
import uuid
from typing import Any

import uvloop

from kvbroker.common.client.batcher import Batcher
from kvbroker.common.client.grpc_client import (
    SERVED_BY_METADATA_KEY,
    RegistryEndpoint,
    open_channel,
    registry_stub,
)
from kvbroker.common.client.hint_batcher import HintBatcher
from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2

BLOCK_SIZE = 128  # vLLM's CPU default; a 4k-token conversation has 32 blocks
# Hints as routers send them: concurrent turns share BatchGetRoutingHints calls.
HINT_RPC = "BatchGetRoutingHints"


def retained_blocks(
    conversation: str, request_id: str, node: node_pb2.NodeSpec, blocks: int
) -> Any:
    return registry_pb2.RetainedBlocks(
        conversation_id=conversation,
        handle=lease_pb2.KvHandle(
            remote_engine_id=node.engine_id,
            remote_request_id=request_id,
            remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=range(blocks))],
            remote_host=node.side_channel_host,
            remote_port=node.side_channel_port,
            remote_num_tokens=blocks * BLOCK_SIZE,
            tp_size=1,
        ),
        block_hashes=_random_hashes(blocks),
        token_count=blocks * BLOCK_SIZE,
    )


def _random_hashes(blocks: int) -> list[bytes]:
    blob = os.urandom(blocks * BLOCK_HASH_BYTES)  # one call: the load generator must stay cheap
    return [blob[i : i + BLOCK_HASH_BYTES] for i in range(0, len(blob), BLOCK_HASH_BYTES)]


def fixed_rate_worker(
    address: str,
    decodes: list[bytes],
    conversations: int,
    rate: float,
    seconds: float,
    seed: int,
    out: Any,
) -> None:
    # On uvloop, as routers under uvicorn and sidecars run.
    out.put(uvloop.run(_fixed_rate(address, decodes, conversations, rate, seconds, seed)))


async def _fixed_rate(
    address: str, decodes: list[bytes], conversations: int, rate: float, seconds: float, seed: int
) -> dict[str, Any]:
    nodes = [node_pb2.NodeSpec.FromString(raw) for raw in decodes]
    latencies: dict[str, list[float]] = {HINT_RPC: [], "ReportRetention": [], "RenewLease": []}
    errors = 0
    # Above anything a node has applied: populating numbered its events from 1.
    sequence = [int(time.time() * 1e6) + seed * 10**12]

    def reports_of(stub: Any, node: node_pb2.NodeSpec) -> Batcher[Any, lease_pb2.Lease]:
        async def send(retained: list[Any]) -> list[lease_pb2.Lease]:
            events = []
            for blocks in retained:
                sequence[0] += 1
                events.append(registry_pb2.RetentionEvent(sequence=sequence[0], retained=blocks))
            response = await stub.ReportRetention(
                registry_pb2.ReportRetentionRequest(
                    node_id=node.node_id, incarnation=node.incarnation, events=events
                ),
                timeout=5,
            )
            return list(response.leases)

        return Batcher(send, max_batch=512, name=f"reports-{node.node_id}")

    async def turn(stub: Any, index: int) -> None:
        nonlocal errors
        conversation = f"conv-{(index * 7919 + seed) % conversations}"
        try:
            started = time.perf_counter()
            hint = await hints.hint(
                registry_pb2.GetRoutingHintRequest(conversation_id=conversation)
            )
            latencies[HINT_RPC].append(time.perf_counter() - started)
            # The node the turn was routed to reports its retention: only it may lease the
            # conversation. Each worker reports for every node, above its own sequence base
            # (a report below a node's last applied sequence still grants).
            node = by_id[hint.decode.node_id]
            retained = retained_blocks(conversation, uuid.uuid4().hex, node, 32)
            started = time.perf_counter()
            await reports[node.node_id].submit(retained)
            latencies["ReportRetention"].append(time.perf_counter() - started)
            if index % 4 == 0:
                started = time.perf_counter()
                await stub.RenewLease(
                    registry_pb2.RenewLeaseRequest(conversation_id=conversation), timeout=5
                )
                latencies["RenewLease"].append(time.perf_counter() - started)
        except Exception:  # counted: any failure of a turn
            errors += 1

    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        stub = registry_stub(channel)
        hints = HintBatcher(stub, timeout_s=5)  # as the router sends them
        by_id = {node.node_id: node for node in nodes}
        reports = {node.node_id: reports_of(stub, node) for node in nodes}
        tasks = []
        start = time.perf_counter()
        total = int(rate * seconds)
        for index in range(total):
            delay = start + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(turn(stub, index)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {"latencies": latencies, "errors": errors, "seconds": elapsed}


def saturation_worker(
    address: str, conversations: int, seconds: float, batched: bool, out: Any
) -> None:
    out.put(uvloop.run(_saturation(address, conversations, seconds, batched)))


async def _saturation(
    address: str, conversations: int, seconds: float, batched: bool
) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def caller(stub: Any, hints: HintBatcher, offset: int) -> None:
        nonlocal errors
        index = offset
        while time.perf_counter() < stop_at:
            request = registry_pb2.GetRoutingHintRequest(
                conversation_id=f"conv-{index % conversations}", dry_run=True
            )
            started = time.perf_counter()
            try:
                if batched:
                    await hints.hint(request)
                else:
                    await stub.GetRoutingHint(request, timeout=5)
                latencies.append(time.perf_counter() - started)
            except Exception:
                errors += 1
            index += 97

    async with contextlib.AsyncExitStack() as stack:
        # One channel per replica ("a,b,c"), the callers spread over them evenly.
        stubs = [
            registry_stub(await stack.enter_async_context(open_channel(RegistryEndpoint([one]))))
            for one in address.split(",")
        ]
        batchers = [HintBatcher(stub, timeout_s=5) for stub in stubs]
        start = time.perf_counter()
        await asyncio.gather(
            *(caller(stubs[i % len(stubs)], batchers[i % len(stubs)], i) for i in range(64))
        )
        elapsed = time.perf_counter() - start
    return {"latencies": latencies, "errors": errors, "seconds": elapsed}


def paced_hint_worker(
    addresses: str, conversations: int, rate: float, seconds: float, seed: int, out: Any
) -> None:
    out.put(uvloop.run(_paced_hints(addresses, conversations, rate, seconds, seed)))


async def _paced_hints(
    addresses: str, conversations: int, rate: float, seconds: float, seed: int
) -> dict[str, Any]:
    """Dry-run hints at ``rate``, open loop, each as one GetRoutingHint call to the replicas
    ("a,b,c") in turn: what a gateway's placement hop asks on every request. ``answered_there``
    counts the hints the replica asked answered itself (``kvbroker-served-by``)."""
    latencies: list[float] = []
    errors = answered_there = 0
    replicas = addresses.split(",")

    async def one(stub: Any, address: str, index: int) -> None:
        nonlocal errors, answered_there
        request = registry_pb2.GetRoutingHintRequest(
            conversation_id=f"conv-{(index * 7919 + seed) % conversations}", dry_run=True
        )
        started = time.perf_counter()
        try:
            call = stub.GetRoutingHint(request, timeout=5)
            await call
            latencies.append(time.perf_counter() - started)
            served_by = dict(await call.trailing_metadata() or ()).get(SERVED_BY_METADATA_KEY)
            answered_there += served_by == address
        except Exception:  # counted: any failure of a hint
            errors += 1

    async with contextlib.AsyncExitStack() as stack:
        stubs = [
            registry_stub(await stack.enter_async_context(open_channel(RegistryEndpoint([one]))))
            for one in replicas
        ]
        tasks = []
        start = time.perf_counter()
        for index in range(int(rate * seconds)):
            delay = start + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            which = index % len(stubs)
            tasks.append(asyncio.create_task(one(stubs[which], replicas[which], index)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {
        "latencies": latencies,
        "errors": errors,
        "seconds": elapsed,
        "answered_there": answered_there,
    }


def run_workers(target: Any, args_per_worker: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    workers = [context.Process(target=target, args=(*args, out)) for args in args_per_worker]
    for worker in workers:
        worker.start()
    results = [out.get() for _ in workers]
    for worker in workers:
        worker.join()
    return results


def prefix_worker(
    address: str,
    prefill_ids: list[str],
    probes: list[list[bytes]],
    seconds: float,
    out: Any,
) -> None:
    out.put(uvloop.run(_prefix_lookups(address, prefill_ids, probes, seconds)))


async def _prefix_lookups(
    address: str, prefill_ids: list[str], probes: list[list[bytes]], seconds: float
) -> dict[str, Any]:
    """MatchPrefix as fast as it is answered, from 64 callers: every other look-up is a live
    lease's prefix (a fork of it: a hit, its pin ended at once as a reader ends it after its
    read), the rest random hashes (a miss). Only MatchPrefix itself is timed."""
    latencies: list[float] = []
    errors = hits = 0
    stop_at = time.perf_counter() + seconds

    async def caller(stub: Any, offset: int) -> None:
        nonlocal errors, hits
        index = offset
        while time.perf_counter() < stop_at:
            node_id = prefill_ids[index % len(prefill_ids)]
            wanted = probes[index % len(probes)] if index % 2 == 0 else _random_hashes(6)
            request = registry_pb2.MatchPrefixRequest(
                node_id=node_id,
                conversation_id=f"fork-{index}",
                model="bench",
                block_size=BLOCK_SIZE,
                probe_hashes=wanted,
            )
            started = time.perf_counter()
            try:
                answer = await stub.MatchPrefix(request, timeout=5)
                latencies.append(time.perf_counter() - started)
                if answer.pin_id:
                    hits += 1
                    await stub.EndReadPin(
                        registry_pb2.EndReadPinRequest(
                            node_id=node_id, lease_id=answer.lease.lease_id, pin_id=answer.pin_id
                        ),
                        timeout=5,
                    )
            except Exception:
                errors += 1
            index += 97

    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        stub = registry_stub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(caller(stub, i) for i in range(64)))
        elapsed = time.perf_counter() - start
    return {"latencies": latencies, "errors": errors, "hits": hits, "seconds": elapsed}
