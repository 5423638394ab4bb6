"""kvbroker's idle pause inside vLLM's real engine core: ``EngineCoreProc`` in its own process,
started by vLLM's own client (``EngineCoreClient.make_client``) with vLLM's ``UniProcExecutor``,
kvbroker's connector on the scheduler side, and a fake worker in place of the model (vLLM
0.33 and 0.34 run here from their CUDA wheels, which cannot run a worker without a GPU).

A decode engine retains each finished turn of a conversation, and vLLM's engine core steps
for as long as its scheduler holds a retained request. What is checked, turn after turn: once
a turn is retained, the steps that schedule nothing are one idle wait apart (the connector
found the engine core's queue of client requests and waits on it, rather than spinning), and
the next turn, sent during such a wait, is scheduled at once (the wait is on the queue the
engine core's input thread fills, not merely a timer). The control plane is down here (no
sidecar listens), so retention runs on the engine's own hard cap, as it does when the
registry is unreachable.

A retaining engine core must also stop at once when asked to: vLLM's engine core steps on while
a finished request holds blocks, so it never left its loop and was killed at the end of its
grace (5 s) at every shutdown. Here the decode engine's sidecar and registry are real (the
sidecar probes a ``FakeEngine`` for the engine's health); once a turn is retained under a live
lease, the engine core is shut down as vLLM's client does (SIGTERM, then a kill after a
timeout): it frees what it retains and leaves its loop at once, exits by itself, and the
registry hears that the lease ended.

The worker writes one line per step to a file named by ``KVBROKER_TEST_STEP_LOG``, and one
when the engine core shuts it down (the test reads it without sending the engine anything,
which would end its wait).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from kvbroker.common.client.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.common.rules import handles
from kvbroker.common.rules.routing import LIVE_LEASE_STATES
from kvbroker.engine_ext.vllm_compat import KVConnectorOutput, SchedulerOutput
from kvbroker.v1 import lease_pb2, registry_pb2
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.processes import sidecar_process
from tests.conftest import eventually, spawn_registry
from tests.test_connector_scheduler import BLOCK_SIZE, engine_config, prompt

STEP_LOG = "KVBROKER_TEST_STEP_LOG"
WAIT_S = 1.0  # kvbroker_idle_wait_s: long enough to tell a wait from a spin
NUM_BLOCKS = 2048  # the test model's whole context (16k tokens), as vLLM checks at start
HEAD_SIZE = 8
TURNS = 3
NO_SIDECAR = "unix:/nonexistent/kvbroker-test-sidecar.sock"
# How long vLLM's client lets an engine core stop before it kills it (vllm.v1.utils.shutdown).
GRACE_S = 5.0
# The test's own limit, longer: the process's teardown after its loop (vLLM's, with or without
# a connector) took 4.5 s on the shared 2-core machine, and is not what is measured here.
STOP_LIMIT_S = 30.0
TEARDOWN = "teardown"


class FakeWorker(WorkerBase):
    """vLLM's worker interface without a model: one KV cache group of ``NUM_BLOCKS`` blocks,
    one sampled token per scheduled request, and the NIXL pull worker's delayed frees (a
    retained request's blocks are reported sent once its deadline has passed, as
    ``NixlPullConnectorWorker`` does). Each step is logged: its time and tokens scheduled."""

    def init_device(self) -> None:
        self._log = Path(os.environ[STEP_LOG])
        self._to_free: dict[str, float] = {}

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        return None

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float32
        )
        return {"layer": spec}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # No attention backend here: vLLM's default preference, as for backends declaring none.
        return [layout.name for layout in get_supported_kv_cache_layouts([])]

    def determine_available_memory(self) -> int:
        return NUM_BLOCKS * self.get_kv_cache_spec()["layer"].page_size_bytes

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_kv_connector_handshake_metadata(self) -> None:
        return None  # no NIXL agent: nothing for the scheduler's side channel to serve

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        """The engine core left its loop and tears down (its executor first)."""
        with self._log.open("a") as log:
            log.write(f"{time.monotonic()} {TEARDOWN}\n")

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        now = time.perf_counter()
        with self._log.open("a") as log:
            log.write(f"{time.monotonic()} {scheduler_output.total_num_scheduled_tokens}\n")
        meta = scheduler_output.kv_connector_metadata
        self._to_free.update(getattr(meta, "reqs_to_send", {}))
        sent = {r for r, deadline in self._to_free.items() if deadline <= now}
        for request_id in sent:
            del self._to_free[request_id]
        request_ids = list(scheduler_output.num_scheduled_tokens)
        indexed = {f.name for f in dataclasses.fields(ModelRunnerOutput)} >= {"req_id_to_index"}
        index: dict[str, Any] = (
            {"req_id_to_index": {r: i for i, r in enumerate(request_ids)}} if indexed else {}
        )
        return ModelRunnerOutput(
            req_ids=request_ids,
            sampled_token_ids=[[7] for _ in request_ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sent),
            **index,
        )


@dataclasses.dataclass(frozen=True)
class Step:
    at: float  # time.monotonic() in the engine core's process (one clock machine-wide)
    scheduled_tokens: int


def logged(log: Path) -> list[tuple[float, str]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [(float(at), what) for at, what in (line.split() for line in lines)]


def steps(log: Path) -> list[Step]:
    return [Step(at, int(tokens)) for at, tokens in logged(log) if tokens != TEARDOWN]


def decode_engine_config(tokenizer: bool = False, sidecar: str = NO_SIDECAR) -> VllmConfig:
    """A decode engine as the stack runs one, with kvbroker's connector and this module's
    worker; by default its sidecar address names no listener."""
    config = engine_config(
        "kv_consumer",
        prefix_caching=True,
        tokenizer=tokenizer,
        extra={
            "bidirectional_kv_xfer": True,
            "kvbroker_idle_wait_s": WAIT_S,
            "kvbroker_idle_step_sleep_s": 0,
            "kvbroker_sidecar": sidecar,
        },
    )
    config.parallel_config.worker_cls = f"{__name__}.FakeWorker"
    return config


def engine_core(config: VllmConfig) -> Any:
    """vLLM's client, with the engine core in a process of its own."""
    return EngineCoreClient.make_client(
        multiprocess_mode=True,
        asyncio_mode=False,
        vllm_config=config,
        executor_class=UniProcExecutor,
        log_stats=False,
    )


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Path]]:
    log = tmp_path / "steps.log"
    monkeypatch.setenv(STEP_LOG, str(log))
    client = engine_core(decode_engine_config())
    try:
        yield client, log
    finally:
        client.shutdown()


