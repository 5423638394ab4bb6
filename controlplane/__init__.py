"""The kvbroker registry: node sessions, conversation leases and routing hints over gRPC."""
