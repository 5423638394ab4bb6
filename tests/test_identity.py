"""Identities (``controlplane/api/identity.py``): a node's credential binds it to its node id, a
router's to routing, incarnations are not handed to readers, one command stream per node, and
mTLS names callers by their certificate, between replicas too. Real registry processes, a real
sidecar, real certificates (openssl)."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import httpx
import pytest

from kvbroker.common.client.engine_link import EngineLink
from kvbroker.common.client.grpc_client import (
    RegistryEndpoint,
    from_grpc_error,
    open_channel,
    registry_stub,
)
from kvbroker.common.process.credentials import token_digest
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Announces, ChildProcess
from kvbroker.common.process.tasks import poll_until
from kvbroker.controlplane.api.identity import (
    Credentials,
    HintStateViews,
    Principal,
    Role,
    authorize,
    sees_incarnation,
)
from kvbroker.controlplane.errors import PermissionDenied
from kvbroker.controlplane.server import RunningRegistry, ServerOptions, TlsFiles, start_registry
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2, sidecar_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from kvbroker_tools.harness.processes import RegistryProcess
from kvbroker_tools.stack import KVBROKER, router_command, router_routing, sidecar_command
from tests.conftest import CliResult, eventually, run_cli

DENIED = registry_pb2.ERROR_REASON_PERMISSION_DENIED
UNAUTHENTICATED = registry_pb2.ERROR_REASON_UNAUTHENTICATED

# ---------------------------------------------------------------------- the rule


def test_a_node_acts_only_as_itself() -> None:
    node = Principal(Role.NODE, "decode-0")
    mine = registry_pb2.HeartbeatRequest(node_id="decode-0")
    theirs = registry_pb2.HeartbeatRequest(node_id="decode-1")
    authorize(node, "Heartbeat", mine)
    with pytest.raises(PermissionDenied, match="as node 'decode-1'"):
        authorize(node, "Heartbeat", theirs)
    with pytest.raises(PermissionDenied):
        authorize(node, "RegisterNode", registry_pb2.RegisterNodeRequest(spec=node_spec("d-1")))
    authorize(node, "GetLease", registry_pb2.GetLeaseRequest(lease_id="x"))  # the read check
    with pytest.raises(PermissionDenied):
        authorize(node, "RevokeLease", registry_pb2.RevokeLeaseRequest())
    # A hint only for a turn another router placed on itself (its engine resolving a handle).
    authorize(node, "GetRoutingHint", registry_pb2.GetRoutingHintRequest(on_node_id="decode-0"))
    for placed_on in ("", "decode-1"):
        with pytest.raises(PermissionDenied):
            authorize(
                node, "GetRoutingHint", registry_pb2.GetRoutingHintRequest(on_node_id=placed_on)
            )
    # It drains itself (its preStop hook), never another node.
    authorize(node, "DrainNode", registry_pb2.DrainNodeRequest(node_id="decode-0"))
    with pytest.raises(PermissionDenied, match="as node 'decode-1'"):
        authorize(node, "DrainNode", registry_pb2.DrainNodeRequest(node_id="decode-1"))


def test_a_router_routes_and_manages_sessions_but_is_no_node() -> None:
    router = Principal(Role.ROUTER)
    for method in (
        "GetRoutingHint",
        "BatchGetRoutingHints",
        "ListNodes",
        "RevokeLease",
        "WatchHintState",
    ):
        authorize(router, method, None)
    # The hint state is a router's copy, or a replica's: never a node's (it routes nothing).
    with pytest.raises(PermissionDenied):
        authorize(Principal(Role.NODE, "decode-0"), "WatchHintState", None)
    for method in ("Heartbeat", "ReportRetention", "DrainNode", "ReleaseLease"):
        with pytest.raises(PermissionDenied):
            authorize(router, method, registry_pb2.HeartbeatRequest(node_id="decode-0"))


def test_incarnations_are_seen_by_their_node_and_operators_only() -> None:
    assert sees_incarnation(Principal(Role.ADMIN), "decode-0")
    assert sees_incarnation(Principal(Role.NODE, "decode-0"), "decode-0")
    assert not sees_incarnation(Principal(Role.NODE, "decode-1"), "decode-0")
    assert not sees_incarnation(Principal(Role.ROUTER), "decode-0")


def hint_state(*incarnations: tuple[str, str]) -> registry_pb2.WatchHintStateResponse:
    """A feed message holding, per (node id, incarnation), the node's record and a lease."""
    message = registry_pb2.WatchHintStateResponse()
    for node_id, incarnation in incarnations:
        node = node_pb2.Node(spec=node_pb2.NodeSpec(node_id=node_id, incarnation=incarnation))
        lease = lease_pb2.Lease(lease_id=f"l-{node_id}", node_id=node_id)
        lease.node_incarnation = incarnation
        message.records.add(
            kind=registry_pb2.HINT_RECORD_KIND_NODE, record=node.SerializeToString()
        )
        message.records.add(
            kind=registry_pb2.HINT_RECORD_KIND_LEASE, record=lease.SerializeToString()
        )
    return message


