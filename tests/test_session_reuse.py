"""The engine's session middleware as an ASGI app in front of a recording one: a body it will
not read whole is refused with 413, never handed on cut short; a body it reads is handed on
whole, however it arrived; a client gone mid-body gets nothing sent and the engine no request;
with a keys file, a session is its key's tenant's and a request without a key is a plain turn;
with session keys, a signed session id resolves only when its signature is its tenant's.
(The resolving itself runs on real engines in tests/test_e2e_fleets.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbroker.common.process.credentials import fresh_credential
from kvbroker.common.rules.tenants import SessionKeys, Tenant, session_key, sign_session
from kvbroker.engine_ext import session_reuse
from kvbroker.engine_ext.session_reuse import Message, Receive, Scope, Send, SessionReuse
from kvbroker.engine_ext.settings import KvBrokerSettings

LIMIT = 1024


class Engine:
    """The app behind the middleware: records the body it was handed."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.bodies.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def scope() -> Scope:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"x-session-id", b"conv-1"), (b"content-type", b"application/json")],
    }


async def call(chunks: list[bytes], disconnect: bool = False) -> tuple[Engine, list[Message]]:
    """Sends ``chunks`` as one request (then a disconnect, if asked) through the middleware."""
    engine = Engine()
    messages: list[Message] = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1 or disconnect}
        for i, chunk in enumerate(chunks)
    ]
    if disconnect:
        messages.append({"type": "http.disconnect"})
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await SessionReuse(engine)(scope(), receive, send)
    return engine, sent


@pytest.fixture(autouse=True)
def small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_reuse, "MAX_BODY_BYTES", LIMIT)


def body_of(size: int) -> bytes:
    """A JSON chat request of ``size`` bytes."""
    head = b'{"model": "m", "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


async def test_a_body_over_the_limit_is_refused_never_cut_short() -> None:
    raw = body_of(3 * LIMIT)
    engine, sent = await call([raw[i : i + 500] for i in range(0, len(raw), 500)])
    assert engine.bodies == []  # the engine never saw a part of it
    assert sent[0]["status"] == 413
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "request_too_large"
    assert str(LIMIT) in error["message"]


@pytest.mark.parametrize("chunk", [LIMIT, 100, 7])
async def test_a_body_within_the_limit_is_handed_on_whole(chunk: int) -> None:
    raw = body_of(LIMIT)
    engine, sent = await call([raw[i : i + chunk] for i in range(0, len(raw), chunk)])
    assert engine.bodies == [raw]
    assert sent[0]["status"] == 200


async def test_a_client_gone_mid_body_sends_the_engine_nothing() -> None:
    engine, sent = await call([body_of(LIMIT)[:100]], disconnect=True)
    assert engine.bodies == []
    assert sent == []


def keyed(tmp_path: Path) -> tuple[SessionReuse, Engine, str]:
    """The middleware of an engine given a keys file with tenant ``acme``'s key."""
    token, line = fresh_credential("acme")
    keys = tmp_path / "api-keys"
    keys.write_text(line + "\n")
    engine = Engine()
    middleware = SessionReuse(engine)
    # What the engine's connector settings say (vLLM's app state is not here).
    middleware._read_settings = KvBrokerSettings(api_keys=str(keys))
    return middleware, engine, token


