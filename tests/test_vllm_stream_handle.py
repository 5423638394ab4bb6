"""A streamed chat completion from vLLM's own OpenAI server, through the router's stream relay:
the client never sees the decode engine's ``kv_transfer_params``.

vLLM 0.33 put them on a chat stream's final chunk (0.32 sent them only in a whole answer), so
the decode node's NIXL address, request and block ids would reach the client unless the router
strips them there too (``router.relay``). Here the answer is vLLM's own: its FastAPI app as
``vllm serve`` builds it (``build_app``, ``init_app_state``), over vLLM's ``AsyncLLM`` and a
real engine core with kvbroker's connector retaining the turn, and the test model's worker
replaced by ``tests.test_engine_core_idle.FakeWorker`` (the CUDA wheels of 0.33 and 0.34 run
no worker without a GPU). The bytes go through ``relay``, the function the router streams a
decode leg with. Runs on 0.32 and, in ``make compat``, on 0.33 and 0.34.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app
from vllm.platforms import current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.rules import handles
from kvbroker.engine_ext.vllm_compat import VLLM_SERIES
from kvbroker.router.proxy import Router
from kvbroker.router.relay import HANDLE_KEY, relay
from kvbroker.router.requests import CHAT
from kvbroker.v1 import node_pb2
from tests.test_engine_core_idle import STEP_LOG, decode_engine_config

try:  # where vLLM keeps ``vllm serve``'s argument parser: 0.33 moved it
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # 0.33, 0.34 (mypy runs on 0.32)
    from vllm.entrypoints.common.cli_args import (  # type: ignore[import-not-found, no-redef, unused-ignore]
        make_arg_parser,
    )


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AsyncLLM]:
    monkeypatch.setenv(STEP_LOG, str(tmp_path / "steps.log"))
    llm = AsyncLLM(decode_engine_config(tokenizer=True), UniProcExecutor, log_stats=False)
    try:
        yield llm
    finally:
        llm.shutdown()


async def vllm_server(llm: AsyncLLM) -> Any:
    """vLLM's OpenAI app over ``llm``, as ``vllm serve`` builds it (its default arguments)."""
    model = llm.vllm_config.model_config
    with pytest.MonkeyPatch.context() as patch:
        # The parser builds vLLM's default configs, whose device is the platform's; a CUDA
        # wheel on a machine without a GPU finds none (the engine's own config says "cpu").
        patch.setattr(current_platform, "device_type", current_platform.device_type or "cpu")
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model.model])
    tasks = await llm.get_supported_tasks()
    app = build_app(args, tasks, model)
    await init_app_state(llm, app.state, args, tasks)
    return app


def events(stream: bytes) -> list[str]:
    """A server-sent event stream's ``data:`` payloads, in order."""
    return [
        line.removeprefix("data:").strip()
        for event in stream.decode().split("\n\n")
        for line in event.splitlines()
        if line.startswith("data:")
    ]


async def test_a_streamed_turn_s_final_chunk_reaches_the_client_without_the_handle(
    engine: AsyncLLM,
) -> None:
    app = await vllm_server(engine)
    body = {
        "model": engine.vllm_config.model_config.model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 3,
        "stream": True,
        "session_id": "conversation-1",  # the decode engine retains the turn under it
        HANDLE_KEY: handles.decode_local_params(),
    }
    router = Router(registry=RegistryEndpoint(["127.0.0.1:1"]))  # relay reads its metrics only
    node = node_pb2.NodeSpec(node_id="decode-0")
    upstream = bytearray()

    async def recorded(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            upstream.extend(chunk)
            yield chunk

    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://decode-0") as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        chunks = recorded(response.aiter_raw())
        first = await anext(chunks)
        relayed = b"".join(
            [
                event
                async for event in relay(
                    router, response, first, chunks, node, time.perf_counter(), CHAT.errors
                )
            ]
        )

    sent, received = events(bytes(upstream)), events(relayed)
    assert sent[-1] == received[-1] == "[DONE]"
    chunks_sent = [json.loads(data) for data in sent[:-1]]
    final = [c for c in chunks_sent if any(ch.get("finish_reason") for ch in c["choices"])]
    assert len(final) == 1
    if VLLM_SERIES == "0.32":
        assert HANDLE_KEY not in final[0]  # 0.32 streams no handle: nothing to strip
    else:
        # vLLM's own final chunk carries the decode engine's handle to the retained turn ...
        handle = handles.handle_from_params(final[0][HANDLE_KEY])
        assert handle.remote_block_groups and handle.remote_block_groups[0].block_ids
    # ... and the client gets every event, the same but for the handle.
    assert HANDLE_KEY.encode() not in relayed
    for chunk in chunks_sent:
        chunk.pop(HANDLE_KEY, None)
    assert [json.loads(data) for data in received[:-1]] == chunks_sent
