"""The engine's session middleware as an ASGI app in front of a recording one: a body it will
not read whole is refused with 413, never handed on cut short; a body it reads is handed on
whole, however it arrived; a client gone mid-body gets nothing sent and the engine no request.
(The resolving itself runs on real engines in tests/test_e2e_fleets.py.)"""

from __future__ import annotations

import json

import pytest

from kvbroker.engine_ext import session_reuse
from kvbroker.engine_ext.session_reuse import Message, Receive, Scope, Send, SessionReuse

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
