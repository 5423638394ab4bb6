"""The heartbeats of `kvbroker bench fleet`'s nodes, sent from a process of their own, as each
real sidecar sends its own.

Why a process: the load process also builds the engines' replay at the start (at 1,000 nodes
tens of thousands of retained leases, over ten seconds of its CPU without a pause) and sends
it. Heartbeats sent from that process's event loop left up to 15 s after their time, and at
the registry's defaults (every 2 s, sessions of 6 s) every node lost its session to the load
generator, not to the registry. Here they leave on time whatever the load process does, so
what a heartbeat waits for is the registry's.

Apart from the run (``kvbroker_tools.bench.fleet``) because a spawned process imports its
target's module: this one keeps that to the heartbeats and their gRPC client.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.v1 import node_pb2, registry_pb2

# How long the load process waits for the heartbeat process to start (a spawned interpreter
# importing gRPC), and for its figures once it asked it to stop (it waits for the heartbeats
# in flight first, each bounded by its own deadline).
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
HEARTBEAT_TIMEOUT_S = 30.0


@dataclass
class HeartbeatFigures:
    """What the nodes' heartbeats saw."""

    # Failed heartbeats by gRPC status code: why matters (a deadline is the replay's queue;
    # NOT_FOUND or FAILED_PRECONDITION a node the registry no longer knows).
    errors: Counter[str] = field(default_factory=Counter)
    # By status code, the longest a failed heartbeat waited before it failed.
    failed_after_s: dict[str, float] = field(default_factory=dict)
    max_s: float = 0.0  # the longest a heartbeat took to be answered
    # The latest a heartbeat left after its time: near 0 unless this process starves.
    late_max_s: float = 0.0
    sent: int = 0


class HeartbeatProcess:
    """The heartbeat process, from the load process's side: it is told which nodes are
    registered (each heartbeats from then on, every ``interval_s``, the fleet's heartbeats
    spread evenly over it) and their engines' KV usage; at its stop it gives its figures.
    Started, it is ready for the first node once ``started`` returns."""

    def __init__(self, endpoint: str, specs: list[node_pb2.NodeSpec], interval_s: float) -> None:
        context = multiprocessing.get_context("spawn")  # gRPC's threads do not survive a fork
        self._connection, child = context.Pipe()
        wire = [spec.SerializeToString() for spec in specs]
        self._process = context.Process(
            target=_serve,
            args=(endpoint, wire, interval_s, child),
            name="fleet-heartbeats",
            daemon=True,  # not left behind by a load process that fails
        )
        self._process.start()
        child.close()

    async def started(self) -> None:
        """Returns once the process reads the load process's word and can send heartbeats:
        a node told before would wait for its first heartbeat on the process's start."""
        if not await asyncio.to_thread(self._connection.poll, START_TIMEOUT_S):
            raise TimeoutError(f"the heartbeat process did not start in {START_TIMEOUT_S} s")
        self._connection.recv()  # its word that it is ready

    @property
    def pid(self) -> int:
        assert self._process.pid is not None  # started in __init__
        return self._process.pid

    def registered(self, node_id: str) -> None:
        """The node's session began: it heartbeats now, and every interval from now on."""
        self._connection.send(("registered", node_id))

    def usage(self, usage: dict[str, float]) -> None:
        """Decode nodes' KV-cache usage (0 to 1) for their next heartbeats' load."""
        self._connection.send(("usage", usage))

    async def stop(self) -> HeartbeatFigures:
        """Stops the heartbeats once those in flight are answered (a cancelled call would end
        as CANCELLED and count the bench's own stop as a failure); their figures."""
        try:
            self._connection.send(("stop", None))
            give_up = time.monotonic() + STOP_TIMEOUT_S
            while True:  # past its word that it started, if ``started`` never read it
                left = give_up - time.monotonic()
                if not await asyncio.to_thread(self._connection.poll, max(left, 0.0)):
                    raise TimeoutError(f"the heartbeat process did not stop in {STOP_TIMEOUT_S} s")
                message = self._connection.recv()
                if isinstance(message, HeartbeatFigures):
                    return message
        finally:
            await asyncio.to_thread(self._process.join, 5)
            if self._process.is_alive():
                self._process.kill()
            self._connection.close()


def _request(spec: node_pb2.NodeSpec, usage: float) -> registry_pb2.HeartbeatRequest:
    return registry_pb2.HeartbeatRequest(
        node_id=spec.node_id, incarnation=spec.incarnation, engine_ready=True,
        load=node_pb2.NodeLoad(kv_cache_usage=usage),
    )  # fmt: skip


def _serve(endpoint: str, wire: list[bytes], interval_s: float, connection: Connection) -> None:
    specs = [node_pb2.NodeSpec.FromString(spec) for spec in wire]
    figures = asyncio.run(_Sender(specs, interval_s, connection).run(endpoint))
    connection.send(figures)
    connection.close()


class _Sender:
    """The heartbeat process's side: the registered nodes' heartbeats on their schedule, and
    the load process's word (``HeartbeatProcess``) read as it comes."""

    def __init__(
        self, specs: list[node_pb2.NodeSpec], interval_s: float, connection: Connection
    ) -> None:
        self.specs, self.interval_s, self.connection = specs, interval_s, connection
        self.by_id = {spec.node_id: spec for spec in specs}
        self.figures = HeartbeatFigures()
        self.registered: set[str] = set()
        self.usage: dict[str, float] = {}
        self.stopping = asyncio.Event()
        self.in_flight: set[asyncio.Task[None]] = set()
        self.stub: Any = None

    async def run(self, endpoint: str) -> HeartbeatFigures:
        channel = open_channel(RegistryEndpoint.parse(endpoint))
        self.stub = registry_stub(channel)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.connection.fileno(), self._on_message)
        schedule = asyncio.create_task(self._on_schedule())
        self.connection.send("ready")
        try:
            await self.stopping.wait()
        finally:
            loop.remove_reader(self.connection.fileno())
            schedule.cancel()
            await asyncio.gather(schedule, return_exceptions=True)
            await asyncio.gather(*self.in_flight, return_exceptions=True)
            await channel.close()
        return self.figures

    def _on_message(self) -> None:
        while self.connection.poll():
            kind, value = self.connection.recv()
            if kind == "registered":
                self.registered.add(value)
                self._send(self.by_id[value])  # as a sidecar heartbeats once registered
            elif kind == "usage":
                self.usage.update(value)
            else:
                self.stopping.set()

    async def _on_schedule(self) -> None:
        """Every registered node once an interval, the fleet's heartbeats spread evenly."""
        spacing = self.interval_s / len(self.specs)
        start = time.perf_counter()
        for index in itertools.count():
            due = start + index * spacing
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            spec = self.specs[index % len(self.specs)]
            if spec.node_id in self.registered:
                late = time.perf_counter() - due
                self.figures.late_max_s = max(self.figures.late_max_s, late)
                self._send(spec)

    def _send(self, spec: node_pb2.NodeSpec) -> None:
        task = asyncio.create_task(self._beat(spec))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def _beat(self, spec: node_pb2.NodeSpec) -> None:
        figures = self.figures
        figures.sent += 1
        request = _request(spec, self.usage.get(spec.node_id, 0.0))
        started = time.perf_counter()
        try:
            await self.stub.Heartbeat(request, timeout=HEARTBEAT_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            code = error.code().name
            figures.errors[code] += 1
            waited = time.perf_counter() - started
            figures.failed_after_s[code] = max(figures.failed_after_s.get(code, 0.0), waited)
            return
        figures.max_s = max(figures.max_s, time.perf_counter() - started)
