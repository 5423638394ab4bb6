"""`kvbroker bench placement`: what the placement hop adds to a request's latency through a real
Envoy on loopback. Two Envoys with the same chain (a picker stand-in, ORIGINAL_DST to fake
engines), one with kvbroker's ext_proc in front of the picker and one without, take the same
open-loop load (requests sent on a fixed schedule, not when the last one answered), the arms
interleaved second by second so that the machine's background load falls on both alike.

The hop and the registry run as their own processes (``kvbroker placement serve``,
``kvbroker registry serve``), as deployed; half the requests continue conversations that hold
KV on a decode node (the hop pins them), half are new (the registry says MISS). The added
latency is the difference of the two arms' quantiles.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import uvloop
from rich.console import Console
from rich.table import Table

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.supervisor import Announces, ChildProcess
from kvbroker.v1 import node_pb2
from kvbroker_tools.bench.cpu import cpu_seconds
from kvbroker_tools.bench.plotting import ready_plotting, save_figure
from kvbroker_tools.bench.stats import quantile
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.envoy import Envoy, SubsetPicker
from kvbroker_tools.harness.factories import Heartbeats, grant, node_spec
from kvbroker_tools.harness.processes import PlacementProcess, RegistryProcess

ARMS = ("without", "with")
Upstream = Literal["direct", "picker"]
UPSTREAMS: tuple[Upstream, ...] = ("direct", "picker")
CHAT = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass(frozen=True)
class PlacementBenchConfig:
    rate: float = 200.0  # offered requests per second, per arm
    seconds: float = 20.0  # per arm
    conversations: int = 50  # conversations holding KV (the other half of requests is new)
    hint_timeout_s: float = 0.02
    # "direct": Envoy answers each request itself after the hop, so the arms differ by the hop
    # alone; "picker": the whole llm-d chain, a picker stand-in and fake engines behind Envoy.
    upstream: Upstream = "direct"


@dataclass(frozen=True)
class ArmResult:
    arm: str
    requests: int
    errors: int  # not a 200
    throughput: float  # answered per second
    p50_ms: float
    p99_ms: float
    # CPU per answered request of the hop's and the registry's processes (0 without the hop).
    hop_cpu_ms: float = 0.0
    registry_cpu_ms: float = 0.0


def summarise(
    arm: str, latencies: list[float], errors: int, seconds: float, cpu: tuple[float, float]
) -> ArmResult:
    per_request = 1000 / max(len(latencies), 1)
    return ArmResult(
        arm=arm,
        requests=len(latencies) + errors,
        errors=errors,
        throughput=len(latencies) / seconds,
        p50_ms=1000 * statistics.median(latencies) if latencies else float("nan"),
        p99_ms=1000 * quantile(latencies, 0.99, method="rank"),
        hop_cpu_ms=cpu[0] * per_request,
        registry_cpu_ms=cpu[1] * per_request,
    )


async def _load(
    http: httpx.AsyncClient, url: str, rate: float, seconds: float, session: Callable[[int], str]
) -> tuple[list[float], int]:
    """Open loop: request i leaves at i / rate, whatever the ones before it are doing."""
    latencies: list[float] = []
    errors = 0

    async def one(index: int) -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            answer = await http.post(url, json=CHAT, headers={"x-session-id": session(index)})
        except httpx.HTTPError:
            errors += 1
            return
        if answer.status_code == 200:
            latencies.append(time.perf_counter() - started)
        else:
            errors += 1

    tasks = []
    start = time.perf_counter()
    for index in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + index / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(index)))
    await asyncio.gather(*tasks)
    return latencies, errors


async def serve_backends() -> None:
    """The engines and the picker, in a process of their own so that the load generator's
    work does not delay them: prints their addresses as one JSON line, serves until SIGTERM."""
    engines = [FakeEngine(f"decode-{i}") for i in range(2)]
    for engine in engines:
        await engine.start()
    picker = SubsetPicker([f"127.0.0.1:{e.port}" for e in engines])
    await picker.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    endpoints = [f"127.0.0.1:{e.port}" for e in engines]
    print(json.dumps({"engines": endpoints, "picker": picker.address}), flush=True)
    await stop.wait()
    await picker.stop()
    for engine in engines:
        await engine.stop()


async def run_placement_bench(
    config: PlacementBenchConfig, workdir: Path, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    async with AsyncExitStack() as stack:
        registry = RegistryProcess(log=workdir / "registry.log")
        await registry.start()
        stack.push_async_callback(registry.stop)
        hop = PlacementProcess(
            registry.address,
            "--hint-timeout",
            str(config.hint_timeout_s),
            log=workdir / "placement.log",
        )
        await hop.start()
        stack.push_async_callback(hop.stop)
        if config.upstream == "picker":
            backends = ChildProcess(
                "backends",
                [sys.executable, "-m", "kvbroker_tools.bench.placement"],
                workdir / "backends.log",
                ready=[Announces()],
            )
            await backends.start()
            stack.push_async_callback(backends.stop)
            endpoints, picker = backends.announced["engines"], backends.announced["picker"]
        else:
            # Addresses only the hop's answers name: nothing is sent to them.
            endpoints, picker = ["127.0.0.1:5601", "127.0.0.1:5611"], None
        envoys = {
            "without": Envoy(workdir, picker, None),
            "with": Envoy(workdir, picker, hop.address),
        }
        for envoy in envoys.values():
            await envoy.start()
            stack.push_async_callback(envoy.stop)
        channel = await stack.enter_async_context(
            open_channel(RegistryEndpoint.parse(registry.address))
        )
        stub = registry_stub(channel)
        nodes = [node_spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, port=5700)]
        for index, endpoint in enumerate(endpoints):
            spec = node_spec(f"decode-{index}", port=5600 + 10 * index)
            spec.gateway_endpoint = endpoint
            nodes.append(spec)
        await stack.enter_async_context(Heartbeats(stub, *nodes))
        for index in range(config.conversations):
            await grant(stub, nodes[1 + index % 2], f"held-{index}", f"req-{index}", tokens=512)

        def session(index: int) -> str:
            if index % 2:
                return f"new-{index}"
            return f"held-{(index // 2) % config.conversations}"

        http = await stack.enter_async_context(
            httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=200))
        )
        for envoy in envoys.values():  # warm: connections made, code paths loaded
            await _load(http, f"{envoy.url}/v1/chat/completions", 50, 1, session)
        # The arms interleaved second by second.
        samples: dict[str, tuple[list[float], int]] = {arm: ([], 0) for arm in ARMS}
        # The CPU seconds the hop's and the registry's processes spent in each arm.
        cpu = {arm: (0.0, 0.0) for arm in ARMS}
        for second in range(int(config.seconds)):
            for arm in ARMS if second % 2 else reversed(ARMS):
                before = cpu_seconds(hop.pid), cpu_seconds(registry.pid)
                latencies, errors = await _load(
                    http, f"{envoys[arm].url}/v1/chat/completions", config.rate, 1, session
                )
                kept, failed = samples[arm]
                samples[arm] = (kept + latencies, failed + errors)
                spent = cpu_seconds(hop.pid) - before[0], cpu_seconds(registry.pid) - before[1]
                cpu[arm] = (cpu[arm][0] + spent[0], cpu[arm][1] + spent[1])
            progress(f"second {second + 1}/{int(config.seconds)}")
        results = [
            summarise(arm, samples[arm][0], samples[arm][1], int(config.seconds), cpu[arm])
            for arm in ARMS
        ]
    base, hop_arm = results
    return {
        "config": asdict(config),
        "arms": [asdict(r) for r in results],
        "added_p50_ms": hop_arm.p50_ms - base.p50_ms,
        "added_p99_ms": hop_arm.p99_ms - base.p99_ms,
        "latencies_ms": {arm: [1000 * v for v in samples[arm][0]] for arm in ARMS},
    }


def run(config: PlacementBenchConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvbroker-bench-placement-") as workdir:
        return uvloop.run(run_placement_bench(config, Path(workdir), progress))


def print_table(report: dict[str, Any], console: Console) -> None:
    """Both arms, and what the hop added; cpu: ms of CPU per request."""
    rate, upstream = report["config"]["rate"], report["config"]["upstream"]
    table = Table(title=f"Envoy on loopback, {rate:.0f} req/s, {upstream}", title_justify="left")
    # Short headers: a console that is not a terminal is 80 columns wide.
    columns = ("hop", "requests", "errors", "done/s", "p50 ms", "p99 ms", "hop cpu", "reg cpu")
    for column in columns:
        table.add_column(column, justify="right")
    for row in report["arms"]:
        table.add_row(
            row["arm"], str(row["requests"]), str(row["errors"]), f"{row['throughput']:.0f}",
            f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}",
            f"{row['hop_cpu_ms']:.2f}", f"{row['registry_cpu_ms']:.2f}",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"added by the hop: p50 {report['added_p50_ms']:+.2f} ms, "
        f"p99 {report['added_p99_ms']:+.2f} ms (cpu: ms of CPU per request)"
    )


def write(report: dict[str, Any], output: Path) -> list[Path]:
    """placement.json (without the raw latencies) and the two arms' latency distributions."""
    output.mkdir(parents=True, exist_ok=True)
    latencies = report["latencies_ms"]
    summary = {key: value for key, value in report.items() if key != "latencies_ms"}
    (output / "placement.json").write_text(json.dumps(summary, indent=2))
    ready_plotting()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in ARMS:
        values = sorted(latencies[arm])
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                    label=f"{arm} the placement hop")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("request latency through Envoy (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    rate = report["config"]["rate"]
    ax.set_title(f"Placement hop overhead, {rate:.0f} req/s on loopback")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = save_figure(fig, output / "placement_latency.png")
    return [output / "placement.json", path]


if __name__ == "__main__":
    uvloop.run(serve_backends())