async def send_through(
    middleware: SessionReuse, body: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> list[Message]:
    messages: list[Message] = [{"type": "http.request", "body": json.dumps(body).encode()}]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await middleware({**scope(), "headers": headers}, receive, send)
    return sent


CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_keyed_engine_scopes_the_session_to_the_key_s_tenant(tmp_path: Path) -> None:
    """With a keys file, the session a request names is its key's tenant's (``acme/...``),
    wherever vLLM would read it; another tenant's conversation cannot be named, whatever the
    session id holds."""
    middleware, engine, token = keyed(tmp_path)
    for headers, body in (
        ([(b"authorization", f"Bearer {token}".encode())], {**CHAT, "session_id": "conv-1"}),
        ([(b"x-api-key", token.encode()), (b"x-session-id", b"conv-1")], CHAT),
        ([(b"authorization", f"Bearer {token}".encode())], {**CHAT, "session_id": "globex/c"}),
    ):
        sent = await send_through(middleware, body, headers)
        assert sent[0]["status"] == 200
        received = json.loads(engine.bodies[-1])
        session = body.get("session_id", "conv-1")
        assert received["session_id"] == f"acme/{session}"


async def test_a_keyed_engine_serves_a_request_without_a_key_as_a_plain_turn(
    tmp_path: Path,
) -> None:
    """No key (a router that forwards none): the session is removed wherever vLLM reads one,
    so the turn neither resolves nor retains anything of the conversation it names; a key the
    file does not hold is refused (401)."""
    middleware, engine, _ = keyed(tmp_path)
    body = {**CHAT, "session_id": "acme/conv-1", "vllm_xargs": {"session_id": "acme/conv-1"}}
    sent = await send_through(middleware, body, [(b"x-session-id", b"acme/conv-1")])
    assert sent[0]["status"] == 200
    received = json.loads(engine.bodies[-1])
    assert "session_id" not in received and received["vllm_xargs"] == {}
    sent = await send_through(
        middleware, {**CHAT, "session_id": "c"}, [(b"authorization", b"Bearer wrong")]
    )
    assert sent[0]["status"] == 401
    assert json.loads(sent[1]["body"])["error"]["type"] == "invalid_api_key"
    assert len(engine.bodies) == 1  # the refused one never reached the engine


async def test_an_open_engine_takes_session_ids_as_given(tmp_path: Path) -> None:
    engine = Engine()
    sent = await send_through(SessionReuse(engine), {**CHAT, "session_id": "acme/conv-1"}, [])
    assert sent[0]["status"] == 200
    assert json.loads(engine.bodies[-1])["session_id"] == "acme/conv-1"


def signing(tmp_path: Path) -> tuple[SessionReuse, Engine, dict[str, str]]:
    """The middleware of an engine given only the session keys of tenants ``acme`` and
    ``globex`` (as behind ``vllm-router``, which forwards no key); their API keys."""
    keys = {"acme": "acme-api-key", "globex": "globex-api-key"}
    session_keys = tmp_path / "session-keys"
    session_keys.write_text("".join(f"{t} {session_key(k)}\n" for t, k in keys.items()))
    engine = Engine()
    middleware = SessionReuse(engine)
    middleware._read_settings = KvBrokerSettings(session_keys=str(session_keys))
    return middleware, engine, keys


async def test_a_signed_session_id_resolves_only_its_own_tenant_s_conversation(
    tmp_path: Path,
) -> None:
    """A session id signed with the tenant's key names ``TENANT/SESSION``; one signed with
    another tenant's key, tampered with, or not signed at all names nothing (a plain turn)."""
    middleware, engine, keys = signing(tmp_path)
    acme, globex = Tenant("acme"), Tenant("globex")
    own = sign_session(keys["globex"], globex, "conv-b")
    forged = sign_session(keys["acme"], globex, "conv-b")  # acme's key, globex's name
    tampered = own.replace("conv-b", "conv-c")
    for session, resolved in (
        (own, "globex/conv-b"),
        (sign_session(keys["acme"], acme, "conv-a"), "acme/conv-a"),
        (forged, None),
        (tampered, None),
        ("globex/conv-b", None),
        ("conv-b", None),
    ):
        sent = await send_through(middleware, {**CHAT, "session_id": session}, [])
        assert sent[0]["status"] == 200
        assert json.loads(engine.bodies[-1]).get("session_id") == resolved, session


async def test_a_key_s_client_cannot_use_another_tenant_s_signed_session_id(
    tmp_path: Path,
) -> None:
    """With both files, a request with acme's key and a session id globex signed resolves
    nothing: a key's client names only its own tenant's conversations."""
    middleware, engine, keys = signing(tmp_path)
    token, line = fresh_credential("acme")
    api_keys = tmp_path / "api-keys"
    api_keys.write_text(line + "\n")
    middleware._read_settings = KvBrokerSettings(
        api_keys=str(api_keys), session_keys=str(tmp_path / "session-keys")
    )
    headers = [(b"authorization", f"Bearer {token}".encode())]
    theirs = sign_session(keys["globex"], Tenant("globex"), "conv-b")
    sent = await send_through(middleware, {**CHAT, "session_id": theirs}, headers)
    assert sent[0]["status"] == 200
    assert "session_id" not in json.loads(engine.bodies[-1])
    ours = sign_session(keys["acme"], Tenant("acme"), "conv-a")
    await send_through(middleware, {**CHAT, "session_id": ours}, headers)
    assert json.loads(engine.bodies[-1])["session_id"] == "acme/conv-a"


def test_a_signed_session_id_is_made_only_for_a_named_tenant_within_its_limit() -> None:
    """The id names a tenant and a session, its conversation fits the id limit, and a
    session holding the separator reads back whole."""
    acme = Tenant("acme")
    with pytest.raises(ValueError, match="names a tenant"):
        sign_session("key", Tenant(), "conv-1")
    with pytest.raises(ValueError, match="names a session"):
        sign_session("key", acme, "")
    with pytest.raises(ValueError, match="limit is"):
        sign_session("key", acme, "x" * (acme.id_limit + 1))
    keys = SessionKeys.of({session_key("key"): acme})
    assert keys.conversation(sign_session("key", acme, "a~b/c")) == "acme/a~b/c"
    assert keys.conversation(sign_session("key", acme, "x" * acme.id_limit)) != ""
