"""The ``kvbroker`` CLI against a registry served in its own process, as an operator uses it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import unicodedata
from pathlib import Path

import grpc
import pytest

from kvbroker.cli.sidecar import Role
from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.credentials import load_api_keys, load_session_keys
from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.labels import by_lower_label
from kvbroker.common.rules.tenants import Tenant
from kvbroker.v1 import node_pb2, registry_pb2
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from kvbroker_tools.harness.processes import RegistryProcess
from kvbroker_tools.stack import Stack, StackConfig
from tests.conftest import CliResult, run_cli, spawn_registry


async def test_operator_session(registry_process: RegistryProcess) -> None:
    address = registry_process.address
    decode = node_spec("decode-0")
    prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        stub = registry_stub(channel)
        async with Heartbeats(stub, decode, prefill):
            lease = await grant(stub, decode, "conv-cli", "req-1", tokens=512)

            table = await run_cli("lease", "ls", "--registry", address)
            assert table.code == 0, table.stderr
            assert lease.lease_id in table.stdout
            assert "conv-cli" in table.stdout and "ACTIVE" in table.stdout

            listed = await run_cli("lease", "ls", "--registry", address, "-o", "json")
            assert [item["lease_id"] for item in listed.json()] == [lease.lease_id]

            shown = await run_cli(
                "lease", "show", lease.lease_id, "--registry", address, "-o", "json"
            )
            assert shown.json()["token_count"] == 512

            renewed = await run_cli(
                "lease",
                "renew",
                lease.lease_id,
                "--ttl",
                "600",
                "--registry",
                address,
                "-o",
                "json",
            )
            assert renewed.code == 0, renewed.stderr
            assert float(renewed.json()["time_to_live"].rstrip("s")) > 590

            hinted = await run_cli("hint", "conv-cli", "--registry", address, "-o", "json")
            assert hinted.json()["decision"] == "HINT_DECISION_REUSE"
            assert hinted.json()["decode"]["node_id"] == "decode-0"
            # An operator's look-up does not claim the lease.
            again = await run_cli("hint", "conv-cli", "--registry", address)
            assert "REUSE" in again.stdout

            nodes = await run_cli("node", "ls", "--registry", address, "-o", "json")
            assert {n["spec"]["node_id"] for n in nodes.json()} == {"decode-0", "prefill-0"}

            revoked = await run_cli(
                "lease", "revoke", lease.lease_id, "--reason", "maintenance", "--registry", address
            )
            assert revoked.code == 0
            assert "REVOKED (maintenance)" in revoked.stdout
            gone = await run_cli("lease", "ls", "--registry", address)
            assert "no leases" in gone.stdout
            every = await run_cli("lease", "ls", "--all", "--registry", address, "-o", "json")
            assert every.json()[0]["state"] == "LEASE_STATE_REVOKED"

            drained = await run_cli("node", "drain", "decode-0", "--registry", address)
            assert drained.code == 0 and "DRAINING" in drained.stdout


async def test_drain_wait_returns_once_drained_and_fails_on_its_timeout(
    registry_process: RegistryProcess,
) -> None:
    """``node drain --wait`` (a decode pod's preStop hook): it waits while a read holds a
    claimed lease, exits 4 when its --timeout passes first, and 0 once the claim is over and
    a heartbeat reports nothing running."""
    address = registry_process.address
    decode = node_spec("decode-0")
    prefill = node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        stub = registry_stub(channel)
        async with Heartbeats(stub, decode, prefill):
            lease = await grant(stub, decode, "conv-drain", "req-1", tokens=512)
            claimed = await run_cli("hint", "conv-drain", "--claim", "--registry", address)
            assert claimed.code == 0 and "REUSE" in claimed.stdout
            late = await run_cli(
                "node", "drain", "decode-0", "--wait", "--timeout", "1", "--registry", address
            )
            assert late.code == 4, late.stderr
            assert "not drained within 1s" in late.stderr and "1 live leases" in late.stderr
            await stub.ReleaseLease(
                registry_pb2.ReleaseLeaseRequest(
                    lease_id=lease.lease_id,
                    node_id=decode.node_id,
                    node_incarnation=decode.incarnation,
                    reason="read",
                )
            )
            done = await run_cli(
                "node", "drain", "decode-0", "--wait", "--registry", address, "-o", "json"
            )
            assert done.code == 0, done.stderr
            assert done.json()["drained"] and "decode-0: drained" in done.stderr


# Control characters a terminal obeys: OSC (retitle the window, ended by BEL), CSI (clear the
# screen) as ESC [, and CSI as the single C1 character U+009B.
_OSC, _CSI, _C1_CSI = "\x1b]0;owned\x07", "\x1b[2J", "\x9b31m"


def _printable(output: str) -> str:
    """``output``, checked to hold no control character but the lines' ends."""
    assert not [c for c in output if unicodedata.category(c) == "Cc" and c != "\n"], output
    return output


async def test_stored_control_characters_print_as_escapes(
    registry_process: RegistryProcess,
) -> None:
    """Ids, models and reasons are the clients' text and the registry stores them as given
    (URLs it refuses with control characters): the tables show their control characters as
    escapes (never raw, where a terminal would act on them), and JSON keeps them exact."""
    address = registry_process.address
    decode = node_spec(f"d{_CSI}")
    decode.model = f"m{_C1_CSI}"
    conversation = f"c{_OSC}"
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        stub = registry_stub(channel)
        async with Heartbeats(stub, decode):
            lease = await grant(stub, decode, conversation, "req-1")
            await stub.RevokeLease(
                registry_pb2.RevokeLeaseRequest(lease_id=lease.lease_id, reason=f"r{_C1_CSI}"),
                timeout=5,
            )
            nodes = await run_cli("node", "ls", "--registry", address)
            leases = await run_cli("lease", "ls", "--all", "--registry", address)
            shown = await run_cli("lease", "show", lease.lease_id, "--registry", address)
            missing = await run_cli("node", "get", f"gone{_CSI}", "--registry", address)
            as_json = await run_cli("node", "ls", "--registry", address, "-o", "json")
    assert nodes.code == leases.code == shown.code == 0, nodes.stderr + leases.stderr
    assert "d\\x1b[2J" in _printable(nodes.stdout) and "m\\x9b31m" in nodes.stdout
    assert "c\\x1b]0;owned\\x07" in _printable(leases.stdout)
    assert "r\\x9b31m" in _printable(shown.stdout) and "c\\x1b]0;owned" in shown.stdout
    assert missing.code == 1 and "gone\\x1b[2J" in _printable(missing.stderr)
    [node] = as_json.json()
    assert node["spec"]["node_id"] == decode.node_id
    assert node["spec"]["model"] == decode.model


async def test_clear_errors_and_exit_codes(registry_process: RegistryProcess) -> None:
    address = registry_process.address
    missing = await run_cli("lease", "show", "no-such-lease", "--registry", address)
    assert missing.code == 1
    assert "lease 'no-such-lease' does not exist" in missing.stderr
    assert "NOT_FOUND" in missing.stderr

    no_conv = await run_cli("lease", "renew", "ghost", "--conversation", "--registry", address)
    assert no_conv.code == 1 and "conversation 'ghost' is unknown" in no_conv.stderr

    bad_address = await run_cli("lease", "ls", "--registry", "not-an-address")
    assert bad_address.code == 2 and "is not HOST:PORT" in bad_address.stderr

    bad_state = await run_cli("lease", "ls", "--state", "sleepy", "--registry", address)
    assert bad_state.code == 2 and "unknown state 'sleepy'" in bad_state.stderr

    await registry_process.stop()
    down = await run_cli("node", "ls", "--registry", address, "--timeout", "1")
    assert down.code == 3
    assert f"cannot reach the registry at {address}" in down.stderr


async def test_stored_strings_print_as_they_are_not_as_markup(
    registry_process: RegistryProcess,
) -> None:
    """Node ids, conversation ids and reasons come from users: rich must not read them as
    markup (a "[/]" raised, so a revoke that had succeeded exited 1)."""
    address = registry_process.address
    decode = node_spec("decode-[/]0")
    async with open_channel(RegistryEndpoint.parse(address)) as channel:
        stub = registry_stub(channel)
        async with Heartbeats(stub, decode):
            lease = await grant(stub, decode, "conv-[bold]x", "req-1")
            nodes = await run_cli("node", "ls", "--registry", address)
            assert nodes.code == 0, nodes.stderr
            assert "decode-[/]0" in nodes.stdout
            listed = await run_cli("lease", "ls", "--registry", address)
            assert listed.code == 0, listed.stderr
            assert "decode-[/]0" in listed.stdout and "conv-[bold]x" in listed.stdout
            revoked = await run_cli(
                "lease", "revoke", lease.lease_id, "--reason", "[bold]done[/] [/]",
                "--registry", address,
            )  # fmt: skip
            assert revoked.code == 0, revoked.stderr
            assert "REVOKED ([bold]done[/] [/])" in revoked.stdout
            assert "decode-[/]0" in revoked.stdout
    missing = await run_cli("lease", "show", "[/]gone[red]", "--registry", address)
    assert missing.code == 1 and "lease '[/]gone[red]' does not exist" in missing.stderr


async def test_a_refusal_with_unavailable_is_not_an_unreachable_registry(
    registry_process: RegistryProcess,
) -> None:
    """The registry answers UNAVAILABLE with a reason when no node can take a turn: it was
    reached, and said no."""
    hinted = await run_cli("hint", "conv", "--claim", "--registry", registry_process.address)
    assert hinted.code == 1
    assert "NO_READY_NODE" in hinted.stderr and "cannot reach" not in hinted.stderr


def usage_error(result: CliResult, flag: str) -> None:
    """Exit 2 with a message naming ``flag`` on one line, and no traceback."""
    assert result.code == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert any(flag in line and "Invalid value" in line for line in result.stderr.splitlines())


@pytest.mark.parametrize(
    "args",
    [
        ("lease", "renew", "x", "--ttl", "inf"),
        ("lease", "renew", "x", "--ttl", "nan"),
        ("lease", "renew", "x", "--ttl", "-1"),
        ("lease", "renew", "x", "--ttl", "1e20"),
        ("node", "ls", "--timeout", "-1"),
        ("node", "ls", "--timeout", "0"),
        ("hint", "c", "--timeout", "inf"),
        ("node", "ls", "--timeout", "1e20"),
        ("node", "ls", "--tls-ca", __file__),
        ("node", "ls", "--tls-ca", "/no/such/ca.pem"),
        ("node", "ls", "--token-file", "/no/such/token"),
        ("registry", "serve", "--listen", "bogus"),
        ("registry", "serve", "--listen", "127.0.0.1:0", "--lease-ttl", "inf"),
        ("registry", "serve", "--listen", "127.0.0.1:0", "--claim-timeout", "-5"),
        ("registry", "serve", "--listen", "127.0.0.1:0", "--max-lease-ttl", "1e300"),
        ("registry", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "9090"),
        (
            "sidecar",
            "run",
            "--engine-url",
            "http://127.0.0.1:1",
            "--role",
            "decode",
            "--listen",
            "bogus",
        ),
    ],
    ids=" ".join,
)
async def test_bad_flags_are_usage_errors(args: tuple[str, ...]) -> None:
    """Refused while the flags are read, before anything is reached or served."""
    usage_error(await run_cli(*args), next(a for a in reversed(args) if a.startswith("--")))


async def test_serving_on_a_port_in_use_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "{}:{}".format(*taken.getsockname())
        result = await run_cli("registry", "serve", "--listen", address)
    assert result.code == 1 and "Traceback" not in result.stderr
    assert f"cannot serve on {address}" in result.stderr and "in use" in result.stderr


async def test_a_second_registry_on_the_same_port_is_refused(
    registry_process: RegistryProcess,
) -> None:
    """gRPC binds with SO_REUSEPORT: without the check the second would share the port."""
    result = await run_cli("registry", "serve", "--listen", registry_process.address)
    assert result.code == 1 and "in use" in result.stderr


async def test_registry_serve_refuses_bad_store_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bogus = await run_cli("registry", "serve", "--listen", "127.0.0.1:0", "--store", "redis://x")
    assert bogus.code == 2 and "neither 'memory' nor etcd://HOST:PORT" in bogus.stderr
    no_port = await run_cli("registry", "serve", "--store", "etcd://localhost")
    assert no_port.code == 2 and "etcd member 'localhost' is not HOST:PORT" in no_port.stderr
    (tmp_path / "c.pem").write_text("x")
    tls = await run_cli(
        "registry", "serve", "--listen", "127.0.0.1:0", "--store", "etcd://127.0.0.1:1",
        "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "c.pem"),
    )  # fmt: skip
    assert tls.code == 2 and "replicas over TLS verify each other" in tls.stderr


async def test_environment_configures_the_cli(registry_process: RegistryProcess) -> None:
    result = await run_cli(
        "node", "ls", env={"KVBROKER_REGISTRY": registry_process.address, "KVBROKER_OUTPUT": "json"}
    )
    assert result.code == 0, result.stderr
    assert result.json() == []


async def test_bearer_token_is_enforced(tmp_path: Path) -> None:
    secured = await spawn_registry("--token", "s3cret")
    try:
        denied = await run_cli("node", "ls", "--registry", secured.address)
        assert denied.code == 1
        assert "UNAUTHENTICATED" in denied.stderr and "bearer token" in denied.stderr
        wrong = await run_cli("node", "ls", "--registry", secured.address, "--token", "guess")
        assert wrong.code == 1 and "UNAUTHENTICATED" in wrong.stderr
        allowed = await run_cli("node", "ls", "--registry", secured.address, "--token", "s3cret")
        assert allowed.code == 0, allowed.stderr

        token_file = tmp_path / "token"
        token_file.write_text("s3cret\n")
        from_file = await run_cli(
            "node", "ls", "--registry", secured.address, "--token-file", str(token_file)
        )
        assert from_file.code == 0, from_file.stderr
        from_env = await run_cli(
            "lease", "ls", "--registry", secured.address,
            env={"KVBROKER_TOKEN_FILE": str(token_file)},
        )  # fmt: skip
        assert from_env.code == 0, from_env.stderr
        both = await run_cli(
            "node", "ls", "--registry", secured.address, "--token", "s3cret",
            "--token-file", str(token_file),
        )  # fmt: skip
        assert both.code == 2 and "not both" in both.stderr
        (tmp_path / "empty").write_text("\n")
        empty = await run_cli("node", "ls", "--token-file", str(tmp_path / "empty"))
        assert empty.code == 2 and "is empty" in empty.stderr

        # Health probes need no token.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with grpc.aio.insecure_channel(secured.address) as channel:
            status = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvbroker.v1.RegistryService"), timeout=5
            )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await secured.stop()


