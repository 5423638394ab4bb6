"""What an engine tells its sidecar about itself when the connector links to it.

The sidecar registers the node with the registry from this, but it runs beside vLLM, not in
it: the engine's identity (NIXL engine id, handshake address), its cache geometry and its
retention limits are known only inside the engine process, from vLLM's configuration and the
connector's settings, so the connector gathers them here once and sends them over the link.
Its vLLM and NIXL handshake versions let the registry plan reads only between engines that can
transfer to each other (``docs/vllm-versions.md``).
"""

from __future__ import annotations

from kvbroker.common.rules.clock import to_duration
from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.vllm_compat import (
    NIXL_CONNECTOR_VERSION,
    KVCacheConfig,
    VllmConfig,
)
from kvbroker.v1 import node_pb2, sidecar_pb2


def engine_info(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, budget_blocks: int, hard_cap_s: float
) -> sidecar_pb2.EngineInfo:
    assert vllm_config.kv_transfer_config is not None
    host, port = vllm_compat.side_channel_address(vllm_config)
    return sidecar_pb2.EngineInfo(
        engine_id=str(vllm_config.kv_transfer_config.engine_id),
        side_channel_host=host,
        side_channel_port=port,
        block_size=vllm_config.cache_config.block_size,
        capacity_blocks=kv_cache_config.num_blocks,
        bytes_per_block=vllm_compat.bytes_per_block(kv_cache_config),
        model=vllm_compat.served_model_name(vllm_config),
        retention_budget_blocks=budget_blocks,
        retention_hard_cap=to_duration(hard_cap_s),
        kv_retention=(
            node_pb2.KV_RETENTION_ON
            if vllm_compat.retains_kv(vllm_config)
            else node_pb2.KV_RETENTION_OFF
        ),
        vllm_version=vllm_compat.VLLM_VERSION,
        nixl_connector_version=NIXL_CONNECTOR_VERSION,
        registration_generation=vllm_compat.handshake_generation(vllm_config),
        kv_device=(
            node_pb2.KV_DEVICE_CUDA
            if vllm_compat.kv_on_gpu(vllm_config)
            else node_pb2.KV_DEVICE_CPU
        ),
    )
