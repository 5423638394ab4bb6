"""Moved to kvbroker.testing.factories; this name stays only while test modules that other
changes are editing still import it from here."""

from kvbroker.testing.factories import (
    Heartbeats,
    block_hashes,
    grant,
    handle,
    hint,
    node_spec,
    register,
)

__all__ = ["Heartbeats", "block_hashes", "grant", "handle", "hint", "node_spec", "register"]
