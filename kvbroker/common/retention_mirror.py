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
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvbroker.v1 import registry_pb2


class RetentionMirror:
    """What the engine retains, by request id, with the lease the registry granted for each
    (so a replay restores it exactly: same lease id, same epoch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retained: dict[str, registry_pb2.RetainedBlocks] = {}
        self._position = 0
        self._replayed = 0

    def record(self, event: registry_pb2.RetentionEvent) -> int | None:
        """Applies an event the engine reports; returns its position, or None when there is
        nothing to send (a release of what is not retained)."""
        with self._lock:
            if event.HasField("retained"):
                self._retained[event.retained.handle.remote_request_id] = event.retained
            elif (
                event.HasField("released")
                and self._retained.pop(event.released.remote_request_id, None) is None
            ):
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

    def forget(self, remote_request_id: str) -> None:
        """Drops a retained request the registry refused: no replay carries it again."""
        with self._lock:
            self._retained.pop(remote_request_id, None)

    def replace(self, retained: Iterable[registry_pb2.RetainedBlocks]) -> None:
        """The engine re-attached: what it retains now is the whole truth."""
        with self._lock:
            self._retained = {blocks.handle.remote_request_id: blocks for blocks in retained}

    def replay(self) -> list[registry_pb2.RetainedBlocks]:
        """Everything retained, as one snapshot that supersedes every event recorded so far."""
        with self._lock:
            self._replayed = self._position
            return list(self._retained.values())

    def superseded(self, position: int) -> bool:
        """Whether the last snapshot already carries the event recorded at ``position``."""
        with self._lock:
            return position <= self._replayed

    def __len__(self) -> int:
        with self._lock:
            return len(self._retained)
