"""The reuse handle in the two shapes it travels in: kvbroker's ``KvHandle`` proto, and the
``kv_transfer_params`` dict that vLLM's NIXL connector reads and writes.

kvbroker adds three keys of its own to the dict a prefill node receives, which its connector
uses to fence and verify the read: the lease id, its epoch, and the block hashes (hex).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbroker.v1 import lease_pb2

LEASE_ID_KEY = "kvbroker_lease_id"
EPOCH_KEY = "kvbroker_epoch"
BLOCK_HASHES_KEY = "kvbroker_block_hashes"
# vLLM's keys that describe the decode node's retained blocks.
HANDLE_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_blocks_expiry_time",
    LEASE_ID_KEY,
    EPOCH_KEY,
    BLOCK_HASHES_KEY,
)


def handle_from_params(params: Mapping[str, Any]) -> lease_pb2.KvHandle:
    """D's ``kv_transfer_params`` (from vLLM's ``request_finished``) as a KvHandle."""
    return lease_pb2.KvHandle(
        remote_engine_id=str(params["remote_engine_id"]),
        remote_request_id=str(params["remote_request_id"]),
        remote_block_groups=[
            lease_pb2.BlockIdGroup(block_ids=[int(b) for b in group])
            for group in params["remote_block_ids"]
        ],
        remote_host=str(params["remote_host"]),
        remote_port=int(params["remote_port"]),
        remote_num_tokens=int(params.get("remote_num_tokens") or 0),
        tp_size=int(params.get("tp_size") or 1),
        dcp_size=int(params.get("dcp_size") or 1),
        pp_size=int(params.get("pp_size") or 1),
    )


def prefill_params(lease: lease_pb2.Lease | None) -> dict[str, Any]:
    """``kv_transfer_params`` for a prefill leg: a P/D prefill, plus the lease's handle when
    the registry offered one."""
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if lease is None:
        return params
    handle = lease.handle
    params.update(
        remote_engine_id=handle.remote_engine_id,
        remote_request_id=handle.remote_request_id,
        remote_block_ids=[list(group.block_ids) for group in handle.remote_block_groups],
        remote_host=handle.remote_host,
        remote_port=handle.remote_port,
        remote_num_tokens=handle.remote_num_tokens,
        tp_size=handle.tp_size or 1,
        dcp_size=handle.dcp_size or 1,
        pp_size=handle.pp_size or 1,
    )
    params[LEASE_ID_KEY] = lease.lease_id
    params[EPOCH_KEY] = lease.epoch
    params[BLOCK_HASHES_KEY] = [h.hex() for h in lease.block_hashes]
    return params


def strip_handle(params: dict[str, Any]) -> None:
    """Removes the remote handle so vLLM neither reads nor notifies the decode node."""
    for key in HANDLE_KEYS:
        params.pop(key, None)


def hashes_from_params(params: Mapping[str, Any]) -> Sequence[bytes] | None:
    raw = params.get(BLOCK_HASHES_KEY)
    if not isinstance(raw, list):
        return None
    try:
        return [bytes.fromhex(h) for h in raw]
    except (TypeError, ValueError):
        return None
