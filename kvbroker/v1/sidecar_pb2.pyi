import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from kvbroker.v1 import node_pb2 as _node_pb2
from kvbroker.v1 import registry_pb2 as _registry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "side_channel_host", "side_channel_port", "block_size", "capacity_blocks", "bytes_per_block", "model", "retention_budget_blocks", "retention_hard_cap", "kv_retention", "vllm_version", "nixl_connector_version", "registration_generation", "kv_device")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_HOST_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_PORT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BUDGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_HARD_CAP_FIELD_NUMBER: _ClassVar[int]
    KV_RETENTION_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    NIXL_CONNECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_GENERATION_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    block_size: int
    capacity_blocks: int
    bytes_per_block: int
    model: str
    retention_budget_blocks: int
    retention_hard_cap: _duration_pb2.Duration
    kv_retention: _node_pb2.KvRetention
    vllm_version: str
    nixl_connector_version: int
    registration_generation: int
    kv_device: _node_pb2.KvDevice
    def __init__(self, engine_id: _Optional[str] = ..., side_channel_host: _Optional[str] = ..., side_channel_port: _Optional[int] = ..., block_size: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., model: _Optional[str] = ..., retention_budget_blocks: _Optional[int] = ..., retention_hard_cap: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kv_retention: _Optional[_Union[_node_pb2.KvRetention, str]] = ..., vllm_version: _Optional[str] = ..., nixl_connector_version: _Optional[int] = ..., registration_generation: _Optional[int] = ..., kv_device: _Optional[_Union[_node_pb2.KvDevice, str]] = ...) -> None: ...

class AttachEngineRequest(_message.Message):
    __slots__ = ("engine", "retained")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    engine: EngineInfo
    retained: _containers.RepeatedCompositeFieldContainer[_registry_pb2.RetainedBlocks]
    def __init__(self, engine: _Optional[_Union[EngineInfo, _Mapping]] = ..., retained: _Optional[_Iterable[_Union[_registry_pb2.RetainedBlocks, _Mapping]]] = ...) -> None: ...

class AttachEngineResponse(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class SubmitRetentionEventsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_registry_pb2.RetentionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[_registry_pb2.RetentionEvent, _Mapping]]] = ...) -> None: ...

class SubmitRetentionEventsResponse(_message.Message):
    __slots__ = ("queue_depth",)
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    def __init__(self, queue_depth: _Optional[int] = ...) -> None: ...

class WatchDeadlinesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchDeadlinesResponse(_message.Message):
    __slots__ = ("command",)
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    command: _registry_pb2.LeaseCommand
    def __init__(self, command: _Optional[_Union[_registry_pb2.LeaseCommand, _Mapping]] = ...) -> None: ...

class CheckLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class CheckLeaseResponse(_message.Message):
    __slots__ = ("usable", "reason", "shared")
    USABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    usable: bool
    reason: str
    shared: bool
    def __init__(self, usable: _Optional[bool] = ..., reason: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class ResolveHandleRequest(_message.Message):
    __slots__ = ("conversation_id", "prompt_tokens", "path")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    prompt_tokens: int
    path: _registry_pb2.TurnPath
    def __init__(self, conversation_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., path: _Optional[_Union[_registry_pb2.TurnPath, str]] = ...) -> None: ...

class ResolveHandleResponse(_message.Message):
    __slots__ = ("hint",)
    HINT_FIELD_NUMBER: _ClassVar[int]
    hint: _registry_pb2.RoutingHint
    def __init__(self, hint: _Optional[_Union[_registry_pb2.RoutingHint, _Mapping]] = ...) -> None: ...

class ResolvePrefixRequest(_message.Message):
    __slots__ = ("conversation_id", "block_size", "probe_hashes")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROBE_HASHES_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    block_size: int
    probe_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, conversation_id: _Optional[str] = ..., block_size: _Optional[int] = ..., probe_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ResolvePrefixResponse(_message.Message):
    __slots__ = ("match",)
    MATCH_FIELD_NUMBER: _ClassVar[int]
    match: _registry_pb2.MatchPrefixResponse
    def __init__(self, match: _Optional[_Union[_registry_pb2.MatchPrefixResponse, _Mapping]] = ...) -> None: ...

class EndPinRequest(_message.Message):
    __slots__ = ("lease_id", "pin_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    pin_id: str
    def __init__(self, lease_id: _Optional[str] = ..., pin_id: _Optional[str] = ...) -> None: ...

class EndPinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
