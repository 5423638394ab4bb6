"""The handle round trip through vLLM's ``kv_transfer_params`` (``kvbroker.common.rules.handles``):
what a decode engine's ``request_finished`` returns becomes the lease's KvHandle, and the
lease's handle becomes a prefill leg's params with every key vLLM reads, the registration
generation of vLLM 0.33+ included. Runs without vLLM, and in ``make compat`` beside each
release."""

from __future__ import annotations

from typing import Any

from kvbroker.common.rules import handles
from kvbroker.v1 import lease_pb2


def decode_params(**extra: Any) -> dict[str, Any]:
    """The dict vLLM's NIXL pull scheduler returns for a retained decode request."""
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[4, 5, 6]],
        "remote_engine_id": "engine-d",
        "remote_request_id": "req-1",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 2,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": 123.5,
        "transfer_mode": "pull",
        **extra,
    }


def lease_of(handle: lease_pb2.KvHandle) -> lease_pb2.Lease:
    return lease_pb2.Lease(
        lease_id="lease-1", epoch=3, handle=handle, block_hashes=[b"\x01" * 16], block_hash_stride=1
    )


def test_a_0_33_handle_keeps_its_registration_generation_both_ways() -> None:
    handle = handles.handle_from_params(decode_params(remote_registration_generation=2))
    assert handle.remote_registration_generation == 2
    params = handles.prefill_params(lease_of(handle))
    assert params["remote_registration_generation"] == 2
    assert handles.handle_from_params(params) == handle


def test_a_0_32_handle_has_generation_zero_which_0_32_ignores_and_0_33_reads_as_none() -> None:
    handle = handles.handle_from_params(decode_params())
    assert handle.remote_registration_generation == 0
    params = handles.prefill_params(lease_of(handle))
    assert params["remote_registration_generation"] == 0
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"):
        assert params[key] == decode_params()[key]
    assert params["remote_block_ids"] == [[4, 5, 6]]
    assert params["remote_num_tokens"] == 40 and params["tp_size"] == 2


def test_stripping_a_handle_removes_the_generation_too() -> None:
    params = handles.prefill_params(
        lease_of(handles.handle_from_params(decode_params(remote_registration_generation=1)))
    )
    handles.strip_handle(params)
    assert params == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        handles.DECIDED_KEY: True,
    }
