"""vLLM's ``vllm-router`` (the Rust P/D router from the package index) in front of kvbroker's
engines, as a fleet runs it: P/D disaggregation, consistent hashing on the session id.

What it forwards decides what reuse gets behind it (checked against 0.1.17): it hashes on the
``X-Session-ID`` header but forwards no client header to the engines; the body's
``session_id`` (and ``vllm_xargs``) reaches the prefill leg only. So clients send the session
id in the body as well, the prefill engine resolves the handle from it, and kvbroker's
connector carries it to the decode engine in the transfer parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from kvbroker.common.process.ports import free_port
from kvbroker.common.process.tasks import poll_until


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` launcher of this environment, or on PATH (None: not installed)."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


@contextlib.asynccontextmanager
async def running_vllm_router(
    prefills: list[str], decodes: list[str], log: Path, ready_within_s: float = 60
) -> AsyncIterator[str]:
    """``vllm-router`` over the engines, on loopback; yields its URL once it answers."""
    binary = vllm_router_binary()
    if binary is None:
        raise RuntimeError("vllm-router is not installed: pip install 'kvbroker[dev]'")
    port = free_port()
    argv = [binary, "--vllm-pd-disaggregation", "--policy", "consistent_hash"]
    for url in prefills:
        argv += ["--prefill", url]
    for url in decodes:
        argv += ["--decode", url]
    argv += [
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(*argv, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=2) as client:

            async def answers() -> bool:
                if process.returncode is not None:
                    raise RuntimeError(f"vllm-router exited ({process.returncode}); see {log}")
                return (await client.get(url + "/health")).status_code == 200

            await poll_until(
                answers,
                ready_within_s,
                "vllm-router to answer /health",
                retrying=(httpx.HTTPError,),
            )
        yield url
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
