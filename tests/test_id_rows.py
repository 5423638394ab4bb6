"""Packed ids: any string comes back equal, through ``pack``/``unpack`` and through a column
of rows set and reset in any order (slots and the side table of ids that do not pack); the
row-number tables and the conversation rows read back what a plain dict holds."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.controlplane.records.model import Conversation
from kvbroker.controlplane.storage.conversation_rows import ConversationRows
from kvbroker.controlplane.storage.id_rows import SLOT, IdColumn, RowTable, pack, unpack

# any text, plus the shapes that pack: hex uuids (lower and upper case), short text, and
# text just over a slot's width
_ids = st.one_of(
    st.text(),
    st.uuids().map(lambda u: u.hex),
    st.uuids().map(lambda u: u.hex.upper()),
    st.text(max_size=16),
    st.text(min_size=15, max_size=18),
    st.binary(min_size=16, max_size=16).map(bytes.hex),
)


@settings(max_examples=500, deadline=None)
@given(ident=_ids)
def test_any_id_comes_back_equal(ident: str) -> None:
    packed = pack(ident)
    assert unpack(packed) == ident
    if not isinstance(packed, str):
        assert len(packed) == SLOT


def test_hex_and_short_ids_pack_and_others_stay_strings() -> None:
    hex_id = uuid.uuid4().hex
    assert not isinstance(pack(hex_id), str)
    assert not isinstance(pack("conv-123"), str)
    assert not isinstance(pack(""), str)
    assert isinstance(pack(hex_id.upper()), str)  # would come back lower case
    assert isinstance(pack("x" * 17), str)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 7), _ids), max_size=60),
)
def test_a_column_reads_back_what_a_dictionary_holds(steps: list[tuple[int, str]]) -> None:
    column = IdColumn()
    model: dict[int, str] = {}
    for wanted, ident in steps:
        row = min(wanted, len(column))  # past the end: a new row
        if row == len(column):
            column.append(ident)
        else:
            column[row] = ident
        model[row] = ident
        assert len(column) == len(model)
        assert {r: column[r] for r in range(len(column))} == model


def test_a_row_past_the_end_is_an_index_error() -> None:
    column = IdColumn()
    column.append("a")
    for row in (1, -1):
        with pytest.raises(IndexError):
            column[row] = "b"
    assert column[0] == "a"


# (request id, its key): few keys, so that request ids collide
_requests = st.tuples(st.sampled_from([f"req-{i}" for i in range(6)]), st.integers(-3, 3))


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(st.booleans(), _requests, st.integers(0, 50)), max_size=80),
)
def test_a_row_table_reads_back_what_a_dictionary_holds(
    steps: list[tuple[bool, tuple[str, int], int]],
) -> None:
    """Rows by request id (their keys colliding on purpose), through puts, deletes and growth,
    against a dict; a row's request id is what ``same`` compares, as the state cache's is."""
    table = RowTable()
    request_of: dict[int, str] = {}  # row -> its request id
    model: dict[str, int] = {}  # request id -> row
    keys = {request: key for (request, key) in (r for _, r, _ in steps)}

    def asks(request: str) -> Callable[[int], bool]:
        return lambda r: request_of[r] == request

    for add, (request, _), row in steps:
        key = keys[request]
        if add and row not in request_of:
            request_of[row] = request
            table.put(key, row, asks(request))
            model[request] = row
        elif not add:
            popped = table.pop(key, asks(request))
            assert popped == model.pop(request, None)
            if popped is not None:
                del request_of[popped]  # free for reuse, as a deleted lease's row
        assert len(table) == len(model)
        assert sorted(table.rows()) == sorted(model.values())
        for other, wanted in model.items():
            assert table.get(keys[other], asks(other)) == wanted


_conversations = st.builds(
    Conversation,
    conversation_id=st.one_of(st.sampled_from(["", "conv-1", "conv-2"]), _ids),
    epoch=st.integers(0, 2**40),
    lease_id=st.text(max_size=4),
    decode_node_id=st.sampled_from(["", "node-a", "node-b"]),
    last_active_time=st.one_of(st.none(), st.floats(allow_nan=False)),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), _conversations), max_size=60))
def test_conversation_rows_read_back_what_a_dictionary_holds(
    steps: list[tuple[bool, Conversation]],
) -> None:
    """Puts and deletes in any order (rows freed and reused) read back as a dict's."""
    rows = ConversationRows()
    model: dict[str, Conversation] = {}
    for put, conversation in steps:
        ident = conversation.conversation_id
        if put:
            rows.put(conversation.copy())
            model[ident] = conversation
        else:
            rows.pop(ident)
            model.pop(ident, None)
        assert len(rows) == len(model)
        assert rows.get(ident) == model.get(ident)
        assert dict(rows) == model
        assert sorted(rows.values(), key=_ident) == sorted(model.values(), key=_ident)


def _ident(conversation: Conversation) -> str:
    return conversation.conversation_id
