"""Enum labels: one rule, read off the descriptors, for every enum the proto package has."""

from __future__ import annotations

import pytest
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from kvbroker.common.rules.labels import by_lower_label, label
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, sidecar_pb2

_ENUMS = [
    EnumTypeWrapper(enum)
    for module in (lease_pb2, node_pb2, registry_pb2, sidecar_pb2)
    for enum in module.DESCRIPTOR.enum_types_by_name.values()
]


def test_labels_drop_the_enum_prefix() -> None:
    assert label(lease_pb2.LeaseState, lease_pb2.LEASE_STATE_ACTIVE) == "ACTIVE"
    assert label(lease_pb2.LeaseEndCause, lease_pb2.LEASE_END_CAUSE_NODE_LOST) == "NODE_LOST"
    assert label(node_pb2.NodeState, node_pb2.NODE_STATE_NOT_READY) == "NOT_READY"
    assert label(registry_pb2.HintDecision, registry_pb2.HINT_DECISION_REUSE) == "REUSE"
    assert label(registry_pb2.HintConsistency, registry_pb2.HINT_CONSISTENCY_EXACT) == "EXACT"


@pytest.mark.parametrize("enum", _ENUMS, ids=lambda enum: enum.DESCRIPTOR.name)
def test_every_value_of_every_enum_has_a_label(enum: EnumTypeWrapper) -> None:
    labels = [label(enum, value) for value in enum.values()]
    assert labels[0] == "UNSPECIFIED"
    assert len(set(labels)) == len(labels)
    for name, text in zip(enum.keys(), labels, strict=True):
        assert name.endswith(f"_{text}") and not text.startswith("_"), (name, text)


def test_choices_are_lower_case_labels_without_the_zero_value() -> None:
    assert by_lower_label(node_pb2.NodeRole) == {
        "prefill": node_pb2.NODE_ROLE_PREFILL,
        "decode": node_pb2.NODE_ROLE_DECODE,
        "both": node_pb2.NODE_ROLE_BOTH,
    }
    assert list(by_lower_label(lease_pb2.LeaseState)) == [
        "active", "claimed", "released", "expired", "revoked"
    ]  # fmt: skip


def test_an_unknown_number_is_refused() -> None:
    with pytest.raises(ValueError, match="99"):
        label(lease_pb2.LeaseState, 99)