async def test_the_stack_hands_its_token_over_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never in argv, which every user can read in the process list; a token file this
    process was given is not inherited beside it."""
    (tmp_path / "token").write_text("s3cret")
    stack = Stack(StackConfig(workdir=tmp_path, token="s3cret"))
    registry = stack.registry_child("registry", stack.registry_address, [])
    children = [registry, stack.sidecar_child(stack.decode), stack.router_child()]
    for child in children:
        assert not any("s3cret" in arg for arg in child.argv), child.name
        assert child.env["KVBROKER_TOKEN"] == "s3cret"
    monkeypatch.setenv("KVBROKER_TOKEN_FILE", str(tmp_path / "token"))
    await registry.start()
    monkeypatch.delenv("KVBROKER_TOKEN_FILE")
    try:

        async def refuses_without_token() -> bool:
            listed = await run_cli("node", "ls", "--registry", stack.registry_address)
            return listed.code == 1 and "UNAUTHENTICATED" in listed.stderr

        await poll_until(refuses_without_token, 30, "the registry up, asking for the token")
        allowed = await run_cli(
            "node", "ls", "--registry", stack.registry_address, env={"KVBROKER_TOKEN": "s3cret"}
        )
        assert allowed.code == 0, allowed.stderr
    finally:
        await registry.stop()


async def test_serve_rejects_bad_flags() -> None:
    result = await run_cli("registry", "serve", "--tls-cert", "/nonexistent")
    assert result.code == 2 and "--tls-cert and --tls-key go together" in result.stderr
    result = await run_cli("registry", "serve", "--heartbeat-interval", "5", "--session-ttl", "1")
    assert result.code == 2 and "heartbeat interval" in result.stderr


async def test_router_refuses_a_listen_address_without_a_port() -> None:
    result = await run_cli("router", "run", "--listen", "localhost")
    assert result.code == 2 and "--listen 'localhost' is not HOST:PORT" in result.stderr


async def test_tls_registry(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TLS end to end with a throwaway self-signed certificate for 127.0.0.1."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = await asyncio.create_subprocess_exec(
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        "-keyout", str(key), "-out", str(cert),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert await openssl.wait() == 0
    secured = await spawn_registry("--tls-cert", str(cert), "--tls-key", str(key))
    try:
        trusted = await run_cli("node", "ls", "--registry", secured.address, "--tls-ca", str(cert))
        assert trusted.code == 0, trusted.stderr
        plain = await run_cli("node", "ls", "--registry", secured.address, "--timeout", "1")
        assert plain.code == 3  # a plaintext client cannot talk to a TLS registry
    finally:
        await secured.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two self-signed certificates with their keys, and files that are not what they claim:
    garbage, an encrypted key, and a path that does not exist."""
    root = tmp_path_factory.mktemp("tls")
    for name in ("a", "b"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=127.0.0.1", "-keyout", str(root / f"{name}.key"),
             "-out", str(root / f"{name}.pem")],
            check=True, capture_output=True,
        )  # fmt: skip
    subprocess.run(
        ["openssl", "genrsa", "-aes128", "-passout", "pass:x", "-out", str(root / "enc.key")],
        check=True,
        capture_output=True,
    )
    (root / "garbage").write_bytes(b"\x00\xffnot a PEM file\n")
    return {
        "cert": root / "a.pem",
        "key": root / "a.key",
        "other_key": root / "b.key",
        "encrypted_key": root / "enc.key",
        "garbage": root / "garbage",
        "missing": root / "missing.pem",
    }


