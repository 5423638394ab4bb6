import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvbroker.v1 import lease_pb2 as _lease_pb2
from kvbroker.v1 import node_pb2 as _node_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NotRetainedReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOT_RETAINED_REASON_UNSPECIFIED: _ClassVar[NotRetainedReason]
    NOT_RETAINED_REASON_RETENTION_OFF: _ClassVar[NotRetainedReason]
    NOT_RETAINED_REASON_ABORTED: _ClassVar[NotRetainedReason]
    NOT_RETAINED_REASON_FAILED: _ClassVar[NotRetainedReason]
    NOT_RETAINED_REASON_DECLINED: _ClassVar[NotRetainedReason]

class HintDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HINT_DECISION_UNSPECIFIED: _ClassVar[HintDecision]
    HINT_DECISION_REUSE: _ClassVar[HintDecision]
    HINT_DECISION_RECOMPUTE: _ClassVar[HintDecision]
    HINT_DECISION_MISS: _ClassVar[HintDecision]

class HintConsistency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HINT_CONSISTENCY_UNSPECIFIED: _ClassVar[HintConsistency]
    HINT_CONSISTENCY_EXACT: _ClassVar[HintConsistency]
    HINT_CONSISTENCY_DEGRADED: _ClassVar[HintConsistency]

class TurnPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_PATH_UNSPECIFIED: _ClassVar[TurnPath]
    TURN_PATH_READ: _ClassVar[TurnPath]
    TURN_PATH_RECOMPUTE: _ClassVar[TurnPath]
    TURN_PATH_DECODE_LOCAL: _ClassVar[TurnPath]

class NoReuseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NO_REUSE_REASON_UNSPECIFIED: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_NO_CONVERSATION: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_NOTHING_RETAINED: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_LEASE_NOT_LIVE: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_HOLDER_UNAVAILABLE: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_RECOMPUTE_FASTER: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_VERSION_MISMATCH: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_NOT_HOLDER: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_NO_LEADER: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_NO_PREFIX_MATCH: _ClassVar[NoReuseReason]
    NO_REUSE_REASON_OWN_CONVERSATION: _ClassVar[NoReuseReason]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_NODE_NOT_REGISTERED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_CONVERSATION_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_NO_LIVE_LEASE: _ClassVar[ErrorReason]
    ERROR_REASON_SESSION_LOST: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_ENDED: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_A_DECODE_NODE: _ClassVar[ErrorReason]
    ERROR_REASON_NODE_DOWN: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_HOLDER: _ClassVar[ErrorReason]
    ERROR_REASON_NO_READY_NODE: _ClassVar[ErrorReason]
    ERROR_REASON_NO_LEADER: _ClassVar[ErrorReason]
    ERROR_REASON_STORE_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_BATCH_FULL: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    ERROR_REASON_PERMISSION_DENIED: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_ROUTED_HERE: _ClassVar[ErrorReason]
    ERROR_REASON_NODE_IN_USE: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_A_PREFILL_NODE: _ClassVar[ErrorReason]

class HintRecordKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HINT_RECORD_KIND_UNSPECIFIED: _ClassVar[HintRecordKind]
    HINT_RECORD_KIND_NODE: _ClassVar[HintRecordKind]
    HINT_RECORD_KIND_CONVERSATION: _ClassVar[HintRecordKind]
    HINT_RECORD_KIND_LEASE: _ClassVar[HintRecordKind]