def shown_incarnations(message: registry_pb2.WatchHintStateResponse) -> list[str]:
    shown = []
    for record in message.records:
        if record.kind == registry_pb2.HINT_RECORD_KIND_NODE:
            shown.append(node_pb2.Node.FromString(record.record).spec.incarnation)
        else:
            shown.append(lease_pb2.Lease.FromString(record.record).node_incarnation)
    return shown


def test_every_router_shares_one_stripped_copy_of_a_feed_message() -> None:
    views = HintStateViews(keep=2)
    first, second = hint_state(("d0", "inc-0"), ("d1", "inc-1")), hint_state(("d0", "inc-2"))
    router, other_router = Principal(Role.ROUTER), Principal(Role.ROUTER)
    shown = views.for_principal(router, first)
    assert shown_incarnations(shown) == ["", "", "", ""]
    assert views.for_principal(other_router, first) is shown
    assert shown_incarnations(first) == ["inc-0", "inc-0", "inc-1", "inc-1"]  # untouched
    # Operators and replicas get the message itself.
    assert views.for_principal(Principal(Role.ADMIN), first) is first
    assert views.for_principal(Principal(Role.REPLICA), first) is first
    # A node's view is its own: it sees its incarnation and no other node's.
    node = Principal(Role.NODE, "d1", node_pb2.NODE_ROLE_DECODE)
    assert shown_incarnations(views.for_principal(node, first)) == ["", "", "inc-1", "inc-1"]
    # Past ``keep`` newer views a message is stripped again: another copy, the same bytes.
    views.for_principal(router, second)
    views.for_principal(node, second)
    again = views.for_principal(router, first)
    assert again is not shown and again == shown


def test_principals_and_credential_files_are_checked(tmp_path: Path) -> None:
    decode = node_pb2.NODE_ROLE_DECODE
    assert Principal.parse("node:decode-0:decode") == Principal(Role.NODE, "decode-0", decode)
    assert str(Principal.parse("node:decode-0:both")) == "node:decode-0:both"
    assert Principal.parse("admin:") == Principal(Role.ADMIN)
    for bad in ("node", "node:d-0", "node::decode", "node:d-0:router", "router:x", "root"):
        with pytest.raises(ValueError):
            Principal.parse(bad)
    good = tmp_path / "ok"
    good.write_text(f"# fleet\n\nrouter {token_digest('r')}\nnode:d-0:decode {token_digest('n')}\n")
    loaded = Credentials.load(None, good, False)
    assert loaded.tokens == {
        token_digest("r"): Principal(Role.ROUTER),
        token_digest("n"): Principal(Role.NODE, "d-0", decode),
    }
    malformed = tmp_path / "bad"
    malformed.write_text("router not-a-digest\n")
    with pytest.raises(ValueError, match=r"bad:1"):
        Credentials.load(None, malformed, False)
    twice = tmp_path / "twice"
    twice.write_text(f"router {token_digest('r')}\nnode:d-0:decode {token_digest('r')}\n")
    with pytest.raises(ValueError, match=r"twice:2: .*another holder"):
        Credentials.load(None, twice, False)


DIGEST = token_digest("t")


