"""Who is calling, and what they may do and see: the registry's trust model in one place.

Every caller is a ``Principal`` with a role. An operator (``admin``) may do anything; so may
another registry replica forwarding a call it received (``replica``), because the replica
that received it has already authorized it. A router (``router``) asks for hints, reads, watches
the hint state for its own copy (incarnations hidden), and renews or revokes leases on its
clients' behalf. A node (``node``, with its node id) speaks
only for itself: it registers, heartbeats, reports retention, watches commands and releases
leases as that node id and no other, and reads what the lease check before a read needs.

Credentials:

- a shared token (``--token``): its holder is ``admin``, as before per-role credentials;
- a credentials file (``--credentials``): one line per credential, ``HOLDER SHA256_HEX``
  (the token's SHA-256, so the file holds no secret); ``kvbroker registry credential``
  prints a fresh token and its line;
- a client certificate, when the registry requires one (mTLS): its common name is the holder.

A holder is ``admin``, ``replica``, ``router`` or ``node:NODE_ID:NODE_ROLE``. A node's
credential binds both what it may claim in its registration that others trust: its node id
and its role (``prefill``, ``decode``, or ``both``, which may register as any of the three),
so a stolen prefill token cannot attract decode traffic and the KV retained for it. A node
holder without its role (the format before roles) is refused with a sentence saying what to
add, never read as "any role".

With none configured the registry is open (loopback development); then every caller is
``admin``.
"""

from __future__ import annotations

import enum
import hmac
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from kvbroker.common.client.grpc_client import AUTH_METADATA_KEY
from kvbroker.common.process.credentials import read_digest_file, token_digest
from kvbroker.common.rules import ids
from kvbroker.controlplane.errors import PermissionDenied, Unauthenticated
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2


class Role(enum.Enum):
    ADMIN = "admin"
    REPLICA = "replica"
    ROUTER = "router"
    NODE = "node"


# The node roles a node credential may name: BOTH may register as any of them.
NODE_ROLES: Mapping[str, int] = {
    "prefill": node_pb2.NODE_ROLE_PREFILL,
    "decode": node_pb2.NODE_ROLE_DECODE,
    "both": node_pb2.NODE_ROLE_BOTH,
}
HOLDER_FORM = "admin, replica, router or node:NODE_ID:NODE_ROLE (prefill, decode or both)"


def _check_node_id(node_id: str) -> None:
    """A node id a holder can carry and a credentials file reads back as written: a usable id
    (the registry's rule), without the separators of either (``:``, whitespace, ``#``)."""
    try:
        ids.check_id(node_id, "the node id")
    except ids.InvalidId as error:
        raise ValueError(str(error)) from None
    if not node_id.isprintable() or any(c.isspace() or c in ":#" for c in node_id):
        raise ValueError(
            f"node id {node_id!r} cannot be written in a credential: it may not hold spaces, "
            "':', '#' or unprintable characters"
        )


