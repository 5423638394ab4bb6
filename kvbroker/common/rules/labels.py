"""Short labels for the proto enums: ``LEASE_STATE_ACTIVE`` is "ACTIVE" in tables, logs,
response headers and metrics, and ``--state active`` on the command line.

buf's STANDARD lint makes every value carry its enum's prefix and names the zero value
``<PREFIX>_UNSPECIFIED``, so the prefix is read off the enum descriptor's zero value instead
of being written out next to each enum (and going stale when one is added or renamed).
"""

from __future__ import annotations

from functools import cache

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

_ZERO_VALUE_SUFFIX = "UNSPECIFIED"


@cache
def _prefix(enum_full_name: str, zero_value_name: str) -> str:
    if not zero_value_name.endswith(f"_{_ZERO_VALUE_SUFFIX}"):
        raise ValueError(f"{enum_full_name}'s zero value {zero_value_name} is not *_UNSPECIFIED")
    return zero_value_name.removesuffix(_ZERO_VALUE_SUFFIX)


def label(enum: EnumTypeWrapper, value: int) -> str:
    """The value's name without the enum's prefix: ``label(LeaseState, 1) == "ACTIVE"``.
    Raises ValueError for a number the enum does not define."""
    descriptor = enum.DESCRIPTOR
    prefix = _prefix(descriptor.full_name, descriptor.values_by_number[0].name)
    return enum.Name(value).removeprefix(prefix)


def by_lower_label(enum: EnumTypeWrapper) -> dict[str, int]:
    """Every value but the zero one, keyed by its lower-case label (``{"active": 1, ...}``),
    in declaration order: the choices of a command-line flag."""
    return {label(enum, value).lower(): value for value in enum.values() if value != 0}
