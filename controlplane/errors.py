"""Domain errors: one type per reason a call fails, each with the gRPC status it means and a
sentence for a person.

The registry raises these types; the gRPC edge (``service``) turns one into its status with the
reason attached (``hint_error``, ``status_metadata``), and clients turn it back into a typed
error in one function (``kvbroker.common.client.grpc_client.from_grpc_error``). Code decides on the
type or the reason, never on the sentence.
"""

from __future__ import annotations

import grpc

from kvbroker.common.client.grpc_client import ERROR_METADATA_KEY
from kvbroker.v1 import registry_pb2


class RegistryError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: registry_pb2.ErrorReason = registry_pb2.ERROR_REASON_UNSPECIFIED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(RegistryError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = registry_pb2.ERROR_REASON_INVALID_ARGUMENT


class NotFound(RegistryError):
    code = grpc.StatusCode.NOT_FOUND


class NodeNotRegistered(NotFound):
    reason = registry_pb2.ERROR_REASON_NODE_NOT_REGISTERED


class LeaseNotFound(NotFound):
    reason = registry_pb2.ERROR_REASON_LEASE_NOT_FOUND


class ConversationNotFound(NotFound):
    reason = registry_pb2.ERROR_REASON_CONVERSATION_NOT_FOUND


class NoLiveLease(NotFound):
    reason = registry_pb2.ERROR_REASON_NO_LIVE_LEASE


class FailedPrecondition(RegistryError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class SessionLost(FailedPrecondition):
    reason = registry_pb2.ERROR_REASON_SESSION_LOST


class LeaseEnded(FailedPrecondition):
    reason = registry_pb2.ERROR_REASON_LEASE_ENDED


class NotADecodeNode(FailedPrecondition):
    reason = registry_pb2.ERROR_REASON_NOT_A_DECODE_NODE


class NotAPrefillNode(FailedPrecondition):
    reason = registry_pb2.ERROR_REASON_NOT_A_PREFILL_NODE


class NodeDown(FailedPrecondition):
    reason = registry_pb2.ERROR_REASON_NODE_DOWN


class NodeInUse(RegistryError):
    """A live session holds the node id under another incarnation: a second sidecar for one
    node, or a restarted one whose predecessor's session has not ended yet."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = registry_pb2.ERROR_REASON_NODE_IN_USE


class NotHolder(RegistryError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = registry_pb2.ERROR_REASON_NOT_HOLDER


class NotRoutedHere(RegistryError):
    """A node asked to lease a conversation whose turns were routed to another node."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = registry_pb2.ERROR_REASON_NOT_ROUTED_HERE


class Unauthenticated(RegistryError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = registry_pb2.ERROR_REASON_UNAUTHENTICATED


class PermissionDenied(RegistryError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = registry_pb2.ERROR_REASON_PERMISSION_DENIED


class BatchFull(RegistryError):
    """The batch's answer reached its byte budget before this request was looked at."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = registry_pb2.ERROR_REASON_BATCH_FULL


class Unavailable(RegistryError):
    code = grpc.StatusCode.UNAVAILABLE


class NoReadyNode(Unavailable):
    """The registry's own word that no ready node can take the request."""

    reason = registry_pb2.ERROR_REASON_NO_READY_NODE


class NoLeader(Unavailable):
    """No leader can be reached: not the registry's word on the nodes, so a client may route
    on its own."""

    reason = registry_pb2.ERROR_REASON_NO_LEADER


class StoreUnavailable(Unavailable):
    """The durable store refused or could not take a write: this replica's view is now ahead of
    it, so the replica stops serving until it has reloaded."""

    reason = registry_pb2.ERROR_REASON_STORE_UNAVAILABLE


class StoreRefused(InvalidArgument):
    """The durable store refused a record of this call as malformed or too large for one
    write: nothing of the call was written (the registry's view was undone), and the leader
    goes on leading. Distinct from ``StoreUnavailable``, which steps the leader down."""


class CommitUndone(Unavailable):
    """This call's change went to the store in one write with a record it refused, and was
    undone with it: nothing was written, the leader goes on leading; retry."""

    reason = registry_pb2.ERROR_REASON_STORE_UNAVAILABLE


def hint_error(error: RegistryError) -> registry_pb2.HintError:
    """The error as the status record a client reads: one refused hint of a batch, or a failed
    call's trailing metadata."""
    return registry_pb2.HintError(
        code=error.code.value[0], message=error.message, reason=error.reason
    )


def status_metadata(status: registry_pb2.HintError) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that carries ``status`` (and so its reason) with a failed call."""
    return ((ERROR_METADATA_KEY, status.SerializeToString()),)
