import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_ROLE_UNSPECIFIED: _ClassVar[NodeRole]
    NODE_ROLE_PREFILL: _ClassVar[NodeRole]
    NODE_ROLE_DECODE: _ClassVar[NodeRole]
    NODE_ROLE_BOTH: _ClassVar[NodeRole]

class KvRetention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_RETENTION_UNSPECIFIED: _ClassVar[KvRetention]
    KV_RETENTION_ON: _ClassVar[KvRetention]
    KV_RETENTION_OFF: _ClassVar[KvRetention]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_READY: _ClassVar[NodeState]
    NODE_STATE_NOT_READY: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_DOWN: _ClassVar[NodeState]

class KvDevice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DEVICE_UNSPECIFIED: _ClassVar[KvDevice]
    KV_DEVICE_CPU: _ClassVar[KvDevice]
    KV_DEVICE_CUDA: _ClassVar[KvDevice]
NODE_ROLE_UNSPECIFIED: NodeRole
NODE_ROLE_PREFILL: NodeRole
NODE_ROLE_DECODE: NodeRole
NODE_ROLE_BOTH: NodeRole
KV_RETENTION_UNSPECIFIED: KvRetention
KV_RETENTION_ON: KvRetention
KV_RETENTION_OFF: KvRetention
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_READY: NodeState
NODE_STATE_NOT_READY: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_DOWN: NodeState
KV_DEVICE_UNSPECIFIED: KvDevice
KV_DEVICE_CPU: KvDevice
KV_DEVICE_CUDA: KvDevice

class NodeLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_cache_usage")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ...) -> None: ...

class CostProfile(_message.Message):
    __slots__ = ("prefill_fixed_ms", "prefill_us_per_token", "prefill_ns_per_token_context", "read_fixed_ms", "read_us_per_block", "calibrated_time", "read_us_per_run")
    PREFILL_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_US_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_PER_TOKEN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    READ_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    READ_US_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_TIME_FIELD_NUMBER: _ClassVar[int]
    READ_US_PER_RUN_FIELD_NUMBER: _ClassVar[int]
    prefill_fixed_ms: float
    prefill_us_per_token: float
    prefill_ns_per_token_context: float
    read_fixed_ms: float
    read_us_per_block: float
    calibrated_time: _timestamp_pb2.Timestamp
    read_us_per_run: float
    def __init__(self, prefill_fixed_ms: _Optional[float] = ..., prefill_us_per_token: _Optional[float] = ..., prefill_ns_per_token_context: _Optional[float] = ..., read_fixed_ms: _Optional[float] = ..., read_us_per_block: _Optional[float] = ..., calibrated_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., read_us_per_run: _Optional[float] = ...) -> None: ...

class EngineWork(_message.Message):
    __slots__ = ("prefills", "prefill_computed_tokens", "prefill_cached_tokens", "prefill_seconds", "reads", "read_blocks", "read_seconds")
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    READ_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prefills: int
    prefill_computed_tokens: int
    prefill_cached_tokens: int
    prefill_seconds: float
    reads: int
    read_blocks: float
    read_seconds: float
    def __init__(self, prefills: _Optional[int] = ..., prefill_computed_tokens: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., reads: _Optional[int] = ..., read_blocks: _Optional[float] = ..., read_seconds: _Optional[float] = ...) -> None: ...

class CostCorrection(_message.Message):
    __slots__ = ("prefill", "read", "prefill_samples", "read_samples")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    prefill: float
    read: float
    prefill_samples: int
    read_samples: int
    def __init__(self, prefill: _Optional[float] = ..., read: _Optional[float] = ..., prefill_samples: _Optional[int] = ..., read_samples: _Optional[int] = ...) -> None: ...

class NodeSpec(_message.Message):
    __slots__ = ("node_id", "role", "engine_id", "side_channel_host", "side_channel_port", "http_base_url", "model", "block_size", "capacity_blocks", "bytes_per_block", "incarnation", "retention_budget_blocks", "retention_hard_cap", "prefix_caching", "kv_retention", "vllm_version", "nixl_connector_version", "registration_generation", "gateway_endpoint", "dynamo_worker_id", "kubernetes_pod", "kv_device")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_HOST_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_PORT_FIELD_NUMBER: _ClassVar[int]
    HTTP_BASE_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BUDGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_HARD_CAP_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    KV_RETENTION_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    NIXL_CONNECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_GENERATION_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DYNAMO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KUBERNETES_POD_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: NodeRole
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    http_base_url: str
    model: str
    block_size: int
    capacity_blocks: int
    bytes_per_block: int
    incarnation: str
    retention_budget_blocks: int
    retention_hard_cap: _duration_pb2.Duration
    prefix_caching: bool
    kv_retention: KvRetention
    vllm_version: str
    nixl_connector_version: int
    registration_generation: int
    gateway_endpoint: str
    dynamo_worker_id: str
    kubernetes_pod: str
    kv_device: KvDevice
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[NodeRole, str]] = ..., engine_id: _Optional[str] = ..., side_channel_host: _Optional[str] = ..., side_channel_port: _Optional[int] = ..., http_base_url: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., incarnation: _Optional[str] = ..., retention_budget_blocks: _Optional[int] = ..., retention_hard_cap: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., prefix_caching: _Optional[bool] = ..., kv_retention: _Optional[_Union[KvRetention, str]] = ..., vllm_version: _Optional[str] = ..., nixl_connector_version: _Optional[int] = ..., registration_generation: _Optional[int] = ..., gateway_endpoint: _Optional[str] = ..., dynamo_worker_id: _Optional[str] = ..., kubernetes_pod: _Optional[str] = ..., kv_device: _Optional[_Union[KvDevice, str]] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("spec", "state", "load", "registered_time", "last_heartbeat_time", "live_leases", "retained_blocks", "cost", "drained", "cost_correction")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    COST_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    spec: NodeSpec
    state: NodeState
    load: NodeLoad
    registered_time: _timestamp_pb2.Timestamp
    last_heartbeat_time: _timestamp_pb2.Timestamp
    live_leases: int
    retained_blocks: int
    cost: CostProfile
    drained: bool
    cost_correction: CostCorrection
    def __init__(self, spec: _Optional[_Union[NodeSpec, _Mapping]] = ..., state: _Optional[_Union[NodeState, str]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., registered_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_heartbeat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., live_leases: _Optional[int] = ..., retained_blocks: _Optional[int] = ..., cost: _Optional[_Union[CostProfile, _Mapping]] = ..., drained: _Optional[bool] = ..., cost_correction: _Optional[_Union[CostCorrection, _Mapping]] = ...) -> None: ...
