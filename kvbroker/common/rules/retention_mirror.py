"""What an engine retains, mirrored on each hop its retention events take: the engine's
``EngineLink`` keeps it to re-attach to a (restarted) sidecar, the sidecar keeps it to replay
to the registry after a reconnect. Either way a lost connection loses nothing: the mirror, not
the queue of events waiting to be sent, is the truth a replay is built from.

The one replay rule: an event is recorded here before it is queued, and gets its position in
the stream; ``replay`` takes the snapshot and supersedes every event recorded so far, so a
sender drops whatever queued event ``superseded`` says the snapshot already carries (a reclaim
among them is dropped too: it is a request, lost like any other while the link is down). Events
recorded after the snapshot are sent after it, whatever order two threads ran in. A duplicate
(an event sent just before a snapshot that carries it again) is harmless: the registry keys
retention by request id.

Stored entries are never changed in place (noting a lease replaces the entry), so a snapshot
may be read on any thread while the engine goes on retaining and releasing.

On both hops the mirror also notes each lease command's deadline and whether it ended the
lease (``note_command``): a replay then says how long the engine still keeps each request's
blocks, and leaves out those whose lease ended (a closed session, a revoke, an expiry) and
which the engine only keeps out its grace. Without that, a registry that lost its state (the
memory store, restarted) would take them back as new, live leases with a fresh TTL: from the
sidecar's replay, or from the engine's snapshot when it re-attaches to a new sidecar.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from kvbroker.common.rules.clock import from_duration, to_duration
from kvbroker.v1 import lease_pb2, registry_pb2

_LIVE = (lease_pb2.LEASE_STATE_ACTIVE, lease_pb2.LEASE_STATE_CLAIMED)


class RetentionMirror:
    """What the engine retains, by request id, with the lease the registry granted for each
    (so a replay restores it exactly: same lease id, same epoch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retained: dict[str, registry_pb2.RetainedBlocks] = {}
        # Request id -> (monotonic deadline, whether its lease is live), from lease commands.
        self._deadlines: dict[str, tuple[float, bool]] = {}
        self._position = 0
        self._replayed = 0

    def record(self, event: registry_pb2.RetentionEvent) -> int | None:
        """Applies an event the engine reports; returns its position, or None when there is
        nothing to send (a release of what is not retained)."""
        with self._lock:
            if event.HasField("retained"):
                self._retained[event.retained.handle.remote_request_id] = event.retained
            elif event.HasField("released"):
                self._deadlines.pop(event.released.remote_request_id, None)
                if self._retained.pop(event.released.remote_request_id, None) is None:
                    return None
            self._position += 1
            return self._position

    def note_lease(self, remote_request_id: str, lease_id: str, epoch: int) -> None:
        """Remembers the lease behind a retained request."""
        with self._lock:
            entry = self._retained.get(remote_request_id)
            if entry is None or (entry.lease_id, entry.epoch) == (lease_id, epoch):
                return
            noted = registry_pb2.RetainedBlocks()
            noted.CopyFrom(entry)
            noted.lease_id = lease_id
            noted.epoch = epoch
            self._retained[remote_request_id] = noted

    def note_command(self, command: registry_pb2.LeaseCommand) -> None:
        """Remembers the deadline a lease command set for its request, and whether the lease
        is still live."""
        with self._lock:
            if command.remote_request_id in self._retained:
                deadline = time.monotonic() + from_duration(command.time_to_live)
                self._deadlines[command.remote_request_id] = (deadline, command.state in _LIVE)

    def forget(self, remote_request_id: str) -> None:
        """Drops a retained request the registry refused: no replay carries it again."""
        with self._lock:
            self._retained.pop(remote_request_id, None)
            self._deadlines.pop(remote_request_id, None)

    def replace(self, retained: Iterable[registry_pb2.RetainedBlocks]) -> None:
        """The engine re-attached: what it retains now is the whole truth."""
        with self._lock:
            self._retained = {blocks.handle.remote_request_id: blocks for blocks in retained}
            self._deadlines.clear()

    def replay(self) -> list[registry_pb2.RetainedBlocks]:
        """Everything retained, as one snapshot that supersedes every event recorded so far."""
        with self._lock:
            self._replayed = self._position
            now = time.monotonic()
            snapshot = []
            for request_id, blocks in self._retained.items():
                deadline, live = self._deadlines.get(request_id, (None, True))
                if not live:
                    continue  # kept only out its grace; its lease ended
                entry = blocks
                if deadline is not None:
                    entry = registry_pb2.RetainedBlocks()
                    entry.CopyFrom(blocks)
                    entry.time_to_live.CopyFrom(to_duration(max(deadline - now, 0.001)))
                snapshot.append(entry)
            return snapshot

    def superseded(self, position: int) -> bool:
        """Whether the last snapshot already carries the event recorded at ``position``."""
        with self._lock:
            return position <= self._replayed

    def __len__(self) -> int:
        with self._lock:
            return len(self._retained)
