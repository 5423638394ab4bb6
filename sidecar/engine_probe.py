"""What the engine's HTTP server says, apart from the registry session that reports it: its
/health (readiness), its /metrics (load, and the work done between probes) and its
/v1/models (the served model). The probe keeps the last answers; a heartbeat asks for a fresh
one and waits a bounded while for it, so that it never waits long on the engine."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import structlog

from kvbroker.common.rules.engine_metrics import WorkMeter
from kvbroker.sidecar.config import SidecarConfig
from kvbroker.sidecar.engine_load import parse_vllm_load
from kvbroker.sidecar.metrics import SidecarMetrics
from kvbroker.sidecar.readiness import Probe, Readiness
from kvbroker.sidecar.session import SessionLostError
from kvbroker.v1 import node_pb2, sidecar_pb2

log = structlog.get_logger("kvbroker.sidecar")


class EngineProbe:
    def __init__(self, config: SidecarConfig, metrics: SidecarMetrics) -> None:
        self._base = config.engine_url.rstrip("/")
        self._metrics = metrics
        self._http = httpx.AsyncClient(timeout=config.health_timeout_s)
        self._readiness = Readiness(config.unready_after_timeouts)
        # The attached engine's, to count its reads in blocks; none is attached before.
        self._bytes_per_block = 0
        # What the last probe read off the engine's /metrics.
        self._load = node_pb2.NodeLoad()
        # Why the last /metrics answer's figures were ignored, if they were.
        self._ignored_figures: tuple[str, ...] = ()
        # The engine's work between probes, until a heartbeat carries it.
        self._work = WorkMeter()
        # The probe in flight, if one is.
        self._probing: asyncio.Task[None] | None = None

    def attach(self, info: sidecar_pb2.EngineInfo, another_process: bool) -> None:
        """The engine (re)attached; another process's metrics began again."""
        if another_process:
            self._work = WorkMeter()
        self._bytes_per_block = info.bytes_per_block

    @property
    def ready(self) -> bool:
        return self._readiness.ready

    @property
    def load(self) -> node_pb2.NodeLoad:
        return self._load

    def take_work(self) -> node_pb2.EngineWork | None:
        """The engine's work since the last take (``WorkMeter.take``)."""
        return self._work.take()

    async def probe(self) -> None:
        """vLLM's /health for readiness (``Readiness`` decides) and /metrics for load and the
        work done since the last probe. One probe at a time: a call while one is in flight
        waits for that one."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.create_task(self._probe_once())
        await asyncio.shield(self._probing)

    async def fresh_load(self, within_s: float) -> node_pb2.NodeLoad:
        """The engine's load as a probe begun now reads it, when the engine answers within
        ``within_s``; else the last known one, while that probe goes on: a slow engine holds a
        heartbeat back by ``within_s`` at most."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.probe(), within_s)
        return self._load

    async def _probe_once(self) -> None:
        self._load = await self._read()
        self._metrics.engine_ready.set(1 if self.ready else 0)

    async def _read(self) -> node_pb2.NodeLoad:
        """The engine's load, its readiness and work noted on the way (``Readiness``,
        ``WorkMeter``)."""
        try:
            health = await self._http.get(f"{self._base}/health")
        except httpx.TimeoutException:
            self._readiness.observe(Probe.TIMED_OUT)
            return self._load  # the last known load
        except httpx.HTTPError:
            self._readiness.observe(Probe.UNHEALTHY)
            return node_pb2.NodeLoad()
        if health.status_code != 200:
            self._readiness.observe(Probe.UNHEALTHY)
            return node_pb2.NodeLoad()
        self._readiness.observe(Probe.HEALTHY)
        try:
            metrics = await self._http.get(f"{self._base}/metrics")
        except httpx.HTTPError:
            return node_pb2.NodeLoad()
        if metrics.status_code != 200:
            return node_pb2.NodeLoad()
        parsed = parse_vllm_load(metrics.text)
        if parsed.ignored and parsed.ignored != self._ignored_figures:
            # Once per change, not once per probe: a broken /metrics stays broken a while.
            log.warning("engine_metrics_ignored", ignored=list(parsed.ignored))
        self._ignored_figures = parsed.ignored
        self._work.observe(parsed.totals, self._bytes_per_block)
        return parsed.load

    async def served_model(self) -> str:
        try:
            models = (await self._http.get(f"{self._base}/v1/models")).json()
            return str(models["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise SessionLostError(
                f"cannot learn the served model from {self._base}: {error}"
            ) from error

    async def close(self) -> None:
        await self._http.aclose()