@dataclass(frozen=True, slots=True)
class Principal:
    role: Role
    # For a node: the node id it speaks for, and the NodeRole it may register as.
    node_id: str = ""
    node_role: int = node_pb2.NODE_ROLE_UNSPECIFIED

    @classmethod
    def parse(cls, text: str) -> Principal:
        """A holder (``HOLDER_FORM``); ValueError with a sentence otherwise."""
        role, _, rest = text.partition(":")
        try:
            parsed = Role(role)
        except ValueError:
            raise ValueError(f"unknown role {role!r} in {text!r}: expected {HOLDER_FORM}") from None
        if parsed is not Role.NODE:
            if rest:
                raise ValueError(f"{text!r}: only a node credential names a node")
            return cls(parsed)
        node_id, colon, node_role = rest.rpartition(":")
        if not colon:
            raise ValueError(
                f"{text!r}: a node credential names its node and the role it registers as, "
                f"e.g. 'node:{rest or 'NODE_ID'}:decode' (prefill, decode or both)"
            )
        _check_node_id(node_id)
        if node_role not in NODE_ROLES:
            raise ValueError(f"{text!r}: node role {node_role!r} is not prefill, decode or both")
        return cls(parsed, node_id, NODE_ROLES[node_role])

    @property
    def node_role_word(self) -> str:
        """A node's role as its credential names it."""
        return next(w for w, r in NODE_ROLES.items() if r == self.node_role)

    def __str__(self) -> str:
        """The holder as a credential writes it (``parse`` reads it back)."""
        if self.role is not Role.NODE:
            return str(self.role.value)
        return f"node:{self.node_id}:{self.node_role_word}"

    @property
    def trusted(self) -> bool:
        """May do anything (an operator, or a replica relaying an authorized call)."""
        return self.role in (Role.ADMIN, Role.REPLICA)

    def may_register_as(self, node_role: int) -> bool:
        """A node's credential allows its own role, and ``both`` every role."""
        return bool(self.node_role in (node_role, node_pb2.NODE_ROLE_BOTH))


OPEN = Principal(Role.ADMIN)

# What a router may call: hints, reads, and the session calls it makes for its clients.
_ROUTER_METHODS = frozenset(
    {
        "GetRoutingHint",
        "BatchGetRoutingHints",
        "GetNode",
        "ListNodes",
        "GetLease",
        "ListLeases",
        "GetConversation",
        "RenewLease",
        "RevokeLease",
        # The hint state, for the copy ``router serve --local-hints`` answers from; streamed
        # with incarnations hidden (``hint_state_for``), as its hints are.
        "WatchHintState",
    }
)
# What a node may call, and where each request names the node it acts as (None: a read that
# names no node, such as the lease check before a read).
_NODE_METHODS: Mapping[str, Callable[[Any], str] | None] = {
    "RegisterNode": lambda r: str(r.spec.node_id),
    "Heartbeat": lambda r: str(r.node_id),
    "DeregisterNode": lambda r: str(r.node_id),
    "ReportRetention": lambda r: str(r.node_id),
    "WatchLeaseCommands": lambda r: str(r.node_id),
    "GrantLease": lambda r: str(r.node_id),
    "ReleaseLease": lambda r: str(r.node_id),
    # Its own preStop hook drains it before the engine stops (never another node).
    "DrainNode": lambda r: str(r.node_id),
    "GetLease": None,
    "GetNode": None,
    "ListNodes": None,
    # For a turn another router placed on it (``on_node_id``): only on itself.
    "GetRoutingHint": lambda r: str(r.on_node_id),
    # A fork's match by content pins a lease for the asking (prefill) node: only itself.
    "MatchPrefix": lambda r: str(r.node_id),
    "EndReadPin": lambda r: str(r.node_id),
}


def authorize(principal: Principal, method: str, request: Any) -> None:
    """The rule: raises ``PermissionDenied`` unless ``principal`` may make this call."""
    if principal.trusted:
        return
    if principal.role is Role.ROUTER and method in _ROUTER_METHODS:
        return
    if principal.role is Role.NODE and method in _NODE_METHODS:
        acting_as = _NODE_METHODS[method]
        if acting_as is not None and acting_as(request) != principal.node_id:
            raise PermissionDenied(
                f"node {principal.node_id!r} may not call {method} as node {acting_as(request)!r}"
            )
        # The role a node registers as decides which traffic and which KV it is sent.
        if method == "RegisterNode" and not principal.may_register_as(request.spec.role):
            raise PermissionDenied(
                f"node {principal.node_id!r} may register only as its credential's role "
                f"({principal.node_role_word})"
            )
        return
    raise PermissionDenied(f"a {principal.role.value} credential may not call {method}")


def sees_incarnation(principal: Principal, node_id: str) -> bool:
    """Whether a node's incarnation may be shown to ``principal``: it is what a node's calls
    carry to prove their session, so only the node itself and operators see it."""
    return principal.trusted or (principal.role is Role.NODE and principal.node_id == node_id)