def turn_request(request_id: str, tokens: list[int]) -> EngineCoreRequest:
    """A DECODE_LOCAL turn of one conversation, as the router sends it to the decode node."""
    params = SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": handles.decode_local_params()}
    )
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        session_id="conversation-1",
    )


def finished(client: Any, request_id: str) -> dict[str, Any]:
    """The turn's final output's kv_transfer_params (the handle the decode node keeps)."""
    while True:
        for output in client.get_output().outputs:
            if output.request_id == request_id and output.finish_reason is not None:
                assert output.kv_transfer_params is not None
                return dict(output.kv_transfer_params)


def test_a_retaining_engine_core_waits_on_its_own_queue_between_turns(
    engine: tuple[Any, Path],
) -> None:
    client, log = engine
    tokens = prompt(40)
    for turn in range(TURNS):
        request_id = f"turn-{turn}"
        sent = time.monotonic()
        client.add_request(turn_request(request_id, tokens))
        if turn:
            # Sent during an idle wait (just after an idle step began one): scheduled at
            # once, well before that wait would have timed out.
            first = next(s for s in wait_for_steps(log, sent, scheduling=True))
            assert first.at - sent < WAIT_S / 2, (turn, first.at - sent)
        handle = handles.handle_from_params(finished(client, request_id))
        assert handle.remote_request_id == request_id  # retained: its handle is given out
        done = time.monotonic()
        # Retained: the engine core steps on, but one idle wait apart, not back to back.
        idle = wait_for_steps(log, done, scheduling=False, count=3)
        gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(idle)]
        assert all(gap >= 0.8 * WAIT_S for gap in gaps), gaps
        tokens = [*tokens, 7, *prompt(20)]  # the next turn: this one's prompt, answer, more