async def serve_refused(*flags: str) -> CliResult:
    """``kvbroker registry serve`` with ``flags``, expected to refuse to start: its result,
    or a failure as soon as it announces its address instead (it started)."""
    process = await asyncio.create_subprocess_exec(
        KVBROKER, "registry", "serve", "--listen", "127.0.0.1:0", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    announced = await asyncio.wait_for(process.stdout.readline(), 30)
    if announced:
        process.kill()
        await process.wait()
        pytest.fail(f"the registry started: {announced.decode().strip()}")
    err = await asyncio.wait_for(process.stderr.read(), 30)
    await process.wait()
    assert process.returncode is not None
    return CliResult(process.returncode, "", err.decode())


@pytest.mark.parametrize(
    ("content", "line", "why"),
    [
        (b"", None, "holds no credential"),
        (b"# nobody yet\n\n   \n", None, "holds no credential"),
        (b"\xef\xbb\xbfrouter " + DIGEST.encode() + b"\n", 1, "byte-order mark"),
        (b"# fleet\r\nrouter " + DIGEST.encode() + b"\r\n", 1, "CRLF"),
        (b"router " + DIGEST.upper().encode() + b"\n", 1, "lower-case hex"),
        (b"# x\nrouter " + DIGEST.encode() + b" extra # the router\n", 2, "expected"),
        (b"router" + DIGEST.encode() + b"\n", 1, "expected"),
        (b"router " + DIGEST.encode() + b"\nnode:d-0 " + DIGEST[::-1].encode(), 2, "role"),
        (b"router \xff" + DIGEST.encode()[1:] + b"\n", 1, "not UTF-8"),
    ],
    ids=["empty", "comments", "bom", "crlf", "upper", "three", "one", "no-role", "latin1"],
)
async def test_a_credentials_file_it_cannot_read_stops_the_registry(
    tmp_path: Path, content: bytes, line: int | None, why: str
) -> None:
    """A file read as no credential left the registry open to everyone as an operator; a
    line it half-read dropped or mangled a credential. Either stops it, in one sentence."""
    path = tmp_path / "credentials"
    path.write_bytes(content)
    refused = await serve_refused("--credentials", str(path))
    assert refused.code == 2, refused.stderr
    where = f"{path}:{line}:" if line else str(path)
    assert where in refused.stderr and why in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


async def test_a_credentials_file_that_is_missing_stops_the_registry(tmp_path: Path) -> None:
    refused = await serve_refused("--credentials", str(tmp_path / "nowhere"))
    assert refused.code == 2 and f"cannot read {tmp_path / 'nowhere'}" in refused.stderr
    assert "Traceback" not in refused.stderr


async def test_credential_lines_are_only_made_for_holders_the_file_reads_back(
    tmp_path: Path,
) -> None:
    made = await run_cli("registry", "credential", "node:decode-0:decode")
    assert made.code == 0, made.stderr
    line = made.stdout.split("line:", 1)[1].strip()
    (tmp_path / "credentials").write_text(line + "\n")
    token = made.stdout.split("token:", 1)[1].split()[0]
    loaded = Credentials.load(None, tmp_path / "credentials", False)
    assert loaded.tokens == {
        token_digest(token): Principal(Role.NODE, "decode-0", node_pb2.NODE_ROLE_DECODE)
    }
    for who in (
        "node:decode 0:decode", "node:decode#0:decode", "node:a:b:decode", "node:decode-0",
        "node:decode-0:router", "node:\tx:decode", "node:" + "x" * 300 + ":decode",
    ):  # fmt: skip
        refused = await run_cli("registry", "credential", who)
        assert refused.code == 2, (who, refused.stdout)
        assert "token:" not in refused.stdout and "Traceback" not in refused.stderr
        assert refused.stderr.startswith("error:"), refused.stderr


# ---------------------------------------------------------------------- per-node tokens


@dataclass
class Fleet:
    registry: RegistryProcess
    tokens: dict[str, str]

    def endpoint(self, who: str) -> RegistryEndpoint:
        return RegistryEndpoint.parse(self.registry.address, token=self.tokens[who])


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    holders = ("admin", "router", "node:decode-0:decode", "node:both-0:both")
    tokens = {who: f"token-of-{who}" for who in holders}
    lines = [f"{who} {token_digest(token)}" for who, token in tokens.items()]
    (tmp_path / "credentials").write_text("\n".join(lines) + "\n")
    registry = RegistryProcess("--credentials", str(tmp_path / "credentials"))
    await registry.start()
    try:
        yield Fleet(registry, tokens)
    finally:
        await registry.stop()


async def refusal(call: asyncio.Future[object] | object) -> registry_pb2.ErrorReason:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call  # type: ignore[misc]
    return from_grpc_error(error.value).reason


async def test_a_node_token_speaks_for_its_node_only(fleet: Fleet) -> None:
    async with open_channel(fleet.endpoint("node:decode-0:decode")) as channel:
        stub = registry_stub(channel)
        own, other = node_spec("decode-0"), node_spec("decode-1")
        await stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=own), timeout=5)
        assert (
            await refusal(
                stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=other), timeout=5)
            )
            == DENIED
        )
        assert (
            await refusal(
                stub.RevokeLease(registry_pb2.RevokeLeaseRequest(conversation_id="c"), timeout=5)
            )
            == DENIED
        )
        assert (
            await refusal(
                stub.DrainNode(registry_pb2.DrainNodeRequest(node_id="decode-1"), timeout=5)
            )
            == DENIED
        )
        drained = await stub.DrainNode(registry_pb2.DrainNodeRequest(node_id="decode-0"))
        assert drained.node.state == node_pb2.NODE_STATE_DRAINING
        # It sees its own incarnation: its calls carry it.
        seen = (await stub.GetNode(registry_pb2.GetNodeRequest(node_id="decode-0"))).node
        assert seen.spec.incarnation == own.incarnation