def hide_incarnations(principal: Principal, response: Any) -> None:
    """Clears, in place, every incarnation in an answer that ``principal`` may not see
    (``sees_incarnation``): the node specs of node reads and hints, and the holder's
    incarnation in leases. An incarnation is what a node's calls carry to prove their session;
    routers and other nodes need none (they address a node by id and a lease by id and epoch).
    An operator or a replica (and every caller of an open registry) returns at once, so the
    hot hint path pays nothing when identity is off; answers are built per call, so clearing
    them touches no shared state."""
    if principal.trusted:
        return
    hide = _HIDERS.get(type(response))
    if hide is not None:
        hide(principal, response)


def _hide_in_spec(principal: Principal, spec: node_pb2.NodeSpec) -> None:
    if spec.incarnation and not sees_incarnation(principal, spec.node_id):
        spec.ClearField("incarnation")


def _hide_in_lease(principal: Principal, lease: lease_pb2.Lease) -> None:
    if lease.node_incarnation and not sees_incarnation(principal, lease.node_id):
        lease.ClearField("node_incarnation")


def _hide_in_hint(principal: Principal, hint: registry_pb2.RoutingHint) -> None:
    _hide_in_spec(principal, hint.prefill)
    _hide_in_spec(principal, hint.decode)
    _hide_in_lease(principal, hint.lease)


def _hide_in_nodes(principal: Principal, response: Any) -> None:
    for node in response.nodes:
        _hide_in_spec(principal, node.spec)


def _hide_in_hints(principal: Principal, response: Any) -> None:
    for result in response.results:
        _hide_in_hint(principal, result.hint)


def _hide_in_leases(principal: Principal, response: Any) -> None:
    for lease in response.leases:
        _hide_in_lease(principal, lease)