@pytest.mark.parametrize(
    ("cert", "key", "ca", "named", "says"),
    [
        ("cert", "garbage", None, "garbage", "holds no unencrypted PEM private key"),
        ("cert", "encrypted_key", None, "encrypted_key", "holds no unencrypted PEM private key"),
        ("cert", "cert", None, "cert", "holds no unencrypted PEM private key"),
        ("garbage", "key", None, "garbage", "holds no PEM certificate"),
        ("key", "key", None, "key", "holds no PEM certificate"),
        ("missing", "key", None, "missing", "cannot read the certificate file"),
        ("cert", "missing", None, "missing", "cannot read the private key file"),
        ("cert", "other_key", None, "other_key", "is not the key of the certificate"),
        ("cert", "key", "garbage", "garbage", "the CA file"),
        ("cert", "key", "missing", "missing", "cannot read the CA file"),
    ],
)
async def test_bad_tls_files_are_one_sentence_naming_the_file(
    tls_files: dict[str, Path], cert: str, key: str, ca: str | None, named: str, says: str
) -> None:
    """The registry's --tls-cert/--tls-key/--tls-client-ca, the sidecar's --metrics-tls-*
    and a client's --tls-client-cert/--tls-client-key: a wrong file is refused before
    anything is served or called, in one line naming it, with no traceback."""
    server = ["--tls-cert", str(tls_files[cert]), "--tls-key", str(tls_files[key])]
    if ca is not None:
        server += ["--tls-client-ca", str(tls_files[ca])]
    sidecar = [f"--metrics-{flag[2:]}" if flag.startswith("--") else flag for flag in server]
    runs = [
        await run_cli("registry", "serve", "--listen", "127.0.0.1:0", *server),
        await run_cli(
            "sidecar", "run", "--engine-url", "http://127.0.0.1:1", "--role", "decode",
            "--listen", "unix:" + str(tls_files["cert"].parent / "s.sock"),
            "--registry", "127.0.0.1:1", "--metrics-listen", "127.0.0.1:0", *sidecar,
        ),
    ]  # fmt: skip
    if key in ("other_key", "encrypted_key"):
        # A client's key that is a PEM key but not the one (other files: flag checks).
        runs.append(
            await run_cli(
                "node", "ls", "--registry", "127.0.0.1:1", "--tls-ca", str(tls_files["cert"]),
                "--tls-client-cert", str(tls_files[cert]),
                "--tls-client-key", str(tls_files[key]),
            )
        )  # fmt: skip
    for result in runs:
        assert result.code == 2, result.stderr
        assert "Traceback" not in result.stderr
        [line] = result.stderr.splitlines()
        assert line.startswith("error: ") and says in line and str(tls_files[named]) in line