async def test_a_node_token_registers_only_as_its_role(fleet: Fleet) -> None:
    """A node's registration says which traffic and which KV it is sent: a decode node's
    stolen token cannot register that node as a prefill node (or as both), while a node
    whose credential says both may register as any role."""
    async with open_channel(fleet.endpoint("node:decode-0:decode")) as channel:
        stub = registry_stub(channel)
        for role in (node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_BOTH):
            spec = node_spec("decode-0", role)
            call = stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=spec), timeout=5)
            assert await refusal(call) == DENIED
        await stub.RegisterNode(
            registry_pb2.RegisterNodeRequest(spec=node_spec("decode-0")), timeout=5
        )
    async with open_channel(fleet.endpoint("node:both-0:both")) as channel:
        stub = registry_stub(channel)
        for role in (node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_BOTH):
            spec = node_spec("both-0", role, port=5700)
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=spec), timeout=5)
            await stub.DeregisterNode(
                registry_pb2.DeregisterNodeRequest(node_id="both-0", incarnation=spec.incarnation)
            )


async def test_a_node_token_reaches_its_command_stream(fleet: Fleet) -> None:
    """The token goes on streams too: a sidecar's WatchLeaseCommands was sent without it and
    refused as UNAUTHENTICATED, ending the node's session again and again."""
    async with open_channel(fleet.endpoint("node:decode-0:decode")) as channel:
        stub = registry_stub(channel)
        spec = node_spec("decode-0")
        await stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=spec), timeout=5)
        stream = stub.WatchLeaseCommands(
            registry_pb2.WatchLeaseCommandsRequest(node_id="decode-0", incarnation=spec.incarnation)
        )
        try:
            # Accepted: open and waiting for commands, not ended with an error.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stream.read()), 1.0)
            assert not stream.done()
        finally:
            stream.cancel()


async def test_a_router_token_routes_but_cannot_act_as_a_node(fleet: Fleet) -> None:
    async with (
        open_channel(fleet.endpoint("admin")) as admin_channel,
        open_channel(fleet.endpoint("router")) as router_channel,
    ):
        admin, router = registry_stub(admin_channel), registry_stub(router_channel)
        decode = node_spec("decode-0")
        prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
        async with Heartbeats(admin, decode, prefill):
            await grant(admin, decode, "conv-1", "req-1")
            hint = (
                await router.GetRoutingHint(
                    registry_pb2.GetRoutingHintRequest(conversation_id="conv-1"), timeout=5
                )
            ).hint
            assert hint.decision == registry_pb2.HINT_DECISION_REUSE
            nodes = (await router.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)).nodes
            assert {n.spec.node_id for n in nodes} == {"decode-0", "prefill-0"}
            assert all(not n.spec.incarnation for n in nodes)  # not handed to readers
            heartbeat = registry_pb2.HeartbeatRequest(
                node_id="decode-0", incarnation=decode.incarnation, engine_ready=False
            )
            assert await refusal(router.Heartbeat(heartbeat, timeout=5)) == DENIED
            admin_view = (await admin.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)).nodes
            assert all(n.spec.incarnation for n in admin_view)


