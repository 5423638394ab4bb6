"""A stand-in for the three HTTP routes a sidecar reads from its vLLM server (/health,
/metrics, /v1/models), so sidecar tests can make the engine healthy or not at will. The
end-to-end tests run real vLLM servers instead."""

from __future__ import annotations

import asyncio
import json


class EngineHttp:
    def __init__(self, model: str = "tiny-qwen3") -> None:
        self.model = model
        self.healthy = True
        self.running = 0
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> EngineHttp:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_line = (await reader.readline()).decode()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        path = request_line.split(" ")[1] if " " in request_line else "/"
        status, body = "404 Not Found", b""
        if path == "/health":
            status = "200 OK" if self.healthy else "503 Service Unavailable"
        elif path == "/metrics":
            status = "200 OK"
            body = (
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.25\n'
            ).encode()
        elif path == "/v1/models":
            status = "200 OK"
            body = json.dumps({"object": "list", "data": [{"id": self.model}]}).encode()
        head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()
