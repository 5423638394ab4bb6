"""The reuse handle in the two shapes it travels in: kvbroker's ``KvHandle`` proto, and the
``kv_transfer_params`` dict that vLLM's NIXL connector reads and writes.

kvbroker adds four keys of its own to the dict a prefill node receives, which its connector
uses to fence and verify the read: the lease id, its epoch, and the prefix hashes (hex) at
checkpoints with their stride (``kvbroker.common.rules.checkpoints``).

This is the one adapter for vLLM's dict format, and it lives in ``common``, not beside
``engine_ext.vllm_compat``, because the router builds a prefill leg's dict from a lease and a
decode-local turn's dict without importing vLLM (engine_ext imports it). The format is one for
vLLM 0.32 to 0.34: 0.33 added ``remote_registration_generation`` (a decode engine's KV
registration generation, which a 0.33+ prefill engine compares to decide whether to handshake
again); 0.32 neither writes nor reads it and ignores it as it ignores kvbroker's own keys, and
a dict without it reads as generation 0 (``docs/vllm-versions.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.v1 import lease_pb2

LEASE_ID_KEY = "kvbroker_lease_id"
# The conversation, carried by the prefill engine to the decode engine in the transfer
# parameters every P/D router relays: routers that forward the client's session id to the
# prefill leg only (``vllm-router``) still get the turn retained under it.
SESSION_KEY = "kvbroker_session_id"
# Set on every request kvbroker prepared (its router's legs, or an engine's own resolution):
# an engine does not resolve such a request again (``engine_ext.session_reuse``).
DECIDED_KEY = "kvbroker_decided"
EPOCH_KEY = "kvbroker_epoch"
BLOCK_HASHES_KEY = "kvbroker_block_hashes"
HASH_STRIDE_KEY = "kvbroker_hash_stride"
# Set by the prefill engine on the transfer parameters it answers with when it read the
# turn's history from a lease it found by content (a fork, a sessionless turn): the tokens it
# accepted to read. The router planned such a turn as new (MISS) and learns of the read only
# so (``content_read_tokens``).
CONTENT_READ_KEY = "kvbroker_read_by_content"
# vLLM 0.33+: the decode engine's KV registration generation (absent on 0.32: 0).
REGISTRATION_GENERATION_KEY = "remote_registration_generation"
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
    REGISTRATION_GENERATION_KEY,
    LEASE_ID_KEY,
    EPOCH_KEY,
    BLOCK_HASHES_KEY,
    HASH_STRIDE_KEY,
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
        remote_registration_generation=int(params.get(REGISTRATION_GENERATION_KEY) or 0),
    )


def prefill_params(lease: lease_pb2.Lease | None) -> dict[str, Any]:
    """``kv_transfer_params`` for a prefill leg: a P/D prefill, plus the lease's handle when
    the registry offered one."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        DECIDED_KEY: True,
    }
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
    params[REGISTRATION_GENERATION_KEY] = handle.remote_registration_generation
    params[LEASE_ID_KEY] = lease.lease_id
    params[EPOCH_KEY] = lease.epoch
    params[BLOCK_HASHES_KEY] = [h.hex() for h in lease.block_hashes]
    params[HASH_STRIDE_KEY] = lease.block_hash_stride or 1
    return params


# A turn sent straight to the decode node that holds the conversation (no prefill leg): it
# computes the new suffix against its own prefix cache, and keeps the whole conversation
# retained afterwards, as after a decode leg.
DECODE_LOCAL_KEY = "kvbroker_decode_local"


def decode_local_params() -> dict[str, Any]:
    """``kv_transfer_params`` for a turn served wholly on the decode node."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": False,
        DECODE_LOCAL_KEY: True,
        DECIDED_KEY: True,
    }


def decided_params() -> dict[str, Any]:
    """``kv_transfer_params`` for a turn kvbroker sends to a node alone without reuse (a
    decode node that retains nothing): no transfer, and nothing for the engine to resolve."""
    return {DECIDED_KEY: True}


def session_of(session_field: str | None, params: Mapping[str, Any] | None) -> str | None:
    """A request's conversation: its own session id, else the one its prefill engine carried
    in the transfer parameters (``SESSION_KEY``)."""
    if session_field:
        return session_field
    carried = params.get(SESSION_KEY) if params else None
    return carried if isinstance(carried, str) and carried else None


def content_read_tokens(params: Mapping[str, Any] | None) -> int:
    """The tokens a prefill engine read by content for the turn (``CONTENT_READ_KEY``; 0:
    none, or a value that is not a count)."""
    tokens = params.get(CONTENT_READ_KEY) if params else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0


def strip_handle(params: dict[str, Any]) -> None:
    """Removes the remote handle so vLLM neither reads nor notifies the decode node."""
    for key in HANDLE_KEYS:
        params.pop(key, None)


def checkpoints_from_params(params: Mapping[str, Any]) -> Checkpoints | None:
    """The prefix hashes a prefill leg carries, or None when absent or malformed."""
    raw, stride = params.get(BLOCK_HASHES_KEY), params.get(HASH_STRIDE_KEY, 1)
    if not isinstance(raw, list) or not isinstance(stride, int) or stride < 1:
        return None
    try:
        return Checkpoints([bytes.fromhex(h) for h in raw], stride)
    except (TypeError, ValueError):
        return None