async def test_hints_and_leases_show_incarnations_to_their_node_and_operators_only(
    fleet: Fleet,
) -> None:
    """A hint's node specs and lease, and every lease read, carried the holder's incarnation
    to routers and other nodes: what a node's calls carry to prove their session."""
    async with (
        open_channel(fleet.endpoint("admin")) as admin_channel,
        open_channel(fleet.endpoint("router")) as router_channel,
        open_channel(fleet.endpoint("node:decode-0:decode")) as own_channel,
        open_channel(fleet.endpoint("node:both-0:both")) as other_channel,
    ):
        admin, router = registry_stub(admin_channel), registry_stub(router_channel)
        own, other = registry_stub(own_channel), registry_stub(other_channel)
        decode = node_spec("decode-0")
        prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
        async with Heartbeats(admin, decode, prefill):
            lease = await grant(admin, decode, "conv-1", "req-1")
            assert lease.node_incarnation == decode.incarnation
            hint = (
                await router.GetRoutingHint(
                    registry_pb2.GetRoutingHintRequest(conversation_id="conv-1"), timeout=5
                )
            ).hint
            assert hint.decision == registry_pb2.HINT_DECISION_REUSE
            assert hint.decode.node_id == "decode-0" and hint.prefill.node_id == "prefill-0"
            assert hint.lease.lease_id == lease.lease_id
            assert not (hint.decode.incarnation or hint.prefill.incarnation)
            assert not hint.lease.node_incarnation
            batch = await router.BatchGetRoutingHints(
                registry_pb2.BatchGetRoutingHintsRequest(
                    requests=[registry_pb2.GetRoutingHintRequest(conversation_id="conv-2")]
                ),
                timeout=5,
            )
            (result,) = batch.results
            assert result.hint.decode.node_id and not result.hint.decode.incarnation
            assert not result.hint.prefill.incarnation
            get = registry_pb2.GetLeaseRequest(lease_id=lease.lease_id)
            for reader in (router, other):
                assert not (await reader.GetLease(get, timeout=5)).lease.node_incarnation
            listed = await router.ListLeases(registry_pb2.ListLeasesRequest(), timeout=5)
            assert listed.leases and not any(x.node_incarnation for x in listed.leases)
            renewed = await router.RenewLease(
                registry_pb2.RenewLeaseRequest(lease_id=lease.lease_id), timeout=5
            )
            assert not renewed.lease.node_incarnation
            # The node itself and operators still see it.
            for reader in (own, admin):
                seen = (await reader.GetLease(get, timeout=5)).lease
                assert seen.node_incarnation == decode.incarnation
            admin_hint = await admin.GetRoutingHint(
                registry_pb2.GetRoutingHintRequest(conversation_id="conv-3", dry_run=True)
            )
            assert admin_hint.hint.decode.incarnation == decode.incarnation


async def test_unknown_tokens_and_no_token_are_unauthenticated(fleet: Fleet) -> None:
    for token in ("guess", None):
        endpoint = RegistryEndpoint.parse(fleet.registry.address, token=token)
        async with open_channel(endpoint) as channel:
            call = registry_stub(channel).ListNodes(registry_pb2.ListNodesRequest(), timeout=5)
            assert await refusal(call) == UNAUTHENTICATED


async def test_a_real_sidecar_with_its_node_token_registers(fleet: Fleet, tmp_path: Path) -> None:
    """The token travels through the environment (never argv), and the sidecar's session,
    reports and command stream all pass the node check."""
    async with FakeEngine("decode-0") as engine:
        sidecar = ChildProcess(
            "sidecar",
            sidecar_command(
                fleet.registry.address, engine.url, "decode", "decode-0", tmp_path / "s.sock"
            ),
            tmp_path / "sidecar.log",
            ready=[Announces()],
            env={"KVBROKER_TOKEN": fleet.tokens["node:decode-0:decode"]},
        )
        await sidecar.start()
        link = EngineLink(
            f"unix:{tmp_path / 's.sock'}",
            sidecar_pb2.EngineInfo(
                engine_id="engine-decode-0", side_channel_host="127.0.0.1",
                side_channel_port=5600, block_size=16, capacity_blocks=4096,
                bytes_per_block=65536,
            ),
        )  # fmt: skip
        link.start()
        try:

            async def registered() -> list[str]:
                listed = await run_cli(
                    "node", "ls", "--registry", fleet.registry.address, "--output", "json",
                    env={"KVBROKER_TOKEN": fleet.tokens["admin"]},
                )  # fmt: skip
                assert listed.code == 0, listed.stderr
                return [n["spec"]["node_id"] for n in listed.json()]

            assert await poll_until(registered, 20, "the sidecar's registration") == ["decode-0"]
        finally:
            link.close()
            await sidecar.stop()
        assert "PERMISSION_DENIED" not in (tmp_path / "sidecar.log").read_text()


# ---------------------------------------------------------------------- one command stream


