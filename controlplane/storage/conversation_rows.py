"""The state cache's conversations as rows of columns, not one object and dict entry each.

A registry holds a conversation a lease or so; as a ``Conversation`` in a dict keyed by its
id it cost ~210 bytes (the entry, the id string, the object, its boxed epoch and time). Here
it is a row: its id packed into a slot (``id_rows.IdColumn``), found through a row-number
table by the id's hash, its epoch and last active time in typed ``array``s, its lease id
and decode node id in lists (strings other records hold too). A read builds a new
``Conversation``, as the store hands out copies anyway.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterator

from kvbroker.controlplane.records.model import Conversation
from kvbroker.controlplane.storage.id_rows import IdColumn, RowTable

_NONE = math.nan


class ConversationRows:
    """Conversations by id, each one row of the columns below."""

    def __init__(self) -> None:
        self._rows = RowTable()  # conversation id's hash -> row
        self._free: list[int] = []
        self._id = IdColumn()
        self._lease_id: list[str] = []
        self._node_id: list[str] = []
        self._epoch = array("q")
        self._active = array("d")  # NaN for None

    def __len__(self) -> int:
        return len(self._rows)

    def keys(self) -> Iterator[str]:
        """The conversation ids (with ``[]``, ``dict(rows)`` is a snapshot)."""
        ids = self._id
        return (ids[row] for row in list(self._rows.rows()))

    def __getitem__(self, conversation_id: str) -> Conversation:
        """A new ``Conversation`` from its row (KeyError: none)."""
        conversation = self.get(conversation_id)
        if conversation is None:
            raise KeyError(conversation_id)
        return conversation

    def get(self, conversation_id: str) -> Conversation | None:
        """A new ``Conversation`` from its row (None: none)."""
        row = self._rows.get(hash(conversation_id), self._names(conversation_id))
        return None if row is None else self._conversation(row)

    def values(self) -> Iterator[Conversation]:
        """New ``Conversation``s, of the rows in use when called."""
        return (self._conversation(row) for row in list(self._rows.rows()))

    def put(self, conversation: Conversation) -> None:
        ident = conversation.conversation_id
        key, names = hash(ident), self._names(ident)
        row = self._rows.get(key, names)
        if row is None:
            row = self._new_row(ident)
            self._rows.put(key, row, names)
        self._lease_id[row] = conversation.lease_id
        self._node_id[row] = conversation.decode_node_id
        self._epoch[row] = conversation.epoch
        active = conversation.last_active_time
        self._active[row] = _NONE if active is None else active

    def pop(self, conversation_id: str) -> None:
        row = self._rows.pop(hash(conversation_id), self._names(conversation_id))
        if row is not None:
            self._id[row] = self._lease_id[row] = self._node_id[row] = ""
            self._free.append(row)

    def _names(self, conversation_id: str) -> Callable[[int], bool]:
        """Whether a row is ``conversation_id``'s (hashes may collide)."""
        ids = self._id
        return lambda row: ids[row] == conversation_id

    def _new_row(self, conversation_id: str) -> int:
        if self._free:
            row = self._free.pop()
            self._id[row] = conversation_id
            return row
        self._id.append(conversation_id)
        self._lease_id.append("")
        self._node_id.append("")
        self._epoch.append(0)
        self._active.append(_NONE)
        return len(self._id) - 1

    def _conversation(self, row: int) -> Conversation:
        active = self._active[row]
        return Conversation(
            self._id[row],
            self._epoch[row],
            self._lease_id[row],
            self._node_id[row],
            None if active != active else active,  # noqa: PLR0124 (NaN: None)
        )
