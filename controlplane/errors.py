"""Domain errors that carry the gRPC status they mean and a sentence for a person."""

from __future__ import annotations

import grpc

from kvbroker.v1 import registry_pb2


class RegistryError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(RegistryError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RegistryError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RegistryError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(RegistryError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(RegistryError):
    code = grpc.StatusCode.UNAVAILABLE


class StoreUnavailable(Unavailable):
    """The durable store refused or could not take a write: this replica's view is now ahead of
    it, so the replica stops serving until it has reloaded."""


def hint_error(error: RegistryError) -> registry_pb2.HintError:
    """One refused hint of a batch, as the status GetRoutingHint would have failed with."""
    return registry_pb2.HintError(code=error.code.value[0], message=error.message)