async def test_a_second_command_stream_for_a_node_replaces_the_first(
    stub: RegistryServiceStub, registry_server: RunningRegistry
) -> None:
    """Two streams for one node would split its commands; the newer one gets them all and
    the older one ends."""
    spec = node_spec("decode-0")
    async with Heartbeats(stub, spec):
        lease = await grant(stub, spec, "conv-1", "req-1")
        watch = registry_pb2.WatchLeaseCommandsRequest(
            node_id="decode-0", incarnation=spec.incarnation
        )
        renew = registry_pb2.RenewLeaseRequest(lease_id=lease.lease_id)
        first = stub.WatchLeaseCommands(watch)
        await stub.RenewLease(renew, timeout=5)
        # A command reached it: the first stream is the node's watcher.
        assert (await asyncio.wait_for(first.read(), 5)).command.lease_id == lease.lease_id
        second = stub.WatchLeaseCommands(watch)

        async def rest_of_first() -> list[registry_pb2.LeaseCommand]:
            commands = []
            while (response := await first.read()) != grpc.aio.EOF:
                commands.append(response.command)
            return commands

        leftover = await asyncio.wait_for(rest_of_first(), 5)  # the second took over: it ended
        for _ in range(3):
            await stub.RenewLease(renew, timeout=5)
        await stub.RevokeLease(
            registry_pb2.RevokeLeaseRequest(lease_id=lease.lease_id, reason="closed"), timeout=5
        )
        received = []
        async for response in second:
            received.append(response.command)
            if response.command.state == lease_pb2.LEASE_STATE_REVOKED:
                break
        assert received and received[-1].reason == "closed"
        assert all(c.reason != "closed" for c in leftover)
        second.cancel()


# ---------------------------------------------------------------------- mTLS