def wait_for_steps(
    log: Path, since: float, *, scheduling: bool, count: int = 1, timeout_s: float = 60.0
) -> list[Step]:
    """The first ``count`` steps after ``since`` that scheduled tokens (or that scheduled
    none), waiting for them to be logged."""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        matching = [
            s for s in steps(log) if s.at > since and (s.scheduled_tokens > 0) == scheduling
        ]
        if len(matching) >= count:
            return matching[:count]
        time.sleep(0.01)  # a poll of the log, not a wait for time to pass
    raise TimeoutError(f"{count} steps (scheduling={scheduling}) not logged in {timeout_s} s")


async def test_a_retaining_engine_core_frees_its_leases_and_exits_at_once_when_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "steps.log"
    monkeypatch.setenv(STEP_LOG, str(log))
    # A fresh engine-core process, as vLLM 0.32 starts it on CPU: vLLM 0.33+ would fork this
    # one, whose gRPC state (its channel to the registry) does not survive a fork.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    socket = tmp_path / "sidecar.sock"
    registry = await spawn_registry()
    try:
        async with FakeEngine("decode-0") as probed:
            sidecar = sidecar_process(registry.address, probed.url, "decode-0", socket)
            await sidecar.start()
            try:
                config = decode_engine_config(sidecar=f"unix:{socket}")
                client = await asyncio.to_thread(engine_core, config)
                try:
                    async with open_channel(RegistryEndpoint.parse(registry.address)) as channel:
                        await stop_while_retaining(client, registry_stub(channel), log)
                finally:
                    client.shutdown()  # a no-op once it has run
            finally:
                await sidecar.stop()
    finally:
        await registry.stop()


async def listed_leases(stub: Any, request: registry_pb2.ListLeasesRequest) -> list[Any]:
    return list((await stub.ListLeases(request, timeout=5)).leases)


async def stop_while_retaining(client: Any, stub: Any, log: Path) -> None:
    client.add_request(turn_request("turn-0", prompt(40)))
    params = await asyncio.to_thread(finished, client, "turn-0")
    assert handles.handle_from_params(params).remote_request_id == "turn-0"
    listed = registry_pb2.ListLeasesRequest(node_id="decode-0")
    leases = await eventually(lambda: listed_leases(stub, listed), what="the retained turn's lease")
    [lease] = leases
    assert lease.handle.remote_request_id == "turn-0"
    [process] = client.resources.engine_manager.processes

    started = time.monotonic()
    await asyncio.to_thread(client.shutdown, STOP_LIMIT_S)
    # It left its loop well within vLLM's grace (before, never: the retained turn held its
    # blocks for the hard cap, 480 s), and exited by itself (a kill says -9).
    teardowns = [at for at, what in logged(log) if what == TEARDOWN]
    assert teardowns, f"the engine core never left its loop in {STOP_LIMIT_S} s"
    assert teardowns[0] - started < GRACE_S / 5, teardowns[0] - started
    assert process.exitcode == 0, process.exitcode

    # The engine freed the blocks and said so before it exited: the lease ends, released by
    # its holder, not left live (offered to prefill nodes) until the sidecar goes too.
    async def lease_end() -> lease_pb2.Lease | None:
        request = registry_pb2.GetLeaseRequest(lease_id=lease.lease_id)
        found = (await stub.GetLease(request, timeout=5)).lease
        return None if found.state in LIVE_LEASE_STATES else found

    ended = await eventually(lease_end, what="the lease's end")
    assert ended is not None  # eventually returns only what is truthy
    assert ended.state == lease_pb2.LEASE_STATE_RELEASED, ended
    assert ended.end_cause == lease_pb2.LEASE_END_CAUSE_ENGINE, ended