class HintStateViews:
    """The hint-state messages as each watcher may see them (``hint_state_for``), stripped
    once per message and view rather than once per watcher: the feed sends the same message
    object to every watcher, and every router sees the same view of it (all incarnations
    hidden), so a fleet's routers share one copy. Keeps the views of the ``keep`` newest
    messages; a watcher further behind gets its own copy, the same bytes."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        # id(message) and the view -> (the message, held so its id is not reused; its view).
        self._views: OrderedDict[
            tuple[int, str],
            tuple[registry_pb2.WatchHintStateResponse, registry_pb2.WatchHintStateResponse],
        ] = OrderedDict()

    def for_principal(
        self, principal: Principal, message: registry_pb2.WatchHintStateResponse
    ) -> registry_pb2.WatchHintStateResponse:
        if principal.trusted:
            return message
        # What a principal may see differs only by the node it speaks for (``sees_incarnation``).
        key = (id(message), principal.node_id if principal.role is Role.NODE else "")
        held = self._views.get(key)
        if held is not None:
            self._views.move_to_end(key)
            return held[1]
        shown = hint_state_for(principal, message)
        self._views[key] = (message, shown)
        if len(self._views) > self._keep:
            self._views.popitem(last=False)
        return shown


def hint_state_for(
    principal: Principal, message: registry_pb2.WatchHintStateResponse
) -> registry_pb2.WatchHintStateResponse:
    """A hint-state message (``replication.hint_state``) as ``principal`` may see it: the
    same message for an operator or a replica (a follower's copy needs the nodes' sessions
    whole); for anyone else a copy with each node record's and lease record's incarnation
    hidden by the rule of every answer (``sees_incarnation``). A copy, because the feed sends
    one message to every watcher. A router's copy needs none: its hints are what the registry
    answers it, incarnations hidden too."""
    if principal.trusted:
        return message
    shown = registry_pb2.WatchHintStateResponse()
    shown.CopyFrom(message)
    for record in shown.records:
        if not record.record:
            continue  # a record gone
        if record.kind == registry_pb2.HINT_RECORD_KIND_NODE:
            node = node_pb2.Node.FromString(record.record)
            if node.spec.incarnation and not sees_incarnation(principal, node.spec.node_id):
                _hide_in_spec(principal, node.spec)
                record.record = node.SerializeToString()
        elif record.kind == registry_pb2.HINT_RECORD_KIND_LEASE:
            lease = lease_pb2.Lease.FromString(record.record)
            if lease.node_incarnation and not sees_incarnation(principal, lease.node_id):
                _hide_in_lease(principal, lease)
                record.record = lease.SerializeToString()
    return shown


# Where each answer carries incarnations of other nodes (an answer type not listed carries
# none; a retention report's leases are the reporting node's own).
_HIDERS: dict[type[Message], Callable[[Principal, Any], None]] = {
    **{
        answer: lambda p, r: _hide_in_spec(p, r.node.spec)
        for answer in (
            registry_pb2.RegisterNodeResponse,
            registry_pb2.HeartbeatResponse,
            registry_pb2.DeregisterNodeResponse,
            registry_pb2.GetNodeResponse,
            registry_pb2.DrainNodeResponse,
            registry_pb2.SetCostProfileResponse,
        )
    },
    **{
        answer: lambda p, r: _hide_in_lease(p, r.lease)
        for answer in (
            registry_pb2.GrantLeaseResponse,
            registry_pb2.RenewLeaseResponse,
            registry_pb2.ReleaseLeaseResponse,
            registry_pb2.RevokeLeaseResponse,
            registry_pb2.GetLeaseResponse,
        )
    },
    registry_pb2.ListNodesResponse: _hide_in_nodes,
    registry_pb2.ListLeasesResponse: _hide_in_leases,
    registry_pb2.GetRoutingHintResponse: lambda p, r: _hide_in_hint(p, r.hint),
    registry_pb2.MatchPrefixResponse: lambda p, r: _hide_in_lease(p, r.lease),
    registry_pb2.BatchGetRoutingHintsResponse: _hide_in_hints,
}


@dataclass(frozen=True)
class Credentials:
    """The credentials a registry accepts, and how it tells who presented one."""

    shared_token: str | None = None
    # SHA-256 (hex) of a token -> who holds it.
    tokens: Mapping[str, Principal] | None = None
    # Whether client certificates name their holder (the server requires them).
    client_certificates: bool = False

    @property
    def open(self) -> bool:
        return not (self.shared_token or self.tokens or self.client_certificates)

    @classmethod
    def load(
        cls, shared_token: str | None, path: Path | None, client_certificates: bool
    ) -> Credentials:
        """Raises ValueError naming the line of a malformed credentials file, or the file
        when it holds no credential (read as none, it would leave the registry open)."""
        tokens = (
            read_digest_file(path, Principal.parse, "HOLDER SHA256_HEX")
            if path is not None
            else None
        )
        return cls(shared_token or None, tokens, client_certificates)

    def principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """Who made the call; raises ``Unauthenticated`` when no credential names anyone."""
        if self.open:
            return OPEN
        metadata = dict(context.invocation_metadata() or ())
        presented = str(metadata.get(AUTH_METADATA_KEY, ""))
        if presented.startswith("Bearer "):
            token = presented.removeprefix("Bearer ")
            if self.shared_token and hmac.compare_digest(token, self.shared_token):
                return OPEN
            holder = (self.tokens or {}).get(token_digest(token))
            if holder is not None:
                return holder
            raise Unauthenticated("the bearer token is not one this registry accepts")
        if self.client_certificates:
            names = context.auth_context().get("x509_common_name") or []
            for name in names:
                try:
                    return Principal.parse(name.decode())
                except ValueError:
                    continue
            raise Unauthenticated(
                f"the client certificate's common name names no holder ({HOLDER_FORM})"
            )
        raise Unauthenticated("missing bearer token (pass --token, or a --token-file)")
