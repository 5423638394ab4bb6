import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATE_UNSPECIFIED: _ClassVar[LeaseState]
    LEASE_STATE_ACTIVE: _ClassVar[LeaseState]
    LEASE_STATE_CLAIMED: _ClassVar[LeaseState]
    LEASE_STATE_RELEASED: _ClassVar[LeaseState]
    LEASE_STATE_EXPIRED: _ClassVar[LeaseState]
    LEASE_STATE_REVOKED: _ClassVar[LeaseState]

class LeaseEndCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_END_CAUSE_UNSPECIFIED: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_READ: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_PRESSURE: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_BUDGET: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_IDLE: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_SUPERSEDED: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_REVOKED: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_NODE_LOST: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_ENGINE: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_FENCED: _ClassVar[LeaseEndCause]
    LEASE_END_CAUSE_DRAINED: _ClassVar[LeaseEndCause]
LEASE_STATE_UNSPECIFIED: LeaseState
LEASE_STATE_ACTIVE: LeaseState
LEASE_STATE_CLAIMED: LeaseState
LEASE_STATE_RELEASED: LeaseState
LEASE_STATE_EXPIRED: LeaseState
LEASE_STATE_REVOKED: LeaseState
LEASE_END_CAUSE_UNSPECIFIED: LeaseEndCause
LEASE_END_CAUSE_READ: LeaseEndCause
LEASE_END_CAUSE_PRESSURE: LeaseEndCause
LEASE_END_CAUSE_BUDGET: LeaseEndCause
LEASE_END_CAUSE_IDLE: LeaseEndCause
LEASE_END_CAUSE_SUPERSEDED: LeaseEndCause
LEASE_END_CAUSE_REVOKED: LeaseEndCause
LEASE_END_CAUSE_NODE_LOST: LeaseEndCause
LEASE_END_CAUSE_ENGINE: LeaseEndCause
LEASE_END_CAUSE_FENCED: LeaseEndCause
LEASE_END_CAUSE_DRAINED: LeaseEndCause

class BlockIdGroup(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("remote_engine_id", "remote_request_id", "remote_block_groups", "remote_host", "remote_port", "remote_num_tokens", "tp_size", "dcp_size", "pp_size", "remote_registration_generation")
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REGISTRATION_GENERATION_FIELD_NUMBER: _ClassVar[int]
    remote_engine_id: str
    remote_request_id: str
    remote_block_groups: _containers.RepeatedCompositeFieldContainer[BlockIdGroup]
    remote_host: str
    remote_port: int
    remote_num_tokens: int
    tp_size: int
    dcp_size: int
    pp_size: int
    remote_registration_generation: int
    def __init__(self, remote_engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_block_groups: _Optional[_Iterable[_Union[BlockIdGroup, _Mapping]]] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., remote_num_tokens: _Optional[int] = ..., tp_size: _Optional[int] = ..., dcp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., remote_registration_generation: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "conversation_id", "node_id", "node_incarnation", "epoch", "handle", "block_hashes", "token_count", "state", "end_reason", "grant_time", "renew_time", "expire_time", "time_to_live", "end_time", "claim_expire_time", "end_cause", "block_hash_stride", "pin_time_to_live")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    GRANT_TIME_FIELD_NUMBER: _ClassVar[int]
    RENEW_TIME_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LIVE_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    CLAIM_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    END_CAUSE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PIN_TIME_TO_LIVE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    conversation_id: str
    node_id: str
    node_incarnation: str
    epoch: int
    handle: KvHandle
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_count: int
    state: LeaseState
    end_reason: str
    grant_time: _timestamp_pb2.Timestamp
    renew_time: _timestamp_pb2.Timestamp
    expire_time: _timestamp_pb2.Timestamp
    time_to_live: _duration_pb2.Duration
    end_time: _timestamp_pb2.Timestamp
    claim_expire_time: _timestamp_pb2.Timestamp
    end_cause: LeaseEndCause
    block_hash_stride: int
    pin_time_to_live: _duration_pb2.Duration
    def __init__(self, lease_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., node_id: _Optional[str] = ..., node_incarnation: _Optional[str] = ..., epoch: _Optional[int] = ..., handle: _Optional[_Union[KvHandle, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_count: _Optional[int] = ..., state: _Optional[_Union[LeaseState, str]] = ..., end_reason: _Optional[str] = ..., grant_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., renew_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., time_to_live: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., claim_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_cause: _Optional[_Union[LeaseEndCause, str]] = ..., block_hash_stride: _Optional[int] = ..., pin_time_to_live: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("conversation_id", "epoch", "lease_id", "decode_node_id", "last_active_time")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_TIME_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    epoch: int
    lease_id: str
    decode_node_id: str
    last_active_time: _timestamp_pb2.Timestamp
    def __init__(self, conversation_id: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_id: _Optional[str] = ..., decode_node_id: _Optional[str] = ..., last_active_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