@dataclass
class Pki:
    ca: Path
    files: dict[str, tuple[Path, Path]]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA and certificates whose common names are roles; every one is valid for 127.0.0.1
    so that replicas can use theirs as server certificates too."""
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca = root / "ca.key", root / "ca.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    files = {}
    for who in ("replica", "router", "node:decode-0:decode"):
        name = who.replace(":", "-")
        key, csr, cert = root / f"{name}.key", root / f"{name}.csr", root / f"{name}.pem"
        ext = root / f"{name}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
                 "-keyout", str(key), "-out", str(csr))  # fmt: skip
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
                 "-CAcreateserial", "-days", "1", "-extfile", str(ext),
                 "-out", str(cert))  # fmt: skip
        files[who] = (cert, key)
    return Pki(ca, files)


def _mtls(pki: Pki, address: str, who: str) -> RegistryEndpoint:
    cert, key = pki.files[who]
    return RegistryEndpoint.parse(address, tls_ca=pki.ca, tls_cert=cert, tls_key=key)


async def test_mtls_names_the_caller_by_its_certificate(pki: Pki) -> None:
    cert, key = pki.files["replica"]
    registry = RegistryProcess(
        "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(pki.ca)
    )
    await registry.start()
    try:
        async with open_channel(_mtls(pki, registry.address, "node:decode-0:decode")) as channel:
            stub = registry_stub(channel)
            await stub.RegisterNode(
                registry_pb2.RegisterNodeRequest(spec=node_spec("decode-0")), timeout=5
            )
            assert (
                await refusal(
                    stub.RegisterNode(
                        registry_pb2.RegisterNodeRequest(spec=node_spec("decode-1")), timeout=5
                    )
                )
                == DENIED
            )
        async with open_channel(_mtls(pki, registry.address, "router")) as channel:
            nodes = (await registry_stub(channel).ListNodes(registry_pb2.ListNodesRequest())).nodes
            assert [n.spec.node_id for n in nodes] == ["decode-0"]
            assert not nodes[0].spec.incarnation
        # Without a client certificate the handshake itself fails.
        plain = RegistryEndpoint.parse(registry.address, tls_ca=pki.ca)
        async with open_channel(plain) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await registry_stub(channel).ListNodes(registry_pb2.ListNodesRequest(), timeout=3)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await registry.stop()


async def _registered(stub: RegistryServiceStub, spec: node_pb2.NodeSpec) -> bool:
    """Registers ``spec``; False while no replica leads (an election still pending)."""
    try:
        await stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=spec), timeout=5)
    except grpc.aio.AioRpcError as error:
        if from_grpc_error(error).reason != registry_pb2.ERROR_REASON_NO_LEADER:
            raise
        return False
    return True


@pytest.mark.etcd
async def test_replicas_forward_to_each_other_over_mtls(
    pki: Pki, etcd: LocalEtcd, tmp_path: Path
) -> None:
    """Two replicas over etcd with mTLS: a node registered through whichever replica is not
    the leader is forwarded (as "replica") and authorized where it entered (as the node)."""
    cert, key = pki.files["replica"]
    flags = ["--store", etcd.url, "--tls-cert", str(cert), "--tls-key", str(key),
             "--tls-client-ca", str(pki.ca), "--election-ttl", "2"]  # fmt: skip
    replicas = [
        RegistryProcess(*flags, name=f"registry-{i}", log=tmp_path / f"r{i}.log") for i in range(2)
    ]
    for replica in replicas:
        await replica.start()
    # One session, registered again through the other replica (another incarnation would be
    # refused while this one's session is live).
    spec = node_spec("decode-0")
    try:
        for replica in replicas:
            async with open_channel(_mtls(pki, replica.address, "node:decode-0:decode")) as channel:
                stub = registry_stub(channel)
                await eventually(partial(_registered, stub, spec), within=15, every=0.2)
                assert (
                    await refusal(
                        stub.RegisterNode(
                            registry_pb2.RegisterNodeRequest(spec=node_spec("decode-1")), timeout=5
                        )
                    )
                    == DENIED
                )
    finally:
        for replica in replicas:
            await replica.stop()


async def test_the_cli_sidecar_and_router_present_their_client_certificates(
    pki: Pki, tmp_path: Path
) -> None:
    """Real processes against a registry that requires client certificates: `sidecar run`
    with a node:decode-0 certificate (given through the environment) registers its node,
    `node ls` with a router certificate lists it, and `router run` with the router's
    certificate learns of it. The registry's own --tls-cert/--tls-key names are left alone:
    the client's are --tls-client-cert/--tls-client-key."""
    cert, key = pki.files["replica"]
    registry = RegistryProcess(
        "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(pki.ca)
    )
    await registry.start()
    node_cert, node_key = pki.files["node:decode-0:decode"]
    router_cert, router_key = pki.files["router"]
    as_router = [
        "--registry", registry.address, "--tls-ca", str(pki.ca),
        "--tls-client-cert", str(router_cert), "--tls-client-key", str(router_key),
    ]  # fmt: skip
    router_url = f"http://127.0.0.1:{free_port()}"
    router = ChildProcess(
        "router",
        [*router_command(registry.address, router_url.removeprefix("http://")), *as_router[2:]],
        tmp_path / "router.log",
        ready=[router_routing(router_url, "tiny-qwen3", within_s=20)],
    )
    try:
        async with FakeEngine("decode-0") as engine:
            sidecar = ChildProcess(
                "sidecar",
                sidecar_command(
                    registry.address, engine.url, "decode", "decode-0", tmp_path / "s.sock"
                ),
                tmp_path / "sidecar.log",
                ready=[Announces()],
                env={
                    "KVBROKER_TLS_CA": str(pki.ca),
                    "KVBROKER_TLS_CLIENT_CERT": str(node_cert),
                    "KVBROKER_TLS_CLIENT_KEY": str(node_key),
                },
            )
            await sidecar.start()
            link = EngineLink(
                f"unix:{tmp_path / 's.sock'}",
                sidecar_pb2.EngineInfo(
                    engine_id="engine-decode-0", side_channel_host="127.0.0.1",
                    side_channel_port=5600, block_size=16, capacity_blocks=4096,
                    bytes_per_block=65536,
                ),
            )  # fmt: skip
            link.start()
            try:

                async def registered() -> list[str]:
                    listed = await run_cli("node", "ls", *as_router, "--output", "json")
                    assert listed.code == 0, listed.stderr
                    return [n["spec"]["node_id"] for n in listed.json()]

                assert await poll_until(registered, 20, "the sidecar's registration") == [
                    "decode-0"
                ]
                await router.start()  # ready once it lists the node's model
            finally:
                link.close()
                await router.stop()
                await sidecar.stop()
        assert "PERMISSION_DENIED" not in (tmp_path / "sidecar.log").read_text()
        # The registry wants a certificate: without one the call cannot be made.
        plain = await run_cli("node", "ls", *as_router[:4])
        assert plain.code == 3, plain.stderr
        # Usage errors, before any call: a certificate without its key, or without the CA.
        for flags in (as_router[:6], [*as_router[:2], *as_router[4:]]):
            usage = await run_cli("node", "ls", *flags)
            assert usage.code == 2, usage.stderr
            assert "--tls-client-cert" in usage.stderr
    finally:
        await registry.stop()