NOT_RETAINED_REASON_UNSPECIFIED: NotRetainedReason
NOT_RETAINED_REASON_RETENTION_OFF: NotRetainedReason
NOT_RETAINED_REASON_ABORTED: NotRetainedReason
NOT_RETAINED_REASON_FAILED: NotRetainedReason
NOT_RETAINED_REASON_DECLINED: NotRetainedReason
HINT_DECISION_UNSPECIFIED: HintDecision
HINT_DECISION_REUSE: HintDecision
HINT_DECISION_RECOMPUTE: HintDecision
HINT_DECISION_MISS: HintDecision
HINT_CONSISTENCY_UNSPECIFIED: HintConsistency
HINT_CONSISTENCY_EXACT: HintConsistency
HINT_CONSISTENCY_DEGRADED: HintConsistency
TURN_PATH_UNSPECIFIED: TurnPath
TURN_PATH_READ: TurnPath
TURN_PATH_RECOMPUTE: TurnPath
TURN_PATH_DECODE_LOCAL: TurnPath
NO_REUSE_REASON_UNSPECIFIED: NoReuseReason
NO_REUSE_REASON_NO_CONVERSATION: NoReuseReason
NO_REUSE_REASON_NOTHING_RETAINED: NoReuseReason
NO_REUSE_REASON_LEASE_NOT_LIVE: NoReuseReason
NO_REUSE_REASON_HOLDER_UNAVAILABLE: NoReuseReason
NO_REUSE_REASON_RECOMPUTE_FASTER: NoReuseReason
NO_REUSE_REASON_VERSION_MISMATCH: NoReuseReason
NO_REUSE_REASON_NOT_HOLDER: NoReuseReason
NO_REUSE_REASON_NO_LEADER: NoReuseReason
NO_REUSE_REASON_NO_PREFIX_MATCH: NoReuseReason
NO_REUSE_REASON_OWN_CONVERSATION: NoReuseReason
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_NODE_NOT_REGISTERED: ErrorReason
ERROR_REASON_LEASE_NOT_FOUND: ErrorReason
ERROR_REASON_CONVERSATION_NOT_FOUND: ErrorReason
ERROR_REASON_NO_LIVE_LEASE: ErrorReason
ERROR_REASON_SESSION_LOST: ErrorReason
ERROR_REASON_LEASE_ENDED: ErrorReason
ERROR_REASON_NOT_A_DECODE_NODE: ErrorReason
ERROR_REASON_NODE_DOWN: ErrorReason
ERROR_REASON_NOT_HOLDER: ErrorReason
ERROR_REASON_NO_READY_NODE: ErrorReason
ERROR_REASON_NO_LEADER: ErrorReason
ERROR_REASON_STORE_UNAVAILABLE: ErrorReason
ERROR_REASON_BATCH_FULL: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
ERROR_REASON_PERMISSION_DENIED: ErrorReason
ERROR_REASON_NOT_ROUTED_HERE: ErrorReason
ERROR_REASON_NODE_IN_USE: ErrorReason
ERROR_REASON_NOT_A_PREFILL_NODE: ErrorReason
HINT_RECORD_KIND_UNSPECIFIED: HintRecordKind
HINT_RECORD_KIND_NODE: HintRecordKind
HINT_RECORD_KIND_CONVERSATION: HintRecordKind
HINT_RECORD_KIND_LEASE: HintRecordKind

class EndReadPinRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "pin_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    pin_id: str
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., pin_id: _Optional[str] = ...) -> None: ...

class EndReadPinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("node_id", "conversation_id", "model", "block_size", "probe_hashes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROBE_HASHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    conversation_id: str
    model: str
    block_size: int
    probe_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, node_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., probe_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("lease", "matched_blocks", "no_reuse", "reason", "pin_id")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NO_REUSE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    lease: _lease_pb2.Lease
    matched_blocks: int
    no_reuse: NoReuseReason
    reason: str
    pin_id: str
    def __init__(self, lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ..., matched_blocks: _Optional[int] = ..., no_reuse: _Optional[_Union[NoReuseReason, str]] = ..., reason: _Optional[str] = ..., pin_id: _Optional[str] = ...) -> None: ...

class SetCostProfileRequest(_message.Message):
    __slots__ = ("node_id", "cost")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cost: _node_pb2.CostProfile
    def __init__(self, node_id: _Optional[str] = ..., cost: _Optional[_Union[_node_pb2.CostProfile, _Mapping]] = ...) -> None: ...

class SetCostProfileResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: _node_pb2.Node
    def __init__(self, node: _Optional[_Union[_node_pb2.Node, _Mapping]] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _node_pb2.NodeSpec
    def __init__(self, spec: _Optional[_Union[_node_pb2.NodeSpec, _Mapping]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node", "heartbeat_interval", "session_ttl")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_FIELD_NUMBER: _ClassVar[int]
    node: _node_pb2.Node
    heartbeat_interval: _duration_pb2.Duration
    session_ttl: _duration_pb2.Duration
    def __init__(self, node: _Optional[_Union[_node_pb2.Node, _Mapping]] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., session_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "engine_ready", "load", "work")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_READY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    engine_ready: bool
    load: _node_pb2.NodeLoad
    work: _node_pb2.EngineWork
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., engine_ready: _Optional[bool] = ..., load: _Optional[_Union[_node_pb2.NodeLoad, _Mapping]] = ..., work: _Optional[_Union[_node_pb2.EngineWork, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: _node_pb2.Node
    def __init__(self, node: _Optional[_Union[_node_pb2.Node, _Mapping]] = ...) -> None: ...

class DeregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class DeregisterNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: _node_pb2.Node
    def __init__(self, node: _Optional[_Union[_node_pb2.Node, _Mapping]] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class GetNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: _node_pb2.Node
    def __init__(self, node: _Optional[_Union[_node_pb2.Node, _Mapping]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("role", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: _node_pb2.NodeRole
    model: str
    def __init__(self, role: _Optional[_Union[_node_pb2.NodeRole, str]] = ..., model: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_node_pb2.Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_node_pb2.Node, _Mapping]]] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: _node_pb2.Node
    def __init__(self, node: _Optional[_Union[_node_pb2.Node, _Mapping]] = ...) -> None: ...

class GrantLeaseRequest(_message.Message):
    __slots__ = ("conversation_id", "node_id", "node_incarnation", "handle", "block_hashes", "token_count", "time_to_live", "block_hash_stride")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LIVE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_STRIDE_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    node_id: str
    node_incarnation: str
    handle: _lease_pb2.KvHandle
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_count: int
    time_to_live: _duration_pb2.Duration
    block_hash_stride: int
    def __init__(self, conversation_id: _Optional[str] = ..., node_id: _Optional[str] = ..., node_incarnation: _Optional[str] = ..., handle: _Optional[_Union[_lease_pb2.KvHandle, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_count: _Optional[int] = ..., time_to_live: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., block_hash_stride: _Optional[int] = ...) -> None: ...

class GrantLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _lease_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "conversation_id", "time_to_live")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LIVE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    conversation_id: str
    time_to_live: _duration_pb2.Duration
    def __init__(self, lease_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., time_to_live: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _lease_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "node_id", "node_incarnation", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    node_id: str
    node_incarnation: str
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., node_id: _Optional[str] = ..., node_incarnation: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _lease_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class RevokeLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "conversation_id", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    conversation_id: str
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RevokeLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _lease_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class GetLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class GetLeaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _lease_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("node_id", "conversation_id", "states", "page_size", "page_token")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    conversation_id: str
    states: _containers.RepeatedScalarFieldContainer[_lease_pb2.LeaseState]
    page_size: int
    page_token: str
    def __init__(self, node_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., states: _Optional[_Iterable[_Union[_lease_pb2.LeaseState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases", "next_page_token")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[_lease_pb2.Lease]
    next_page_token: str
    def __init__(self, leases: _Optional[_Iterable[_Union[_lease_pb2.Lease, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RetainedBlocks(_message.Message):
    __slots__ = ("conversation_id", "handle", "block_hashes", "token_count", "lease_id", "epoch", "time_to_live", "block_hash_stride")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LIVE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_STRIDE_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    handle: _lease_pb2.KvHandle
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_count: int
    lease_id: str
    epoch: int
    time_to_live: _duration_pb2.Duration
    block_hash_stride: int
    def __init__(self, conversation_id: _Optional[str] = ..., handle: _Optional[_Union[_lease_pb2.KvHandle, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_count: _Optional[int] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., time_to_live: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., block_hash_stride: _Optional[int] = ...) -> None: ...

class ReleasedBlocks(_message.Message):
    __slots__ = ("remote_request_id", "reason", "cause")
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    remote_request_id: str
    reason: str
    cause: _lease_pb2.LeaseEndCause
    def __init__(self, remote_request_id: _Optional[str] = ..., reason: _Optional[str] = ..., cause: _Optional[_Union[_lease_pb2.LeaseEndCause, str]] = ...) -> None: ...

class TurnNotRetained(_message.Message):
    __slots__ = ("conversation_id", "reason")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    reason: NotRetainedReason
    def __init__(self, conversation_id: _Optional[str] = ..., reason: _Optional[_Union[NotRetainedReason, str]] = ...) -> None: ...

class ReclaimRequest(_message.Message):
    __slots__ = ("remote_request_id", "cause")
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    remote_request_id: str
    cause: _lease_pb2.LeaseEndCause
    def __init__(self, remote_request_id: _Optional[str] = ..., cause: _Optional[_Union[_lease_pb2.LeaseEndCause, str]] = ...) -> None: ...

class RetentionEvent(_message.Message):
    __slots__ = ("sequence", "retained", "released", "reclaim", "not_retained")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    NOT_RETAINED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    retained: RetainedBlocks
    released: ReleasedBlocks
    reclaim: ReclaimRequest
    not_retained: TurnNotRetained
    def __init__(self, sequence: _Optional[int] = ..., retained: _Optional[_Union[RetainedBlocks, _Mapping]] = ..., released: _Optional[_Union[ReleasedBlocks, _Mapping]] = ..., reclaim: _Optional[_Union[ReclaimRequest, _Mapping]] = ..., not_retained: _Optional[_Union[TurnNotRetained, _Mapping]] = ...) -> None: ...

class ReportRetentionRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "events", "full_snapshot")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FULL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    events: _containers.RepeatedCompositeFieldContainer[RetentionEvent]
    full_snapshot: bool
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., events: _Optional[_Iterable[_Union[RetentionEvent, _Mapping]]] = ..., full_snapshot: _Optional[bool] = ...) -> None: ...

class ReportRetentionResponse(_message.Message):
    __slots__ = ("applied_sequence", "leases", "refused")
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    applied_sequence: int
    leases: _containers.RepeatedCompositeFieldContainer[_lease_pb2.Lease]
    refused: _containers.RepeatedCompositeFieldContainer[RefusedEvent]
    def __init__(self, applied_sequence: _Optional[int] = ..., leases: _Optional[_Iterable[_Union[_lease_pb2.Lease, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[RefusedEvent, _Mapping]]] = ...) -> None: ...

class RefusedEvent(_message.Message):
    __slots__ = ("sequence", "error")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    error: HintError
    def __init__(self, sequence: _Optional[int] = ..., error: _Optional[_Union[HintError, _Mapping]] = ...) -> None: ...

class WatchLeaseCommandsRequest(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class LeaseCommand(_message.Message):
    __slots__ = ("lease_id", "remote_request_id", "epoch", "time_to_live", "state", "reason", "cause")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LIVE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    remote_request_id: str
    epoch: int
    time_to_live: _duration_pb2.Duration
    state: _lease_pb2.LeaseState
    reason: str
    cause: _lease_pb2.LeaseEndCause
    def __init__(self, lease_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., time_to_live: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., state: _Optional[_Union[_lease_pb2.LeaseState, str]] = ..., reason: _Optional[str] = ..., cause: _Optional[_Union[_lease_pb2.LeaseEndCause, str]] = ...) -> None: ...

class WatchLeaseCommandsResponse(_message.Message):
    __slots__ = ("command",)
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    command: LeaseCommand
    def __init__(self, command: _Optional[_Union[LeaseCommand, _Mapping]] = ...) -> None: ...

class GetConversationRequest(_message.Message):
    __slots__ = ("conversation_id",)
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    def __init__(self, conversation_id: _Optional[str] = ...) -> None: ...

class GetConversationResponse(_message.Message):
    __slots__ = ("conversation",)
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    conversation: _lease_pb2.Conversation
    def __init__(self, conversation: _Optional[_Union[_lease_pb2.Conversation, _Mapping]] = ...) -> None: ...

class GetRoutingHintRequest(_message.Message):
    __slots__ = ("conversation_id", "model", "dry_run", "prompt_tokens", "new_tokens", "path", "on_node_id")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ON_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    model: str
    dry_run: bool
    prompt_tokens: int
    new_tokens: int
    path: TurnPath
    on_node_id: str
    def __init__(self, conversation_id: _Optional[str] = ..., model: _Optional[str] = ..., dry_run: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., path: _Optional[_Union[TurnPath, str]] = ..., on_node_id: _Optional[str] = ...) -> None: ...

class PathEstimate(_message.Message):
    __slots__ = ("path", "ttft_ms", "not_eligible", "prefill_node_id", "prefill_cached_tokens")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    NOT_ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    path: TurnPath
    ttft_ms: float
    not_eligible: str
    prefill_node_id: str
    prefill_cached_tokens: int
    def __init__(self, path: _Optional[_Union[TurnPath, str]] = ..., ttft_ms: _Optional[float] = ..., not_eligible: _Optional[str] = ..., prefill_node_id: _Optional[str] = ..., prefill_cached_tokens: _Optional[int] = ...) -> None: ...

class RoutingHint(_message.Message):
    __slots__ = ("decision", "reason", "consistency", "prefill", "decode", "lease", "path", "estimates", "no_reuse")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    NO_REUSE_FIELD_NUMBER: _ClassVar[int]
    decision: HintDecision
    reason: str
    consistency: HintConsistency
    prefill: _node_pb2.NodeSpec
    decode: _node_pb2.NodeSpec
    lease: _lease_pb2.Lease
    path: TurnPath
    estimates: _containers.RepeatedCompositeFieldContainer[PathEstimate]
    no_reuse: NoReuseReason
    def __init__(self, decision: _Optional[_Union[HintDecision, str]] = ..., reason: _Optional[str] = ..., consistency: _Optional[_Union[HintConsistency, str]] = ..., prefill: _Optional[_Union[_node_pb2.NodeSpec, _Mapping]] = ..., decode: _Optional[_Union[_node_pb2.NodeSpec, _Mapping]] = ..., lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ..., path: _Optional[_Union[TurnPath, str]] = ..., estimates: _Optional[_Iterable[_Union[PathEstimate, _Mapping]]] = ..., no_reuse: _Optional[_Union[NoReuseReason, str]] = ...) -> None: ...

class GetRoutingHintResponse(_message.Message):
    __slots__ = ("hint",)
    HINT_FIELD_NUMBER: _ClassVar[int]
    hint: RoutingHint
    def __init__(self, hint: _Optional[_Union[RoutingHint, _Mapping]] = ...) -> None: ...

class BatchGetRoutingHintsRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GetRoutingHintRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GetRoutingHintRequest, _Mapping]]] = ...) -> None: ...

class BatchGetRoutingHintsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RoutingHintResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RoutingHintResult, _Mapping]]] = ...) -> None: ...

class RoutingHintResult(_message.Message):
    __slots__ = ("hint", "error")
    HINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    hint: RoutingHint
    error: HintError
    def __init__(self, hint: _Optional[_Union[RoutingHint, _Mapping]] = ..., error: _Optional[_Union[HintError, _Mapping]] = ...) -> None: ...

class HintError(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: ErrorReason
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[_Union[ErrorReason, str]] = ...) -> None: ...

class WatchHintStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HintRecord(_message.Message):
    __slots__ = ("kind", "id", "record")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    kind: HintRecordKind
    id: str
    record: bytes
    def __init__(self, kind: _Optional[_Union[HintRecordKind, str]] = ..., id: _Optional[str] = ..., record: _Optional[bytes] = ...) -> None: ...

class WatchHintStateResponse(_message.Message):
    __slots__ = ("records", "leader_time", "snapshot_complete")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    LEADER_TIME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[HintRecord]
    leader_time: _timestamp_pb2.Timestamp
    snapshot_complete: bool
    def __init__(self, records: _Optional[_Iterable[_Union[HintRecord, _Mapping]]] = ..., leader_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., snapshot_complete: _Optional[bool] = ...) -> None: ...
