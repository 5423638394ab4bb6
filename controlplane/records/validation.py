"""Every check of a request's own content, in one place, with limits from the config.

The registry applies these before it takes its lock, so a refused call changes nothing: no
record, deadline, runtime figure or command. What depends on the registry's state (a session,
a lease's holder, a conversation's epoch) is checked by the part that owns it, still before
that part mutates anything. Each check raises ``InvalidArgument`` with a sentence naming the
field; none lets a value through that a later step (an enum label, an epoch incremented, a
record written to etcd) would fail on.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Sequence
from dataclasses import fields
from urllib.parse import urlsplit

from google.protobuf.duration_pb2 import Duration
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from kvbroker.common.rules import ids
from kvbroker.common.rules.checkpoints import BLOCK_HASH_BYTES
from kvbroker.common.rules.costs import Costs
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.errors import InvalidArgument
from kvbroker.controlplane.records.codec import block_count
from kvbroker.controlplane.records.model import CostProfile, EngineWork, NodeLoad
from kvbroker.controlplane.records.requests import Heartbeat, LeaseGrant, LeaseListing, PrefixProbe
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2

# Epochs and sequences stay far below uint64's end, so incrementing one never overflows.
MAX_COUNTER = (1 << 63) - 1
# What this registry mints (``lease_ids.new_lease_id``): hex milliseconds, then randomness.
LEASE_ID = re.compile(r"[0-9a-f]{21,32}")
MAX_PORT = 65_535
# A lease record's times, numbers and field tags, beyond its ids, reason and retention.
LEASE_RECORD_FIXED_BYTES = 512
# A host name (DNS labels, as Kubernetes and /etc/hosts write them) where an address is not
# given; checked before anyone connects to it, so a node cannot point routers elsewhere.
HOST_NAME = re.compile(
    r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?"
)
MAX_HOST_NAME = 253
URL_SCHEMES = frozenset({"http", "https"})
RECLAIM_CAUSES = frozenset({lease_pb2.LEASE_END_CAUSE_PRESSURE, lease_pb2.LEASE_END_CAUSE_BUDGET})
ROLES = frozenset({node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_DECODE, node_pb2.NODE_ROLE_BOTH})


def _known(enum: EnumTypeWrapper, value: int) -> bool:
    return value in enum.DESCRIPTOR.values_by_number


class Validation:
    def __init__(self, config: RegistryConfig) -> None:
        self._config = config
        # What a lease record holds besides the retention: four ids (lease, conversation,
        # node, incarnation; up to 4 UTF-8 bytes a character) and an end reason.
        self._lease_overhead = (
            16 * config.max_id_length + config.max_text_bytes + LEASE_RECORD_FIXED_BYTES
        )

    # ------------------------------------------------------------ fields

    def id(self, value: str, what: str) -> str:
        """``value`` if it is a usable id."""
        try:
            return ids.check_id(value, what, self._config.max_id_length)
        except ids.InvalidId as error:
            raise InvalidArgument(str(error)) from None

    def optional_id(self, value: str, what: str) -> str:
        return self.id(value, what) if value else value

    def text(self, value: str, what: str) -> str:
        """Free text (a reason, a URL): bounded in bytes, as it is stored."""
        limit = self._config.max_text_bytes
        if 4 * len(value) <= limit:  # fits whatever its characters (a hint's model, 1000 times)
            return value
        size = len(value.encode())
        if size > limit:
            raise InvalidArgument(f"{what} is {size} bytes long; the limit is {limit}")
        return value

    @staticmethod
    def enum(enum: EnumTypeWrapper, value: int, what: str, unspecified: bool = True) -> None:
        """A value the enum defines (``unspecified``: its zero value is allowed too)."""
        if not _known(enum, value) or (value == 0 and not unspecified):
            raise InvalidArgument(f"{what} {value} is not a valid {enum.DESCRIPTOR.name}")

    @staticmethod
    def counter(value: int, what: str) -> None:
        if value > MAX_COUNTER:
            raise InvalidArgument(f"{what} {value} exceeds the limit of {MAX_COUNTER}")

    @staticmethod
    def port(value: int, what: str) -> None:
        if value > MAX_PORT:
            raise InvalidArgument(f"{what} {value} is not a port")

    @staticmethod
    def host(value: str, what: str) -> None:
        """An address or a host name that others will connect to."""
        if not value:
            raise InvalidArgument(f"{what} is required")
        try:
            ipaddress.ip_address(value)
            return
        except ValueError:
            pass
        if len(value) > MAX_HOST_NAME or not HOST_NAME.fullmatch(value):
            raise InvalidArgument(f"{what} {value[:64]!r} is not a host name or an IP address")

    @classmethod
    def endpoint_port(cls, value: int, what: str) -> None:
        """A port others will connect to: in range, and not 0."""
        cls.port(value, what)
        if value == 0:
            raise InvalidArgument(f"{what} is required (1 to {MAX_PORT})")

    @classmethod
    def url(cls, value: str, what: str) -> None:
        """An engine's HTTP base URL, which routers send clients' requests to: http or https,
        a host, a port in range (or the scheme's own), at most a path after it. Nothing that
        URL parsing would quietly drop or rewrite (whitespace, control characters)."""
        if not value.isprintable() or any(c.isspace() for c in value):
            raise InvalidArgument(f"{what} holds whitespace or unprintable characters")
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError as error:
            raise InvalidArgument(f"{what} {value[:64]!r} is not a URL: {error}") from None
        if parts.scheme not in URL_SCHEMES:
            raise InvalidArgument(f"{what} {value[:64]!r} is not an http:// or https:// URL")
        if parts.username is not None or parts.query or parts.fragment:
            raise InvalidArgument(
                f"{what} {value[:64]!r} may hold a scheme, a host, a port and a path, no more"
            )
        cls.host(parts.hostname or "", f"the host of {what}")
        if port is not None:
            cls.endpoint_port(port, f"the port of {what}")

    @staticmethod
    def duration(value: Duration, what: str) -> float:
        """A non-negative, well-formed duration, in seconds."""
        if value.seconds < 0 or value.nanos < 0 or value.nanos >= 1_000_000_000:
            raise InvalidArgument(f"{what} must be a non-negative duration")
        if value.seconds > 315_576_000_000:  # the Duration type's own range
            raise InvalidArgument(f"{what} is out of range")
        return float(value.ToNanoseconds()) / 1e9

    def ttl(self, requested: float | None) -> None:
        """A lease TTL a caller asks for (None: the registry's own)."""
        if requested is not None and (not math.isfinite(requested) or requested < 0):
            raise InvalidArgument("time_to_live must not be negative")

    def record_bytes(self, size: int, what: str) -> None:
        """Every stored record stays under one write of the store (etcd's request limit)."""
        limit = self._config.max_record_bytes
        if size > limit:
            raise InvalidArgument(
                f"{what} would be a record of about {size} bytes; the limit is {limit}"
            )

    # ------------------------------------------------------------ nodes

    def node_spec(self, spec: node_pb2.NodeSpec) -> None:
        self.id(spec.node_id, "spec.node_id")
        self.id(spec.incarnation, "spec.incarnation")
        if spec.role == node_pb2.NODE_ROLE_UNSPECIFIED:
            raise InvalidArgument("spec.role is required (prefill, decode or both)")
        if spec.role not in ROLES:
            raise InvalidArgument(f"spec.role {spec.role} is not a valid NodeRole")
        if not spec.model:
            raise InvalidArgument("spec.model is required")
        self.text(spec.model, "spec.model")
        self.text(spec.engine_id, "spec.engine_id")
        self.text(spec.http_base_url, "spec.http_base_url")
        self.url(spec.http_base_url, "spec.http_base_url")
        self.host(spec.side_channel_host, "spec.side_channel_host")
        self.endpoint_port(spec.side_channel_port, "spec.side_channel_port")
        if spec.block_size == 0:
            raise InvalidArgument("spec.block_size must be positive")
        self.duration(spec.retention_hard_cap, "spec.retention_hard_cap")
        for name in ("vllm_version", "gateway_endpoint", "dynamo_worker_id", "kubernetes_pod"):
            self.text(getattr(spec, name), f"spec.{name}")

    def session(self, node_id: str, incarnation: str) -> None:
        self.id(node_id, "node_id")
        self.id(incarnation, "incarnation")

    def heartbeat(self, beat: Heartbeat) -> None:
        self.session(beat.node_id, beat.incarnation)
        self.load(beat.load)
        if beat.work is not None:
            self.work(beat.work)

    @staticmethod
    def load(load: NodeLoad) -> None:
        usage = load.kv_cache_usage
        if not math.isfinite(usage) or not 0.0 <= usage <= 1.0:
            raise InvalidArgument(f"load.kv_cache_usage {usage} is not a fraction in [0, 1]")

    @staticmethod
    def work(work: EngineWork) -> None:
        _finite_non_negative(work, "work")

    @staticmethod
    def costs(cost: CostProfile | None) -> None:
        """A measured profile (``codec.cost_of`` says None for one not said when measured)."""
        if cost is None:
            raise InvalidArgument("cost.calibrated_time is required (when it was measured)")
        _finite_non_negative(cost.costs, "cost")

    def list_nodes(self, role: int, model: str) -> None:
        self.enum(node_pb2.NodeRole, role, "role")
        self.text(model, "model")

    # ------------------------------------------------------------ leases

    def handle(self, handle: lease_pb2.KvHandle, what: str) -> int:
        """A KV handle an engine could have made; returns its block count."""
        self.id(handle.remote_request_id, f"{what}.remote_request_id")
        self.text(handle.remote_engine_id, f"{what}.remote_engine_id")
        self.text(handle.remote_host, f"{what}.remote_host")
        self.port(handle.remote_port, f"{what}.remote_port")
        blocks = block_count(handle)
        limit = self._config.max_block_hashes
        if blocks > limit:
            raise InvalidArgument(f"{blocks} block ids exceed the limit of {limit}")
        return blocks

    def retention(
        self, handle: lease_pb2.KvHandle, block_hashes: Sequence[bytes], token_count: int
    ) -> int:
        """Refuses what no engine could have retained; returns the number of blocks (counted
        once: walking a handle's groups costs microseconds, and a replay has 100k)."""
        limit = self._config.max_block_hashes
        if len(block_hashes) > limit:
            raise InvalidArgument(f"{len(block_hashes)} block hashes exceed the limit of {limit}")
        blocks = self.handle(handle, "handle")
        _prefix_hashes(block_hashes, "block hash")
        hash_bytes = (BLOCK_HASH_BYTES + 2) * len(block_hashes)
        if token_count == 0:
            raise InvalidArgument("token_count must be positive")
        self.record_bytes(handle.ByteSize() + hash_bytes + self._lease_overhead, "the lease")
        return blocks

    def grant(self, grant: LeaseGrant) -> int:
        """A grant's content; returns its handle's block count."""
        self.id(grant.conversation_id, "conversation_id")
        self.session(grant.node_id, grant.incarnation)
        self.ttl(grant.ttl)
        return self.retention(grant.handle, grant.block_hashes, grant.token_count)

    def lease_ref(self, lease_id: str, conversation_id: str) -> None:
        """A lease named by id, or a conversation's current one."""
        if conversation_id:
            self.id(conversation_id, "conversation_id")
        else:
            self.id(lease_id, "lease_id")

    def release(self, lease_id: str, node_id: str, incarnation: str, reason: str) -> None:
        self.id(lease_id, "lease_id")
        self.session(node_id, incarnation)
        self.text(reason, "reason")

    def list_leases(self, listing: LeaseListing) -> None:
        self.optional_id(listing.node_id, "node_id")
        self.optional_id(listing.conversation_id, "conversation_id")
        for state in listing.states:
            self.enum(lease_pb2.LeaseState, state, "states", unspecified=False)
        if not 0 <= listing.page_size <= 1000:
            raise InvalidArgument(f"page_size {listing.page_size} is not within [0, 1000]")

    # ------------------------------------------------------------ retention reports

    def event(self, event: registry_pb2.RetentionEvent) -> int:
        """One retention event on its own; returns its block count (0 unless retained)."""
        self.counter(event.sequence, "sequence")
        kind = event.WhichOneof("event")
        if kind == "retained":
            return self.retained(event.retained)
        if kind == "released":
            released = event.released
            self.id(released.remote_request_id, "released.remote_request_id")
            self.text(released.reason, "released.reason")
            self.enum(lease_pb2.LeaseEndCause, released.cause, "released.cause")
            return 0
        if kind == "reclaim":
            self.id(event.reclaim.remote_request_id, "reclaim.remote_request_id")
            if event.reclaim.cause not in RECLAIM_CAUSES:
                raise InvalidArgument("a reclaim's cause must be PRESSURE or BUDGET")
            return 0
        if kind == "not_retained":
            self.id(event.not_retained.conversation_id, "not_retained.conversation_id")
            self.enum(registry_pb2.NotRetainedReason, event.not_retained.reason, "reason")
            return 0
        raise InvalidArgument(
            "the event is neither retained, released, a reclaim nor a turn not retained"
        )

    def retained(self, retained: registry_pb2.RetainedBlocks) -> int:
        self.id(retained.conversation_id, "retained.conversation_id")
        if retained.lease_id and not LEASE_ID.fullmatch(retained.lease_id):
            raise InvalidArgument(
                f"retained.lease_id {retained.lease_id[:64]!r} is not a lease id this "
                "registry grants"
            )
        self.counter(retained.epoch, "retained.epoch")
        if retained.lease_id and retained.epoch == 0:
            raise InvalidArgument("a replayed lease needs its epoch")
        self.duration(retained.time_to_live, "retained.time_to_live")
        return self.retention(retained.handle, retained.block_hashes, retained.token_count)

    # ------------------------------------------------------------ hints

    def hint(self, conversation_id: str, model: str, on_node_id: str = "", path: int = 0) -> None:
        self.optional_id(conversation_id, "conversation_id")
        self.text(model, "model")
        self.optional_id(on_node_id, "on_node_id")
        self.enum(registry_pb2.TurnPath, path, "path")

    def prefix_match(self, probe: PrefixProbe, max_probes: int) -> None:
        self.id(probe.node_id, "node_id")
        self.optional_id(probe.conversation_id, "conversation_id")
        self.text(probe.model, "model")
        if probe.block_size <= 0:
            raise InvalidArgument("block_size is required")
        probes = probe.probes
        if len(probes) > max_probes:
            raise InvalidArgument(f"{len(probes)} probe hashes exceed the limit of {max_probes}")
        _prefix_hashes(probes, "probe hash")


def _prefix_hashes(hashes: Sequence[bytes], what: str) -> None:
    """Every prefix hash is ``BLOCK_HASH_BYTES`` long: what this version's engines compute, and
    what lets a lease keep its hashes end to end (``codec.checkpoints``). An engine of a version
    with other hashes is refused here, not kept: its hashes could never verify against ours."""
    lengths = set(map(len, hashes))  # in C: a replay validates 100k leases of 32 hashes
    lengths.discard(BLOCK_HASH_BYTES)
    if lengths:
        raise InvalidArgument(
            f"a {what} of {min(lengths)} bytes: prefix hashes are {BLOCK_HASH_BYTES} bytes"
            " (an engine of another kvbroker version?)"
        )


def _finite_non_negative(record: EngineWork | Costs, what: str) -> None:
    """Every float of ``record`` (its counts are unsigned on the wire) is finite and >= 0."""
    for field in fields(record):
        value = getattr(record, field.name)
        if isinstance(value, float) and (not math.isfinite(value) or value < 0):
            raise InvalidArgument(f"{what}.{field.name} {value} is not a finite non-negative")
