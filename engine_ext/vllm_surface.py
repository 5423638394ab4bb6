"""The vLLM (and NIXL) names ``engine_ext.vllm_compat`` and kvbroker's connector rely on, as a
checked list: vLLM gives no stability promise for most of them (private scheduler fields, the
NIXL connector's internals, ``kv_transfer_params`` keys), so a vLLM upgrade that moves one
must fail in a unit test (``tests/test_vllm_surface.py``, also run by ``make compat`` against
every supported release), not in an end-to-end run. When vllm_compat starts relying on a new
name, it is added here.

Each entry names a module, a dotted path in it, and what is expected of it: that it exists,
that a callable accepts the parameters named (in that order, after ``self``/``cls``), that an
instance attribute is assigned or declared by its class, that a dict key appears in the
module's source, or that the module assigns an attribute (``state.vllm_config = ...``).
``since`` marks names a later release added.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvbroker.common.rules import handles


class Kind(Enum):
    EXISTS = "exists"
    CALLABLE = "callable"  # with the parameter names in ``params``
    INSTANCE = "instance attribute"  # set on instances: a field, property or self.<name> = ...
    KEY = "kv_transfer_params key"  # appears in the module's source
    ASSIGNED = "assignment"  # ``<path> = ...`` appears in the module's source


@dataclass(frozen=True)
class Name:
    module: str
    path: str
    kind: Kind = Kind.EXISTS
    params: tuple[str, ...] = ()
    since: str = "0.32"

    def __str__(self) -> str:
        return f"{self.module}:{self.path}"


_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_CONNECTOR = f"{_NIXL}.connector"
_SCHED = f"{_NIXL}.pull_scheduler"
_REQUEST = "vllm.v1.request"
_KV_IFACE = "vllm.v1.kv_cache_interface"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_NIXL_STATS = f"{_NIXL}.stats"
# The parameters of a connector's Prometheus metrics, as vLLM's API server builds them.
_PROM_PARAMS = ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")

# The connector hooks kvbroker's connector overrides and calls ``super()`` on.
_HOOKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("__init__", ("vllm_config", "role", "kv_cache_config")),
    ("get_num_new_matched_tokens", ("request", "num_computed_tokens")),
    ("update_state_after_alloc", ("request", "blocks", "num_external_tokens")),
    ("request_finished", ("request", "block_ids")),
    ("request_finished_all_groups", ("request", "block_ids")),
    ("build_connector_meta", ("scheduler_output",)),
    ("update_connector_output", ("connector_output",)),
    ("register_kv_caches", ("kv_caches",)),
    ("start_load_kv", ("forward_context",)),
    ("shutdown", ()),
    ("bind_kv_cache_manager", ("kv_cache_manager",)),
    ("has_pending_block_frees", ()),
    ("_get_connector_metadata", ()),
)

# vLLM's kv_transfer_params keys that kvbroker.common.rules.handles reads or writes: its
# handle keys, less kvbroker's own and the one vLLM 0.33 added (listed with its release).
_PARAMS_KEYS = (
    "do_remote_decode",
    "do_remote_prefill",
    *(
        key
        for key in handles.HANDLE_KEYS
        if not key.startswith("kvbroker_") and key != handles.REGISTRATION_GENERATION_KEY
    ),
)

SURFACE: tuple[Name, ...] = (
    Name("vllm", "__version__"),
    Name("vllm.envs", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
    Name("vllm.envs", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
    # Configuration read by vllm_compat and engine_info.
    *(
        Name("vllm.config", f"VllmConfig.{field}", Kind.INSTANCE)
        for field in (
            "kv_transfer_config",
            "parallel_config",
            "cache_config",
            "model_config",
            "speculative_config",
            "max_concurrent_batches",
        )
    ),
    *(
        Name("vllm.config", f"ParallelConfig.{field}", Kind.INSTANCE)
        for field in (
            "data_parallel_index",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
        )
    ),
    Name("vllm.config", "CacheConfig.block_size", Kind.INSTANCE),
    Name("vllm.config", "DeviceConfig.device_type", Kind.INSTANCE),
    Name("vllm.config", "ModelConfig.served_model_name", Kind.INSTANCE),
    Name("vllm.config", "KVTransferConfig.kv_connector_extra_config", Kind.INSTANCE),
    Name("vllm.config", "KVTransferConfig.engine_id", Kind.INSTANCE),
    # The connector base and vLLM's NIXL pull connector.
    Name(_BASE, "KVConnectorMetadata"),
    Name(_BASE, "KVConnectorRole.SCHEDULER"),
    Name(_BASE, "KVConnectorRole.WORKER"),
    *(Name(_CONNECTOR, f"NixlPullConnector.{m}", Kind.CALLABLE, p) for m, p in _HOOKS),
    Name(_CONNECTOR, "NixlPullConnector.connector_scheduler", Kind.INSTANCE),
    Name(
        _CONNECTOR,
        "NixlPullConnector.supports_sleep_mode",
        Kind.CALLABLE,
        ("kv_transfer_config",),
        since="0.33",
    ),
    Name(f"{_NIXL}.metadata", "NIXL_CONNECTOR_VERSION"),
    Name(f"{_NIXL}.base_worker", "NixlWrapper"),
    Name("nixl._api", "nixlBind.nixlAgentConfig"),
    # The NIXL scheduler's private state (vllm_compat.track_for_free, free_at, ...).
    Name(_SCHED, "NixlPullConnectorScheduler._reqs_in_batch", Kind.INSTANCE),
    Name(_SCHED, "NixlPullConnectorScheduler._reqs_need_send", Kind.INSTANCE),
    # vllm_compat.pending_read: the READ queued for a request, (request, local ids, ...).
    Name(_SCHED, "NixlPullConnectorScheduler._reqs_need_recv", Kind.INSTANCE),
    # vllm_compat.sort_read_destination: a request's block table, one group.
    Name("vllm.v1.core.kv_cache_manager", "KVCacheManager.coordinator", Kind.INSTANCE),
    Name(
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator.single_type_managers",
        Kind.INSTANCE,
    ),
    Name(
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager.req_to_blocks",
        Kind.INSTANCE,
    ),
    Name(
        _SCHED,
        "NixlPullConnectorScheduler.request_finished",
        Kind.CALLABLE,
        ("request", "block_ids"),
    ),
    # vllm_compat.handshake_generation follows this counter's rule.
    Name(
        _SCHED, "NixlPullConnectorScheduler._registration_generation", Kind.INSTANCE, since="0.33"
    ),
    Name(
        _SCHED,
        "NixlPullConnectorScheduler.set_xfer_handshake_metadata",
        Kind.CALLABLE,
        ("metadata",),
    ),
    *(Name(_NIXL, key, Kind.KEY) for key in _PARAMS_KEYS),
    Name(_NIXL, "_remote_blocks_processed", Kind.KEY),
    Name(_NIXL, handles.REGISTRATION_GENERATION_KEY, Kind.KEY, since="0.33"),
    # The scheduler's cache manager, block pool and outputs.
    Name("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", Kind.CALLABLE),
    Name(
        "vllm.v1.core.block_pool",
        "BlockPool.get_cached_block",
        Kind.CALLABLE,
        ("block_hash", "kv_cache_group_ids"),
    ),
    Name("vllm.v1.core.kv_cache_utils", "KVCacheBlock.ref_cnt", Kind.INSTANCE),
    Name(
        "vllm.v1.core.kv_cache_utils",
        "KVCacheBlockCopy",
        Kind.CALLABLE,
        ("src_block_id", "dst_block_id"),
    ),
    Name("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", Kind.CALLABLE),
    Name("vllm.v1.core.kv_cache_manager", "KVCacheManager.block_pool", Kind.INSTANCE),
    Name("vllm.v1.core.sched.output", "SchedulerOutput.total_num_scheduled_tokens", Kind.INSTANCE),
    Name("vllm.v1.outputs", "KVConnectorOutput.finished_sending", Kind.INSTANCE),
    Name(_KV_IFACE, "FullAttentionSpec"),
    Name(_KV_IFACE, "KVCacheConfig.kv_cache_groups", Kind.INSTANCE),
    Name(_KV_IFACE, "KVCacheConfig.num_blocks", Kind.INSTANCE),
    Name(_KV_IFACE, "KVCacheGroupSpec.kv_cache_spec", Kind.INSTANCE),
    Name(_KV_IFACE, "KVCacheGroupSpec.layer_names", Kind.INSTANCE),
    Name(_KV_IFACE, "KVCacheSpec.page_size_bytes", Kind.INSTANCE),
    Name(
        "vllm.v1.worker.utils",
        "copy_kv_cache_blocks_inplace",
        Kind.CALLABLE,
        ("kv_caches", "num_blocks", "kv_cache_block_copies"),
    ),
    # Requests.
    *(
        Name(_REQUEST, f"Request.{field}", Kind.INSTANCE)
        for field in (
            "request_id",
            "session_id",
            "kv_transfer_params",
            "status",
            "block_hashes",
            "num_tokens",
            "all_token_ids",
            "num_computed_tokens",
            "prompt_embeds",
            "mm_features",
            "lora_request",
            "cache_salt",
        )
    ),
    Name(_REQUEST, "RequestStatus.FINISHED_ABORTED"),
    Name(_REQUEST, "RequestStatus.FINISHED_STOPPED"),
    Name(_REQUEST, "RequestStatus.FINISHED_LENGTH_CAPPED"),
    Name("vllm.lora.request", "LoRARequest.lora_int_id", Kind.INSTANCE),
    # The engine core's loop, found on the call stack (vllm_compat.find_engine_loop).
    Name("vllm.v1.core.sched.scheduler", "Scheduler.get_request_counts", Kind.CALLABLE),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.schedule", Kind.CALLABLE),
    Name("vllm.v1.engine.core", "EngineCoreProc.input_queue", Kind.INSTANCE),
    # ... and whether it was asked to stop (vllm_compat.EngineLoop.stopping).
    Name("vllm.v1.engine.core", "EngineCoreProc.is_running", Kind.CALLABLE),
    # The OpenAI server reads the conversation id from this header into Request.session_id.
    Name("vllm.entrypoints.generate.base.serving", "SESSION_ID_HEADER"),
    # vllm_compat.app_vllm_config: the engine's config on the API server's app state.
    Name("vllm.entrypoints.launchers.api_server.app_state", "state.vllm_config", Kind.ASSIGNED),
    # Connector metrics (engine_ext.connector_metrics): the stats the scheduler takes from the
    # connector, aggregates with the workers' and ships to the API server, and the Prometheus
    # class the API server builds from the connector class; kvbroker's extend NIXL's.
    Name(_CONNECTOR, "NixlPullConnector.get_kv_connector_stats", Kind.CALLABLE),
    Name(_CONNECTOR, "NixlPullConnector.build_kv_connector_stats", Kind.CALLABLE, ("data",)),
    Name(_CONNECTOR, "NixlPullConnector.build_prom_metrics", Kind.CALLABLE, _PROM_PARAMS),
    Name(_METRICS, "KVConnectorStats.data", Kind.INSTANCE),
    Name(_METRICS, "KVConnectorStats.aggregate", Kind.CALLABLE, ("other",)),
    Name(_METRICS, "KVConnectorStats.to_dict", Kind.CALLABLE),
    Name(_METRICS, "KVConnectorPromMetrics.per_engine_labelvalues", Kind.INSTANCE),
    *(
        Name(_METRICS, f"KVConnectorPromMetrics.{field}", Kind.INSTANCE)
        for field in ("_gauge_cls", "_counter_cls", "_histogram_cls")
    ),
    Name(_METRICS, "PromMetric"),
    Name(_METRICS, "PromMetricT"),
    *(
        Name(_NIXL_STATS, f"NixlKVConnectorStats.{method}", Kind.CALLABLE)
        for method in ("reset", "is_empty", "reduce")
    ),
    Name(_NIXL_STATS, "NixlPromMetrics.__init__", Kind.CALLABLE, _PROM_PARAMS),
    Name(
        _NIXL_STATS,
        "NixlPromMetrics.observe",
        Kind.CALLABLE,
        ("transfer_stats_data", "engine_idx"),
    ),
    Name(
        "vllm.v1.metrics.utils",
        "create_metric_per_engine",
        Kind.CALLABLE,
        ("metric", "per_engine_labelvalues"),
    ),
)


def applies(name: Name, series: str) -> bool:
    """Whether ``name`` belongs to the surface of a vLLM release series ("0.33")."""
    return _release(series) >= _release(name.since)


def _release(series: str) -> tuple[int, ...]:
    return tuple(int(part) for part in series.split("."))


def problem(name: Name) -> str | None:
    """What is wrong with ``name`` on the installed vLLM, or None."""
    try:
        module = importlib.import_module(name.module)
    except ImportError as err:
        return f"{name}: module cannot be imported ({err})"
    if name.kind is Kind.KEY:
        return None if _mentions(module, name.path) else f"{name}: key not found in its source"
    if name.kind is Kind.ASSIGNED:
        assigned = re.search(rf"\b{re.escape(name.path)}\s*=[^=]", inspect.getsource(module))
        return None if assigned else f"{name}: not assigned in its source"
    *owners, last = name.path.split(".")
    owner: Any = module
    for part in owners:
        if not hasattr(owner, part):
            return f"{name}: {part!r} is missing"
        owner = getattr(owner, part)
    if name.kind is Kind.INSTANCE:
        return None if _instance_attribute(owner, last) else f"{name}: no instance attribute"
    if not hasattr(owner, last):
        return f"{name}: missing"
    if name.kind is Kind.CALLABLE:
        return _signature_problem(name, getattr(owner, last))
    return None


def _signature_problem(name: Name, target: Any) -> str | None:
    if not callable(target):
        return f"{name}: not callable"
    parameters = inspect.signature(target).parameters.values()
    actual = [
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "cls")
    ]
    return _compare(name, actual)


def _compare(name: Name, actual: list[str]) -> str | None:
    if actual[: len(name.params)] != list(name.params):
        return f"{name}: parameters {actual}, expected {list(name.params)} first"
    return None


def _instance_attribute(cls: Any, attribute: str) -> bool:
    """A field (dataclass, pydantic, msgspec, annotation), a class attribute or property, or a
    ``self.<attribute> =`` in the source of the class or a base."""
    if not isinstance(cls, type):
        return False
    if hasattr(cls, attribute):
        return True
    for klass in cls.__mro__:
        if attribute in getattr(klass, "__annotations__", {}):
            return True
        if attribute in getattr(klass, "__dataclass_fields__", {}):
            return True
        if attribute in getattr(klass, "__struct_fields__", ()):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attribute)}\s*(:[^=]*)?=[^=]", source):
            return True
    return False


def _mentions(package: Any, key: str) -> bool:
    """Whether a module of ``package`` (or the module itself) names ``key`` as a string or
    keyword argument."""
    modules = [package]
    for path in getattr(package, "__path__", []):
        modules += [
            importlib.import_module(f"{package.__name__}.{info.name}")
            for info in pkgutil.iter_modules([path])
        ]
    pattern = re.compile(rf"[\"']{re.escape(key)}[\"']|\b{re.escape(key)}=")
    return any(pattern.search(inspect.getsource(m)) for m in modules)