def test_sidecar_roles_are_the_node_role_labels() -> None:
    assert [role.value for role in Role] == list(by_lower_label(node_pb2.NodeRole))


async def test_a_tenant_s_key_its_files_lines_and_its_signed_session_ids(tmp_path: Path) -> None:
    """``kvbroker tenant key`` prints a key and the lines the keys file and the session keys
    file accept for it; ``tenant session-id`` signs with the key from the environment, and
    only the tenant's session key verifies the result."""
    made = await run_cli("tenant", "key", "acme")
    assert made.code == 0, made.stderr
    printed = dict(line.split(":", 1) for line in made.stdout.splitlines())
    key = printed["key"].strip()
    (tmp_path / "api-keys").write_text(printed["api-keys line"].strip() + "\n")
    (tmp_path / "session-keys").write_text(printed["session-keys line"].strip() + "\n")
    assert load_api_keys(tmp_path / "api-keys").tenant(f"Bearer {key}") == Tenant("acme")
    session_keys = load_session_keys(tmp_path / "session-keys")

    signed = await run_cli(
        "tenant", "session-id", "conv-1", "--tenant", "acme", env={"KVBROKER_API_KEY": key}
    )
    assert signed.code == 0, signed.stderr
    assert session_keys.conversation(signed.stdout.strip()) == "acme/conv-1"
    wrong = await run_cli(
        "tenant", "session-id", "conv-1", "--tenant", "acme", env={"KVBROKER_API_KEY": "other"}
    )
    assert wrong.code == 0, wrong.stderr
    assert session_keys.conversation(wrong.stdout.strip()) == ""

    refused = await run_cli("tenant", "key", "a/b")
    assert refused.code == 2 and "tenant 'a/b'" in refused.stderr
