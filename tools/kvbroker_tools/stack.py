"""The whole stack on one machine, as processes: registry, a prefill and a decode vLLM server
with kvbroker's connector, their sidecars, and the router. Used by ``kvbroker up``, the demo,
the benchmark and the end-to-end tests.

Nothing here imports vLLM: engines run as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.process.local_etcd import LocalEtcd
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import (
    Announces,
    Answers,
    ChildProcess,
    ChildStartError,
    StartFailure,
    http_ok,
    start_together,
    stop_all,
)
from kvbroker.common.process.tasks import poll_until
from kvbroker.v1.node_pb2 import NODE_STATE_READY
from kvbroker.v1.registry_pb2 import ListNodesRequest, ListNodesResponse

PYTHON = sys.executable
KVBROKER = str(Path(sys.executable).with_name("kvbroker"))
SERVED_MODEL = "kvbroker-tiny-qwen3"


def make_test_model() -> Path:
    """The project's generated model (built once, then cached), via engine_ext."""
    import subprocess

    out = subprocess.run(
        [PYTHON, "-m", "kvbroker_tools.testmodel"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def registry_command(listen: str, *flags: str) -> list[str]:
    """`kvbroker registry serve` on ``listen``, logging JSON."""
    return [KVBROKER, "registry", "serve", "--listen", listen, "--log-format", "json", *flags]


SESSION_REUSE_MIDDLEWARE = "kvbroker.engine_ext.session_reuse.SessionReuse"
# Tool calling, which agents need (an engine without it refuses Claude Code's turns), with the
# parser of the served model's format: hermes is Qwen3's, the generated model's.
TOOL_CALLING = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def sidecar_command(
    registry: str,
    engine_url: str,
    role: str,
    node_id: str,
    socket: Path,
    prefix_caching: bool = True,
) -> list[str]:
    """`kvbroker sidecar run` for one engine, serving its engine on a unix socket;
    ``prefix_caching`` says whether that engine caches prefixes."""
    return [
        KVBROKER, "sidecar", "run", "--registry", registry, "--engine-url", engine_url,
        "--role", role, "--node-id", node_id, "--listen", f"unix:{socket}", "--log-format", "json",
        "--prefix-caching" if prefix_caching else "--no-prefix-caching",
    ]  # fmt: skip


def router_command(registry: str, listen: str) -> list[str]:
    """`kvbroker router run` on ``listen`` (host:port)."""
    return [KVBROKER, "router", "run", "--registry", registry, "--listen", listen,
            "--log-format", "json"]  # fmt: skip


def router_routing(router_url: str, model: str, within_s: float = 60.0) -> Answers:
    """Ready once the router lists ``model``: it has learned of nodes serving it, which it
    reads from the registry every few seconds, so its health route alone does not say it."""

    async def check() -> bool:
        async with httpx.AsyncClient(timeout=2) as client:
            listed = (await client.get(f"{router_url}/v1/models")).json()
        return model in {entry["id"] for entry in listed["data"]}

    return Answers(check, f"the router routing {model}", within_s, every_s=0.25)


@dataclass(frozen=True)
class EngineSpec:
    role: str  # "prefill" or "decode"
    cpus: str  # VLLM_CPU_OMP_THREADS_BIND
    http_port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    # Its place among the engines of its role, and whether it keeps finished turns' KV
    # (vLLM's bidirectional_kv_xfer; a decode engine's only).
    index: int = 0
    reuse: bool = True

    @property
    def name(self) -> str:
        """The name of its files and processes: the role for the first of a role."""
        return self.role if self.index == 0 else f"{self.role}-{self.index}"

    @property
    def node_id(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass
class StackConfig:
    workdir: Path
    model_dir: Path | None = None
    reuse: bool = True
    # More decode engines beside the first, each retaining or not (a fleet mid-rollout, or an
    # A/B of reuse): one entry per extra engine, its reuse setting.
    extra_decodes: tuple[bool, ...] = ()
    served_model: str = SERVED_MODEL
    kv_cache_gib: int = 1
    max_model_len: int = 8192
    # Tokens per KV block, for both engines (they must agree). vLLM's CPU backend picks 128
    # unless told; its prefix cache (D's for DECODE_LOCAL, P's for its own cache) matches
    # whole blocks only, so every reused turn recomputes the retained tail that fills no
    # block: 64 tokens on average at 128, against the ~20 of a one-line follow-up. 32 is the
    # smallest size the CPU attention kernels run at full speed (a multiple of 32). None:
    # vLLM's default.
    block_size: int | None = 32
    recompute_threshold: int = 64
    hard_cap_s: int = 480
    registry_flags: tuple[str, ...] = ()
    # More than one: that many registry replicas on an etcd the stack starts too.
    registry_replicas: int = 1
    engine_args: tuple[str, ...] = ()
    # More kv_connector_extra_config keys for both engines (e.g. the retention budget).
    connector_extra: dict[str, object] = field(default_factory=dict)
    # The registry's bearer token; its children get it in their environment, never in argv
    # (which every user of the machine can read in the process list).
    token: str | None = None
    # The prefill node's own prefix cache (off: the seed's evicted-cache case, where every
    # prefill recomputes what it is not sent).
    prefill_prefix_caching: bool = False
    # CPU binding of the two engines; on a 2-core host one core each.
    prefill_cpus: str = "0"
    decode_cpus: str = "1" if (os.cpu_count() or 1) > 1 else "0"
    # vLLM's KV cache events (BlockStored, BlockRemoved, AllBlocksCleared), what llm-d's
    # precise prefix-cache scorer and Dynamo's KV indexer subscribe to: each engine publishes
    # them over ZMQ on its own ipc socket in the workdir (Stack.kv_events_endpoint).
    kv_events: bool = False
    # The router's --retain-sessionless (its default is on). Off here: the demo, the benchmarks
    # and the tests send turns without a session id as their plain P/D arm (reuse off).
    retain_sessionless: bool = False


class Stack:
    def __init__(self, config: StackConfig, progress: Callable[[str], None] | None = None):
        self.config = config
        self.progress = progress or (lambda message: None)
        # Every child started so far, in the order started.
        self.children: list[ChildProcess] = []
        self._registries: dict[str, ChildProcess] = {}
        self._engines: dict[str, ChildProcess] = {}
        self.model_dir: Path | None = config.model_dir
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Free ports for every server, chosen now and bound by the children later (so another
        process may take one first: ``start`` then tries once more on fresh ones)."""
        replicas = max(self.config.registry_replicas, 1)
        self.registry_addresses = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.registry_address = ",".join(self.registry_addresses)
        self.etcd = LocalEtcd(self.config.workdir) if replicas > 1 else None
        self.router_url = f"http://127.0.0.1:{free_port()}"
        self.prefill = EngineSpec("prefill", self.config.prefill_cpus, reuse=self.config.reuse)
        reuses = (self.config.reuse, *self.config.extra_decodes)
        self.decodes = [
            EngineSpec("decode", self.config.decode_cpus, index=index, reuse=reuse)
            for index, reuse in enumerate(reuses)
        ]
        self.decode = self.decodes[0]

    @property
    def engines(self) -> list[EngineSpec]:
        return [self.prefill, *self.decodes]

    def url(self, engine: EngineSpec) -> str:
        return f"http://127.0.0.1:{engine.http_port}"

    def socket_path(self, engine: EngineSpec) -> Path:
        return self.config.workdir / f"{engine.name}.sock"

    def _child(self, child: ChildProcess) -> ChildProcess:
        self.children.append(child)
        return child

    def _log(self, name: str) -> Path:
        return self.config.workdir / f"{name}.log"

    def kvbroker_env(self) -> dict[str, str]:
        """The environment of the stack's kvbroker processes: the token through
        KVBROKER_TOKEN, and neither a token nor a token file inherited from this process
        (an empty variable counts as unset)."""
        return {"KVBROKER_TOKEN": self.config.token or "", "KVBROKER_TOKEN_FILE": ""}

    def registry_child(self, name: str, address: str, store: list[str]) -> ChildProcess:
        # Its metrics on a port of its own choosing, which it announces (the fault tests read
        # them), unless the flags name one.
        flags = self.config.registry_flags
        metrics = () if "--metrics-listen" in flags else ("--metrics-listen", "127.0.0.1:0")
        argv = registry_command(address, *store, *metrics, *flags)
        return ChildProcess(
            name, argv, self._log(name), ready=[Announces()], env=self.kvbroker_env()
        )

    def sidecar_child(self, engine: EngineSpec) -> ChildProcess:
        name = f"sidecar-{engine.name}"
        argv = sidecar_command(
            self.registry_address, self.url(engine), engine.role, engine.node_id,
            self.socket_path(engine), self.prefix_caching(engine),
        )  # fmt: skip
        return ChildProcess(
            name, argv, self._log(name), ready=[Announces()], env=self.kvbroker_env()
        )

    def router_child(self) -> ChildProcess:
        return ChildProcess(
            "router",
            [
                *router_command(self.registry_address, self.router_url.removeprefix("http://")),
                "--retain-sessionless"
                if self.config.retain_sessionless
                else "--no-retain-sessionless",
            ],
            self._log("router"),
            ready=[router_routing(self.router_url, self.config.served_model, within_s=600)],
            env=self.kvbroker_env(),
        )

    def _kv_transfer_config(self, engine: EngineSpec) -> str:
        extra: dict[str, object] = {
            "backends": ["UCX"],
            "bidirectional_kv_xfer": engine.reuse,
            "kv_recompute_threshold": self.config.recompute_threshold,
            "decoder_kv_blocks_ttl": self.config.hard_cap_s,
            "kvbroker_sidecar": f"unix:{self.socket_path(engine)}",
            **self.config.connector_extra,
        }
        return json.dumps(
            {
                "kv_connector": "NixlConnector",
                "kv_connector_module_path": "kvbroker.engine_ext.connector",
                "kv_role": "kv_producer" if engine.role == "prefill" else "kv_consumer",
                "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
        )

    def kv_events_endpoint(self, engine: EngineSpec) -> str:
        """The ZMQ endpoint the engine publishes its KV cache events on (bound by vLLM, with
        ``kv_events`` on): a SUB socket connects to it."""
        return f"ipc://{self.config.workdir / f'{engine.name}-kv-events.ipc'}"

    def _kv_events_args(self, engine: EngineSpec) -> tuple[str, ...]:
        if not self.config.kv_events:
            return ()
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint(engine),
        }
        return ("--kv-events-config", json.dumps(config))

    def engine_env(self, engine: EngineSpec) -> dict[str, str]:
        return {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(engine.side_channel_port),
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": engine.cpus,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # The in-process executor: the multiprocess one's shared-memory queue was seen
            # losing a wake-up under NIXL on 2 cores and hanging the engine (VLLM-NOTES).
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "UCX_TLS": "tcp,self,sm",
            "UCX_NET_DEVICES": "lo",
        }

    def prefix_caching(self, engine: EngineSpec) -> bool:
        """Whether the engine caches prefixes: the decode engine always (DECODE_LOCAL finds the
        retained blocks in it), the prefill engine as configured. Its vLLM flag and its
        sidecar's both follow this."""
        return engine.role != "prefill" or self.config.prefill_prefix_caching

    def engine_argv(self, engine: EngineSpec) -> list[str]:
        assert self.model_dir is not None
        caching = (
            "--enable-prefix-caching"
            if self.prefix_caching(engine)
            else "--no-enable-prefix-caching"
        )
        return [
            PYTHON, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.config.served_model,
            "--host", "127.0.0.1",
            "--port", str(engine.http_port),
            "--enforce-eager",
            "--max-num-seqs", "4",
            "--max-model-len", str(self.config.max_model_len),
            "--dtype", "float32",
            "--disable-uvicorn-access-log",
            *(("--block-size", str(self.config.block_size)) if self.config.block_size else ()),
            caching,
            "--kv-transfer-config", self._kv_transfer_config(engine),
            # Behind a router other than kvbroker's, the engine resolves handles itself.
            "--middleware", SESSION_REUSE_MIDDLEWARE,
            *TOOL_CALLING,
            *self._kv_events_args(engine),
            *self.config.engine_args,
        ]  # fmt: skip

    async def start(self) -> None:
        """Starts every process and returns once the stack serves. A child that will never be
        ready fails the start at once with its log; a start that fails stops everything it
        started, and one that failed on a port another process took tries once more on fresh
        ports."""
        self.config.workdir.mkdir(parents=True, exist_ok=True)
        if self.model_dir is None:
            self.progress("making the test model (cached after the first run)")
            self.model_dir = await asyncio.to_thread(make_test_model)
        try:
            try:
                await self._start_children()
            except ChildStartError as error:
                if error.failure is not StartFailure.PORT_IN_USE:
                    raise
                held = f" ({error.holders})" if error.holders else ""
                self.progress(
                    f"{error.name} found its port taken{held}; starting again on fresh ports"
                )
                await self.stop()
                self._pick_ports()
                await self._start_children()
        except BaseException:
            await self.stop()
            raise

    async def _start_children(self) -> None:
        store: list[str] = []
        if self.etcd is not None:
            self.progress(f"starting etcd on {self.etcd.url}")
            await self._child(self.etcd.child).start()
            store = ["--store", self.etcd.url, "--election-ttl", "2"]
        self.progress(f"starting the registry on {self.registry_address}")
        for index, address in enumerate(self.registry_addresses):
            name = "registry" if len(self.registry_addresses) == 1 else f"registry-{index}"
            registry = self.registry_child(name, address, store)
            self._registries[address] = registry
            await self._child(registry).start()
        for engine in self.engines:
            await self._child(self.sidecar_child(engine)).start()
        self.progress("starting the prefill and decode vLLM servers (about a minute)")
        engines = [
            ChildProcess(
                f"vllm-{e.name}",
                self.engine_argv(e),
                self._log(f"vllm-{e.name}"),
                ready=[http_ok(f"{self.url(e)}/health")],
                env=self.engine_env(e),
            )
            for e in self.engines
        ]
        self._engines = {child.name: child for child in engines}
        router = self.router_child()
        # Started in this order, ready in any; the first to fail ends the others' waits.
        starting = [self._child(child) for child in (*engines, router)]
        await start_together(starting)
        self.progress("engines up; waiting for their sidecars to register")
        await self._wait_registered()

    async def __aenter__(self) -> Stack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _wait_registered(self, timeout_s: float = 60) -> None:
        endpoint = RegistryEndpoint.parse(self.registry_address, self.config.token)
        async with open_channel(endpoint) as channel:
            stub = registry_stub(channel)

            async def all_ready() -> bool:
                listed: ListNodesResponse = await stub.ListNodes(ListNodesRequest(), timeout=2)
                ready = sum(n.state == NODE_STATE_READY for n in listed.nodes)
                return ready >= len(self.engines)

            await poll_until(
                all_ready, timeout_s, "every engine's sidecar registered", every_s=0.25
            )

    async def kill_registry_leader(self) -> str:
        """SIGKILLs the registry replica that leads now (failure tests); returns its address."""
        if self.etcd is None:
            raise RuntimeError("this stack runs one registry; there is no leader to kill")
        leader = await self.etcd.leader()
        registry = self._registries[leader]
        registry.kill()
        await registry.wait()
        return leader

    async def kill_engine(self, engine: EngineSpec) -> None:
        """SIGKILLs a vLLM server and its engine core (failure tests)."""
        child = self._engines[f"vllm-{engine.name}"]
        child.kill()
        await child.wait()

    async def restart_engine(self, engine: EngineSpec) -> None:
        """SIGKILLs a vLLM server, starts it again, and returns once its sidecar has it
        registered again (failure tests): it comes back with nothing retained."""
        await self.kill_engine(engine)
        await self._engines[f"vllm-{engine.name}"].start()
        await self._wait_registered()

    async def restart_registry(self) -> None:
        """SIGKILLs the one registry (memory store: it forgets everything), starts it again,
        and returns once both sidecars have registered with it again (failure tests)."""
        if self.etcd is not None:
            raise RuntimeError("this stack runs registry replicas; kill the leader instead")
        registry = self._registries[self.registry_address]
        registry.kill()
        await registry.wait()
        await registry.start()
        await self._wait_registered()

    def registry_metrics_urls(self) -> list[str]:
        """Each registry replica's ``/metrics`` page, as the replica announced it."""
        return [
            f"http://{child.announced['metrics']}/metrics"
            for child in self._registries.values()
            if child.announced.get("metrics")
        ]

    def pause_registry(self, paused: bool) -> None:
        """SIGSTOPs (or SIGCONTs) the one registry: a registry that hangs, its port still
        open, rather than one that is gone (failure tests)."""
        registry = self._registries[self.registry_address]
        registry.kill(signal.SIGSTOP if paused else signal.SIGCONT)

    async def stop(self) -> None:
        await stop_all(self.children, grace_s=15)
        self.children.clear()
        self._registries.clear()
        self._engines.clear()

    def describe(self) -> dict[str, object]:
        return {
            "router": self.router_url,
            "registry": self.registry_address,
            "etcd": self.etcd.url if self.etcd is not None else None,
            "prefill": self.url(self.prefill),
            "decode": self.url(self.decode),
            "model": self.config.served_model,
            "model_dir": str(self.model_dir),
            "reuse": self.config.reuse,
            "logs": str(self.config.workdir),
            "kv_events": {e.name: self.kv_events_endpoint(e) for e in self.engines}
            if self.config.kv_events
            else None,
        }