async def test_metrics_are_served_over_mtls_with_the_registry_s_certificate(pki: Pki) -> None:
    """Under mTLS the registry's /metrics is HTTPS with its own certificate, and only a
    scraper with a client certificate from the same CA may read it."""
    cert, key = pki.files["replica"]
    metrics_port = free_port()
    registry = RegistryProcess(
        "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(pki.ca),
        "--metrics-listen", f"127.0.0.1:{metrics_port}",
    )  # fmt: skip
    await registry.start()
    url = f"https://127.0.0.1:{metrics_port}/metrics"
    try:
        scraper_cert, scraper_key = pki.files["router"]
        ssl_context = ssl.create_default_context(cafile=str(pki.ca))
        ssl_context.load_cert_chain(str(scraper_cert), str(scraper_key))
        async with httpx.AsyncClient(verify=ssl_context) as scraper:
            assert "kvbroker_hints_total" in (await scraper.get(url)).text
        async with httpx.AsyncClient(verify=str(pki.ca)) as anonymous:
            # TLS 1.3 refuses a missing client certificate after the handshake: the refusal
            # comes as httpx's error or, when it lands while reading, as the ssl module's own.
            with pytest.raises((httpx.HTTPError, ssl.SSLError)):
                await anonymous.get(url)
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        await registry.stop()


async def test_a_sidecar_serves_its_metrics_over_tls_when_asked(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.files["node:decode-0:decode"]
    port = free_port()
    engine = FakeEngine("decode-0")
    sidecar = ChildProcess(
        "sidecar",
        [
            *sidecar_command("127.0.0.1:1", engine.url, "decode", "decode-0", tmp_path / "s.sock"),
            "--metrics-listen",
            f"127.0.0.1:{port}",
            "--metrics-tls-cert",
            str(cert),
            "--metrics-tls-key",
            str(key),
        ],
        tmp_path / "sidecar.log",
        ready=[Announces()],
    )
    await sidecar.start()
    # A client that connects and never says hello holds only its own connection.
    _, silent = await asyncio.open_connection("127.0.0.1", port)
    try:
        ssl_context = ssl.create_default_context(cafile=str(pki.ca))
        async with httpx.AsyncClient(verify=ssl_context, timeout=2.0) as scraper:
            response = await scraper.get(f"https://127.0.0.1:{port}/metrics")
        assert "kvbroker_sidecar_engine_ready" in response.text
    finally:
        silent.close()
        await sidecar.stop()
    lone = await run_cli(
        "sidecar", "run", "--engine-url", "http://x:1", "--role", "decode",
        "--metrics-tls-cert", str(cert),
    )  # fmt: skip
    assert lone.code == 2 and "--metrics-tls-cert and --metrics-tls-key go together" in lone.stderr


async def test_a_silent_or_garbled_client_does_not_stop_tls_scrapes(pki: Pki) -> None:
    """The handshake runs on each connection's own thread: a client that connects and sends
    nothing, one that sends bytes that are no ClientHello and one that starts a TLS record and
    stops hold only their own connections while a real scraper reads the metrics at once."""
    cert, key = pki.files["replica"]
    running = await start_registry(
        ServerOptions(
            listen="127.0.0.1:0",
            metrics_listen="127.0.0.1:0",
            tls=TlsFiles(cert, key, pki.ca),
        )
    )
    assert running.metrics_address is not None
    host, _, port = running.metrics_address.rpartition(":")
    idle = []
    try:
        for opening in (b"", b"\x00not a client hello\r\n\r\n", b"\x16\x03\x01\x02\x00\x01"):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(opening)
            await writer.drain()
            idle.append(writer)
        scraper_cert, scraper_key = pki.files["router"]
        ssl_context = ssl.create_default_context(cafile=str(pki.ca))
        ssl_context.load_cert_chain(str(scraper_cert), str(scraper_key))
        # Well under HANDSHAKE_TIMEOUT_S: the scrape does not wait for the silent ones to go.
        async with httpx.AsyncClient(verify=ssl_context, timeout=2.0) as scraper:
            for _ in range(3):
                response = await scraper.get(f"https://{running.metrics_address}/metrics")
                assert "kvbroker_hints_total" in response.text
    finally:
        for writer in idle:
            writer.close()
        await running.stop(grace=0.1)


async def test_a_replica_with_credentials_and_no_way_to_forward_does_not_start(
    tmp_path: Path,
) -> None:
    """Its leader would refuse every call it forwards: neither the shared token nor a client
    certificate. It says what to add instead of starting."""
    (tmp_path / "credentials").write_text(f"router {DIGEST}\n")
    refused = await serve_refused(
        "--credentials", str(tmp_path / "credentials"),
        "--store", f"etcd://127.0.0.1:{free_port()}",
    )  # fmt: skip
    assert refused.code == 2, refused.stderr
    assert "--token" in refused.stderr and "--tls-client-ca" in refused.stderr
    assert "Traceback" not in refused.stderr
