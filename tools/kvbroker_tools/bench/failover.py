"""`kvbroker bench failover`: registry replicas on etcd, killed under a steady load of turns.

Everything on the control path is the real thing, each in its own process: an etcd server,
registry replicas (`kvbroker registry serve --store etcd://…`), one `kvbroker sidecar run` per
engine and a `kvbroker router run` in front. Only the engines are simulated, in this process:
each serves the HTTP routes the sidecar and router use and drives its sidecar through the real
``EngineLink``. A decode engine retains blocks per turn and frees them when the registry's
deadlines say so; a prefill engine that receives a handle asks its sidecar whether the lease
may be read, exactly as the vLLM connector does, and then checks the decode engine's ground
truth, which is what makes the counts below meaningful:

- failed requests: turns the router did not answer with 200;
- stale hints: handles offered for blocks their decode engine no longer held;
- stale reads: reads the lease check allowed of blocks no longer held (the worst outcome);
- lost leases: at the end, conversations whose decode engine still holds their last turn's
  blocks but whose lease the registry no longer has;
- recovery: from each leader kill (and etcd restart or hang) to the first turn that started
  after it and reused KV on an EXACT hint;
- rejoin: from etcd resuming after a hang (SIGSTOP, then SIGCONT: connections stay open and
  nothing answers, so calls time out rather than fail) until every replica's gRPC health says
  SERVING again (it leads, or follows a leader that serves); a replica that does not within
  ``rejoin_within_s`` counts as stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import ChildProcess, stop_all
from kvbroker.common.process.tasks import poll_until
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.controlplane.server import SERVICE_NAME
from kvbroker.v1 import registry_pb2
from kvbroker_tools.bench.failover_engine import MODEL, SimEngine, Tally
from kvbroker_tools.bench.failover_report import SoakReport
from kvbroker_tools.harness.processes import RegistryProcess, sidecar_process
from kvbroker_tools.stack import router_command, router_routing

# ---------------------------------------------------------------------- processes


def registry_replica(workdir: Path, index: int, store: str, flags: list[str]) -> RegistryProcess:
    """A registry replica on ``store``, restartable on the same port."""
    return RegistryProcess(
        "--store", store, *flags, name=f"registry-{index}", log=workdir / f"registry-{index}.log"
    )


# ---------------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class SoakConfig:
    replicas: int = 3
    decode_engines: int = 2
    prefill_engines: int = 1
    conversations: int = 8
    turns_per_conversation: int = 6
    think_s: tuple[float, float] = (0.05, 0.3)
    duration_s: float = 60.0
    kill_every_s: float = 8.0
    # Kills hit the leader this often, any replica otherwise.
    leader_kill_share: float = 0.75
    restart_after_s: float = 2.0
    restart_etcd: bool = True
    # Hang etcd this long once, two thirds of the way in (0: never).
    hang_etcd_s: float = 8.0
    # How soon after etcd resumes every replica must lead or follow again (5 election TTLs of
    # the default 2 s).
    rejoin_within_s: float = 10.0
    seed: int = 7


class Fleet:
    """etcd, registry replicas, sidecars, simulated engines and a router."""

    def __init__(self, workdir: Path, config: SoakConfig, registry_flags: list[str]) -> None:
        self.workdir, self.config = workdir, config
        self.etcd = LocalEtcd(workdir)
        # Every reused turn reads (no DECODE_LOCAL): what this fleet checks is that no read
        # is stale across failovers, drains and partitions.
        flags = [*registry_flags, "--max-local-prefill-tokens", "0"]
        self.replicas = [
            registry_replica(workdir, i, self.etcd.url, flags) for i in range(config.replicas)
        ]
        self.addresses = ",".join(r.address for r in self.replicas)
        self.engines: list[SimEngine] = []
        self.sidecars: list[ChildProcess] = []
        roles = ["decode"] * config.decode_engines + ["prefill"] * config.prefill_engines
        for i, role in enumerate(roles):
            node_id = f"{role}-{i}"
            socket = workdir / f"{node_id}.sock"
            engine = SimEngine(node_id, role, socket, self)
            self.engines.append(engine)
            self.sidecars.append(
                sidecar_process(
                    self.addresses,
                    engine.url,
                    node_id,
                    socket,
                    role,
                    log=workdir / f"sidecar-{node_id}.log",
                )
            )
        self.router_port = free_port()
        self.router = ChildProcess(
            "router",
            router_command(self.addresses, f"127.0.0.1:{self.router_port}"),
            workdir / "router.log",
            ready=[router_routing(self.router_url, MODEL)],
        )
        self.tally = Tally()
        # Per etcd hang: seconds from its resumption until every replica served again.
        self.rejoin_s: list[float] = []
        self.stuck: list[str] = []
        # conversation -> (engine id, request id) of each retention, in the order made
        self.retentions: dict[str, list[tuple[str, str]]] = {}
        self.http = httpx.AsyncClient(timeout=10)

    def engine(self, engine_id: str) -> SimEngine | None:
        return next((e for e in self.engines if e.engine_id == engine_id), None)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    async def start(self) -> None:
        await self.etcd.start()
        for replica in self.replicas:
            await replica.start()
        for engine, sidecar in zip(self.engines, self.sidecars, strict=True):
            await engine.start()
            await sidecar.start()
            engine.link.start()
        await self.router.start()

    async def stop(self) -> None:
        await self.http.aclose()
        await self.router.stop()
        for engine in self.engines:
            await engine.stop()
        await stop_all([self.etcd.child, *self.replicas, *self.sidecars])

    # ------------------------------------------------------------ load

    async def turn(self, conversation: str, index: int) -> tuple[str, str]:
        """One turn through the router; (decision, consistency), or records a failure."""
        self.tally.turns += 1
        body = {
            "model": MODEL,
            "session_id": conversation,
            "messages": [{"role": "user", "content": f"turn {index}"}],
        }
        try:
            response = await self.http.post(f"{self.router_url}/v1/chat/completions", json=body)
        except httpx.HTTPError as error:
            self.tally.failed.append(f"{conversation} turn {index}: {error!r}")
            return "", ""
        if response.status_code != 200:
            self.tally.failed.append(
                f"{conversation} turn {index}: {response.status_code} {response.text[:200]}"
            )
            return "", ""
        decision = response.headers.get("x-kvbroker-decision", "")
        consistency = response.headers.get("x-kvbroker-consistency", "")
        self.tally.reuse_exact += decision == "REUSE" and consistency == "EXACT"
        self.tally.degraded += consistency == "DEGRADED"
        return decision, consistency

    async def close(self, conversation: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.http.delete(f"{self.router_url}/v1/sessions/{conversation}")
        self.retentions.pop(conversation, None)

    async def converse(self, rng: random.Random, until: float, reuse_seen: list[float]) -> None:
        """Conversations one after another until ``until``; each ends with a close."""
        config = self.config
        while time.monotonic() < until:
            conversation = f"conv-{uuid.uuid4().hex[:10]}"
            for index in range(config.turns_per_conversation):
                started = time.monotonic()
                decision, consistency = await self.turn(conversation, index)
                if decision == "REUSE" and consistency == "EXACT":
                    reuse_seen.append(started)
                await asyncio.sleep(rng.uniform(*config.think_s))
                if time.monotonic() >= until:
                    return  # leave it open: the end check looks for its lease
            await self.close(conversation)

    # ------------------------------------------------------------ chaos

    async def chaos(
        self, rng: random.Random, until: float, events: list[tuple[float, str]]
    ) -> None:
        """Kills a replica (mostly the leader) every so often and brings it back; restarts
        etcd once, a third of the way in, and hangs it once, two thirds of the way in, if
        asked. Each goes into ``events`` with its time."""
        config = self.config
        now = time.monotonic()
        etcd_due = now + (until - now) / 3 if config.restart_etcd else 0
        hang_due = now + 2 * (until - now) / 3 if config.hang_etcd_s else 0
        # The last event leaves a quiet tail, so recovery from it is seen before the end.
        while time.monotonic() + 2 * config.kill_every_s < until:
            await asyncio.sleep(config.kill_every_s)
            if etcd_due and time.monotonic() >= etcd_due:
                etcd_due = 0
                await self.etcd.stop()
                await asyncio.sleep(config.restart_after_s)
                await self.etcd.start()
                events.append((time.monotonic(), "etcd"))
                continue
            if hang_due and time.monotonic() >= hang_due:
                hang_due = 0
                await self.hang_etcd(events)
                continue
            leader = await self.etcd.leader()
            leading = [r for r in self.replicas if r.address == leader]
            hit_leader = bool(leading) and rng.random() < config.leader_kill_share
            victim = leading[0] if hit_leader else rng.choice(self.replicas)
            victim.kill()
            events.append((time.monotonic(), "leader" if victim in leading else "follower"))
            await asyncio.sleep(config.restart_after_s)
            await victim.start()

    async def hang_etcd(self, events: list[tuple[float, str]]) -> None:
        """etcd hung for ``hang_etcd_s``, then resumed; then every replica must serve again
        within ``rejoin_within_s`` (a replica whose election ended stays NOT_SERVING)."""
        await self.etcd.hang()
        try:
            await asyncio.sleep(self.config.hang_etcd_s)
        finally:
            self.etcd.resume()
        resumed = time.monotonic()
        events.append((resumed, "etcd-hang"))
        waiting = [r.address for r in self.replicas]
        with contextlib.suppress(TimeoutError):
            await poll_until(
                lambda: self._all_serving(waiting),
                self.config.rejoin_within_s,
                "every replica serving",
                retrying=(),
            )
            self.rejoin_s.append(round(time.monotonic() - resumed, 3))
            return
        self.stuck.append(
            f"after etcd hung, not serving within {self.config.rejoin_within_s:.0f} s: "
            + ", ".join(waiting)
        )

    async def _all_serving(self, waiting: list[str]) -> bool:
        """Leaves in ``waiting`` the replicas whose health does not say SERVING yet."""
        serving = await asyncio.gather(*(_serves(address) for address in waiting))
        waiting[:] = [a for a, ok in zip(waiting, serving, strict=True) if not ok]
        return not waiting

    # ------------------------------------------------------------ the end check

    async def lost_leases(self, within_s: float = 20.0) -> list[str]:
        """Open conversations that lost their KV: a decode engine still holds some of their
        blocks but the registry has no live lease for them, or the registry's live lease
        names blocks no engine holds. (The live lease need not be the last turn's: a report
        delayed by a failover may land after a later turn's and supersede it.)"""
        endpoint = RegistryEndpoint.parse(self.addresses)
        deadline = time.monotonic() + within_s
        async with open_channel(endpoint) as channel:
            stub = registry_stub(channel)
            while True:
                lost = [
                    problem
                    for conversation, made in list(self.retentions.items())
                    if (problem := await self._lease_problem(stub, conversation, made))
                ]
                if not lost or time.monotonic() > deadline:
                    return lost
                await asyncio.sleep(0.5)

    async def _lease_problem(
        self, stub: Any, conversation: str, made: list[tuple[str, str]]
    ) -> str | None:
        held = {
            request_id
            for engine_id, request_id in made
            if (engine := self.engine(engine_id)) is not None and request_id in engine.held
        }
        if not held:
            return None  # freed by its engine on a deadline: nothing left to lose
        try:
            found = await stub.ListLeases(
                registry_pb2.ListLeasesRequest(conversation_id=conversation), timeout=2
            )
        except Exception as error:
            return f"{conversation}: registry said {error!r}"
        live = [lease for lease in found.leases if lease.state in LIVE_LEASE_STATES]
        if not live:
            return f"{conversation}: no live lease, engines hold {sorted(held)}"
        if live[-1].handle.remote_request_id not in held:
            return f"{conversation}: live lease {live[-1].lease_id} names freed blocks"
        return None


async def run_soak(
    config: SoakConfig,
    registry_flags: list[str] | None = None,
    workdir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> SoakReport:
    """Starts the fleet, runs turns under chaos for ``config.duration_s``, checks the end."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="kvbroker-soak-") as temporary:
            return await run_soak(config, registry_flags, Path(temporary), progress)
    say = progress or (lambda message: None)
    flags = registry_flags or [
        "--election-ttl", "2", "--heartbeat-interval", "0.5", "--session-ttl", "4",
    ]  # fmt: skip
    fleet = Fleet(workdir, config, flags)
    say("starting etcd, registry replicas, sidecars, engines and the router")
    try:
        await fleet.start()
        return await _drive(fleet, config, say)
    finally:
        await fleet.stop()


async def _drive(fleet: Fleet, config: SoakConfig, say: Callable[[str], None]) -> SoakReport:
    rng = random.Random(config.seed)
    started = time.monotonic()
    until = started + config.duration_s
    events: list[tuple[float, str]] = []
    reuse_seen: list[float] = []
    say(f"{config.conversations} conversations for {config.duration_s:.0f} s, with kills")
    workers = [
        fleet.converse(random.Random(rng.random()), until, reuse_seen)
        for _ in range(config.conversations)
    ]
    await asyncio.gather(fleet.chaos(rng, until, events), *workers)
    say("checking that every open conversation's lease survived")
    lost = await fleet.lost_leases()

    def recovery(kind: str) -> list[float]:
        times = []
        for at, what in events:
            after = [t - at for t in reuse_seen if t > at]
            if what == kind and after:
                times.append(round(min(after), 3))
        return times

    tally = fleet.tally
    return SoakReport(
        duration_s=round(time.monotonic() - started, 1),
        turns=tally.turns,
        failed_requests=len(tally.failed),
        reuse_exact=tally.reuse_exact,
        degraded_hints=tally.degraded,
        reads=tally.reads,
        declined_reads=tally.declined,
        leases_granted=len(tally.leases),
        leases_lost=len(lost),
        stale_hints=tally.stale_hints,
        stale_reads=tally.stale_reads,
        replica_kills=sum(1 for _, what in events if what != "etcd"),
        leader_kills=sum(1 for _, what in events if what == "leader"),
        etcd_restarts=sum(1 for _, what in events if what == "etcd"),
        recovery_s=recovery("leader"),
        etcd_recovery_s=recovery("etcd"),
        etcd_hangs=sum(1 for _, what in events if what == "etcd-hang"),
        etcd_hang_rejoin_s=fleet.rejoin_s,
        etcd_hang_recovery_s=recovery("etcd-hang"),
        replicas_stuck=len(fleet.stuck),
        failures=tally.failed[:20] + lost[:20] + fleet.stuck,
    )


async def _serves(address: str) -> bool:
    """Whether the replica at ``address`` says SERVING (unreachable: no)."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1
            )
        except grpc.aio.AioRpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


@contextlib.asynccontextmanager
async def fleet_for_tests(
    workdir: Path, config: SoakConfig, registry_flags: list[str]
) -> AsyncIterator[Fleet]:
    """The fleet started and stopped around a test that drives it itself."""
    fleet = Fleet(workdir, config, registry_flags)
    try:
        await fleet.start()
        yield fleet
    finally:
        await fleet.stop()
