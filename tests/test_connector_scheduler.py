"""The connector inside vLLM's real scheduler, with a fake lease-check transport: no worker, no
NIXL transfer, no sidecar (in the spirit of vLLM's own scheduler-level NIXL connector tests).

What is checked is what the scheduler does with a prefill request that carries a decode
node's handle: it is held back, without blocking the scheduler, while the lease check is in
flight; it is then read (only the verified prefix), or recomputed with the handle removed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Literal

import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvbroker.common.client.engine_link import EngineLink, LeaseAnswer
from kvbroker.common.rules import handles
from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.connector import NixlConnector
from kvbroker.engine_ext.prefix import prefix_hashes
from kvbroker.engine_ext.vllm_compat import KVCacheConfig, KVConnectorOutput
from kvbroker.v1 import lease_pb2, registry_pb2, sidecar_pb2
from kvbroker_tools.testmodel import make_model

BLOCK_SIZE = 16
PROMPT_TOKENS = 200
THRESHOLD = 64
WAIT_S = 0.3


class FakeLeaseLink(EngineLink):
    """An EngineLink that never connects: lease checks are futures the test answers."""

    def __init__(self) -> None:
        super().__init__("unix:/nonexistent", sidecar_pb2.EngineInfo())
        self.checks: list[tuple[str, int, Future[LeaseAnswer]]] = []
        # The retention events the engine sent its sidecar.
        self.events: list[registry_pb2.RetentionEvent] = []

    def _send(self, event: registry_pb2.RetentionEvent) -> None:
        self.events.append(event)
        super()._send(event)

    def not_retained_turns(self) -> list[tuple[str, int]]:
        return [
            (event.not_retained.conversation_id, event.not_retained.reason)
            for event in self.events
            if event.HasField("not_retained")
        ]

    def start_lease_check(self, lease_id: str, epoch: int, timeout_s: float) -> Future[LeaseAnswer]:
        future: Future[LeaseAnswer] = Future()
        self.checks.append((lease_id, epoch, future))
        return future


def engine_config(
    role: Literal["kv_producer", "kv_consumer"],
    prefix_caching: bool,
    extra: dict[str, object],
    async_scheduling: bool = False,
    tokenizer: bool = False,
) -> VllmConfig:
    """A small engine on the test model with kvbroker's connector, as the stack configures it;
    one batch in flight, as on CPU, unless ``async_scheduling`` (vLLM's default on CUDA); with
    its tokenizer only if ``tokenizer`` (an engine behind vLLM's OpenAI server)."""
    model = ModelConfig(
        model=str(make_model()), dtype="float32", seed=0, skip_tokenizer_init=not tokenizer
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_connector_module_path="kvbroker.engine_ext.connector",
            kv_role=role,
            kv_connector_extra_config={"kv_recompute_threshold": THRESHOLD, **extra},
        ),
        device_config=DeviceConfig("cpu"),
    )
    if async_scheduling:
        # Set once the config is built: vLLM's CPU platform turns it off then, a CUDA build
        # keeps it, and the scheduler and the connector take it from the built config.
        config.scheduler_config.async_scheduling = True
    return config


def real_scheduler(config: VllmConfig, num_blocks: int) -> Scheduler:
    """vLLM's own scheduler over ``num_blocks`` blocks of one full-attention group, of the
    class its engine core would build (``AsyncScheduler`` under async scheduling)."""
    config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    assert issubclass(scheduler_cls, Scheduler)
    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


# This module's scheduler tests run with one batch in flight (vLLM CPU) and with async
# scheduling (vLLM's default on CUDA: the next step is scheduled before the last one's output
# is in). Other modules that take these fixtures get one batch.
SCHEDULING = {"one-batch": False, "async-scheduling": True}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for name in ("vllm_config", "decode_config", "async_scheduling"):
        if name in metafunc.fixturenames:
            metafunc.parametrize(
                name,
                list(SCHEDULING.values()),
                ids=list(SCHEDULING),
                indirect=name != "async_scheduling",
                scope="module",
            )


def scheduling(request: pytest.FixtureRequest) -> bool:
    """A config fixture's async scheduling: as this module parametrizes it, else off."""
    return bool(getattr(request, "param", False))


@pytest.fixture(scope="module")
def vllm_config(request: pytest.FixtureRequest) -> VllmConfig:
    return engine_config(
        "kv_producer",
        prefix_caching=False,
        extra={"kvbroker_lease_check_timeout_s": WAIT_S, "kvbroker_idle_step_sleep_s": 0},
        async_scheduling=scheduling(request),
    )


@pytest.fixture
def scheduler(vllm_config: VllmConfig) -> Iterator[Scheduler]:
    built = real_scheduler(vllm_config, 256)
    yield built
    built.shutdown()


@pytest.fixture
def link(scheduler: Scheduler) -> FakeLeaseLink:
    connector = scheduler.connector
    assert isinstance(connector, NixlConnector)
    fake = FakeLeaseLink()
    connector.link = fake
    return fake


def prompt(length: int = PROMPT_TOKENS) -> list[int]:
    return [(7 * i + 3) % 4000 + 5 for i in range(length)]


def request_with_handle(
    request_id: str, tokens: list[int], remote_tokens: int, verified_tokens: int
) -> Request:
    """A prefill request whose handle offers ``remote_tokens`` of KV, of which the block
    hashes match this prompt for ``verified_tokens`` (a block multiple)."""
    hashes = prefix_hashes(tokens, BLOCK_SIZE, remote_tokens)
    other = prefix_hashes([t + 1 for t in tokens], BLOCK_SIZE, remote_tokens)
    matching = verified_tokens // BLOCK_SIZE
    lease = lease_pb2.Lease(
        lease_id="lease-1",
        epoch=3,
        handle=lease_pb2.KvHandle(
            remote_engine_id="decode-0",
            remote_request_id="d-1",
            remote_block_groups=[
                lease_pb2.BlockIdGroup(block_ids=range(-(-remote_tokens // BLOCK_SIZE)))
            ],
            remote_host="127.0.0.1",
            remote_port=5600,
            remote_num_tokens=remote_tokens,
        ),
        block_hashes=hashes[:matching] + other[matching:],
    )
    request = Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    request.kv_transfer_params = handles.prefill_params(lease)
    return request


def params_of(request: Request) -> dict[str, Any]:
    assert request.kv_transfer_params is not None
    return request.kv_transfer_params


def scheduled_tokens(output: SchedulerOutput, request: Request) -> int:
    return output.num_scheduled_tokens.get(request.request_id, 0)


def assert_recomputed(output: SchedulerOutput, request: Request) -> None:
    """The whole prompt is computed here and the handle is gone (the decode node is never
    read or notified)."""
    assert scheduled_tokens(output, request) == PROMPT_TOKENS
    assert request.status == RequestStatus.RUNNING
    assert not any(key in params_of(request) for key in handles.HANDLE_KEYS)


def test_the_request_waits_for_the_lease_check_then_reads_the_verified_prefix(
    scheduler: Scheduler, link: FakeLeaseLink
) -> None:
    request = request_with_handle("r-read", prompt(), remote_tokens=192, verified_tokens=160)
    scheduler.add_request(request)

    for _ in range(3):  # the check is asked once; the scheduler keeps going meanwhile
        started = time.monotonic()
        output = scheduler.schedule()
        assert time.monotonic() - started < WAIT_S / 2
        assert scheduled_tokens(output, request) == 0
        assert request.status == RequestStatus.WAITING
    assert [(lease, epoch) for lease, epoch, _ in link.checks] == [("lease-1", 3)]

    link.checks[0][2].set_result(LeaseAnswer(True, "live"))
    scheduler.schedule()
    # Admitted to read the remote KV asynchronously, trimmed to the verified prefix.
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    params = params_of(request)
    assert params["remote_num_tokens"] == 160
    assert [len(group) for group in params["remote_block_ids"]] == [160 // BLOCK_SIZE]
    assert len(link.checks) == 1


def test_a_declined_lease_is_recomputed_without_the_handle(
    scheduler: Scheduler, link: FakeLeaseLink
) -> None:
    request = request_with_handle("r-declined", prompt(), remote_tokens=192, verified_tokens=192)
    scheduler.add_request(request)
    assert scheduled_tokens(scheduler.schedule(), request) == 0

    link.checks[0][2].set_result(LeaseAnswer(False, "lease superseded"))
    assert_recomputed(scheduler.schedule(), request)


def test_an_unanswered_check_means_recompute_after_its_bound(
    scheduler: Scheduler, link: FakeLeaseLink
) -> None:
    request = request_with_handle("r-silent", prompt(), remote_tokens=192, verified_tokens=192)
    scheduler.add_request(request)
    started = time.monotonic()
    while scheduled_tokens(output := scheduler.schedule(), request) == 0:
        assert time.monotonic() - started < WAIT_S + 2.0, "the request was never scheduled"
        time.sleep(0.01)
    assert time.monotonic() - started >= WAIT_S
    assert_recomputed(output, request)
    assert len(link.checks) == 1


def test_a_prefix_below_the_threshold_is_recomputed_without_asking(
    scheduler: Scheduler, link: FakeLeaseLink
) -> None:
    request = request_with_handle("r-short", prompt(), remote_tokens=192, verified_tokens=48)
    scheduler.add_request(request)
    assert_recomputed(scheduler.schedule(), request)
    assert link.checks == []


def test_a_request_aborted_while_its_check_is_in_flight_leaves_nothing_behind(
    scheduler: Scheduler, link: FakeLeaseLink
) -> None:
    request = request_with_handle("r-aborted", prompt(), remote_tokens=192, verified_tokens=192)
    scheduler.add_request(request)
    scheduler.schedule()
    assert len(link.checks) == 1
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    connector = scheduler.connector
    assert isinstance(connector, NixlConnector)
    assert connector._pending_checks == {}


# ------------------------------------------------------------ decode side: what the worker frees


@pytest.fixture(scope="module")
def decode_config(request: pytest.FixtureRequest) -> VllmConfig:
    """A decode engine as the stack runs one: prefix caching (a DECODE_LOCAL turn finds its
    conversation's retained blocks there) and vLLM's bidirectional retention."""
    return engine_config(
        "kv_consumer",
        prefix_caching=True,
        extra={"bidirectional_kv_xfer": True, "kvbroker_idle_step_sleep_s": 0},
        async_scheduling=scheduling(request),
    )


@pytest.fixture
def decode_scheduler(decode_config: VllmConfig) -> Iterator[Scheduler]:
    built = real_scheduler(decode_config, 64)
    connector = built.connector
    assert isinstance(connector, NixlConnector)
    connector.link = FakeLeaseLink()
    yield built
    built.shutdown()


class WorkerFrees:
    """vLLM 0.32's NIXL pull worker's bookkeeping of delayed frees
    (``NixlPullConnectorWorker.start_load_kv``), step by step: a request it will ever free
    must first come in some step's ``reqs_in_batch``; a ``reqs_to_send`` deadline for any other
    request is dropped, so its blocks are never reported ``finished_sending`` and the
    scheduler never frees them."""

    def __init__(self) -> None:
        self.to_process: set[str] = set()
        self.deadlines: dict[str, float] = {}

    def step(self, output: SchedulerOutput) -> None:
        meta = output.kv_connector_metadata
        assert isinstance(meta, NixlConnectorMetadata)
        self.to_process |= set(meta.reqs_in_batch)
        self.to_process -= set(meta.reqs_not_processed)
        for request_id, deadline in meta.reqs_to_send.items():
            if request_id in self.to_process:
                self.deadlines[request_id] = deadline


init_none_hash(sha256)


def decode_local_request(
    request_id: str, tokens: list[int], session: str = "conversation-1"
) -> Request:
    """A turn the planner sent to the decode node alone (``handles.decode_local_params``)."""
    request = Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        session_id=session,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    request.kv_transfer_params = handles.decode_local_params()
    return request


def test_a_decode_local_turn_is_retained_only_as_the_worker_will_free_it(
    decode_scheduler: Scheduler,
) -> None:
    connector = decode_scheduler.connector
    assert isinstance(connector, NixlConnector)
    worker = WorkerFrees()
    request = decode_local_request("d-local", prompt())
    decode_scheduler.add_request(request)
    output = decode_scheduler.schedule()
    worker.step(output)
    assert scheduled_tokens(output, request) == PROMPT_TOKENS

    decode_scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
    worker.step(decode_scheduler.schedule())
    # Retained under a lease, as after a decode leg ...
    assert "d-local" in connector._retained
    # ... and the worker holds a deadline for it, so the lease's end (a reclaim, an expiry)
    # frees the blocks. Without one they stay allocated whatever the registry says.
    assert "d-local" in worker.deadlines

    # The registry ends the lease (a reclaim under pressure): the worker frees at once.
    connector._retained["d-local"].end_cause = lease_pb2.LEASE_END_CAUSE_PRESSURE
    vllm_compat.free_at(connector._sched, "d-local", time.perf_counter())
    worker.step(decode_scheduler.schedule())
    assert worker.deadlines["d-local"] <= time.perf_counter()


def decode_link(scheduler: Scheduler) -> FakeLeaseLink:
    connector = scheduler.connector
    assert isinstance(connector, NixlConnector)
    assert isinstance(connector.link, FakeLeaseLink)
    return connector.link


def test_a_decode_local_turn_aborted_before_it_ran_keeps_nothing(
    decode_scheduler: Scheduler,
) -> None:
    connector = decode_scheduler.connector
    assert isinstance(connector, NixlConnector)
    request = decode_local_request("d-aborted", prompt())
    decode_scheduler.add_request(request)
    decode_scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert connector._retained == {}
    assert decode_scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    # The registry hears that nothing of the turn was retained, so no hint waits for it.
    assert decode_link(decode_scheduler).not_retained_turns() == [
        ("conversation-1", registry_pb2.NOT_RETAINED_REASON_ABORTED)
    ]


def test_a_retained_turn_reports_its_retention_not_its_end(
    decode_scheduler: Scheduler,
) -> None:
    retained_turn(decode_scheduler, "d-kept", prompt())
    link = decode_link(decode_scheduler)
    assert [event.WhichOneof("event") for event in link.events] == ["retained"]


def test_a_decode_engine_that_does_not_retain_says_so_for_each_turn(async_scheduling: bool) -> None:
    """``kvbroker up --reuse off``: the engine ends every turn without retaining it, and says
    so (the registry takes the node as not retaining from its registration, too)."""
    config = engine_config(
        "kv_consumer", prefix_caching=True, extra={}, async_scheduling=async_scheduling
    )
    scheduler = real_scheduler(config, 64)
    try:
        connector = scheduler.connector
        assert isinstance(connector, NixlConnector)
        connector.link = FakeLeaseLink()
        retained_turn(scheduler, "d-off", prompt())
        assert connector._retained == {}
        assert decode_link(scheduler).not_retained_turns() == [
            ("conversation-1", registry_pb2.NOT_RETAINED_REASON_RETENTION_OFF)
        ]
        assert not vllm_compat.retains_kv(config)
    finally:
        scheduler.shutdown()


def retained_turn(scheduler: Scheduler, request_id: str, tokens: list[int]) -> list[int]:
    """Runs a DECODE_LOCAL turn to its end (retained under its lease); returns its blocks."""
    request = decode_local_request(request_id, tokens)
    scheduler.add_request(request)
    assert scheduled_tokens(scheduler.schedule(), request) == len(tokens)
    blocks = list(scheduler.kv_cache_manager.get_block_ids(request_id)[0])
    scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED)
    return blocks


def test_the_next_decode_local_turn_copies_the_retained_tail_instead_of_recomputing_it(
    decode_config: VllmConfig, decode_scheduler: Scheduler
) -> None:
    first = retained_turn(decode_scheduler, "d-turn-1", prompt())
    # 200 tokens: 12 full blocks the prefix cache gives back, and 8 in an unfinished block it
    # never caches; the retained request holds their KV.
    follow_up = decode_local_request("d-turn-2", [*prompt(), *range(4001, 4031)])
    decode_scheduler.add_request(follow_up)
    output = decode_scheduler.schedule()

    blocks = decode_scheduler.kv_cache_manager.get_block_ids("d-turn-2")[0]
    assert blocks[:12] == first[:12]  # the prefix-cache hit shares the blocks
    meta = output.kv_connector_metadata
    assert meta is not None
    if decode_config.max_concurrent_batches > 1:
        # The copy's source could be freed before the step that copies it runs: copies are
        # off, and the tail is computed again with the new tokens.
        assert scheduled_tokens(output, follow_up) == 230 - 192
        assert vllm_compat.block_copies(meta) == []
        return
    assert scheduled_tokens(output, follow_up) == 30  # only the new tokens are computed
    assert follow_up.num_computed_tokens == 230
    # The unfinished block is copied into the follow-up's own block at the same position.
    assert vllm_compat.block_copies(meta) == [(first[12], blocks[12])]


def test_another_conversation_or_a_freed_tail_is_recomputed(
    decode_scheduler: Scheduler,
) -> None:
    connector = decode_scheduler.connector
    assert isinstance(connector, NixlConnector)
    retained_turn(decode_scheduler, "d-turn-1", prompt())
    other = decode_local_request("d-other", [*prompt(), 4001, 4002], session="conversation-2")
    decode_scheduler.add_request(other)
    output = decode_scheduler.schedule()
    assert scheduled_tokens(output, other) == 202 - 192
    assert output.kv_connector_metadata is not None
    assert vllm_compat.block_copies(output.kv_connector_metadata) == []

    # The tail's blocks are freed (the worker reports the retained request done): forgotten.
    connector.update_connector_output(KVConnectorOutput(finished_sending={"d-turn-1"}))
    late = decode_local_request("d-late", [*prompt(), 4003, 4004])
    decode_scheduler.add_request(late)
    assert scheduled_tokens(decode_scheduler.schedule(), late) == 202 - 192


def test_retained_tail_copies_are_for_one_full_attention_group_with_one_batch_in_flight() -> None:
    def groups(*specs: Any) -> KVCacheConfig:
        return KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)
            ],
        )

    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    window = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=64
    )
    extra: dict[str, object] = {"bidirectional_kv_xfer": True}
    one_batch = engine_config("kv_consumer", prefix_caching=True, extra=extra)
    assert vllm_compat.tail_reuse_unsupported(one_batch, groups(full)) is None
    assert vllm_compat.tail_reuse_unsupported(one_batch, groups(full, window))
    assert vllm_compat.tail_reuse_unsupported(one_batch, groups(window))
    overlapped = engine_config("kv_consumer", True, extra, async_scheduling=True)
    assert vllm_compat.tail_reuse_unsupported(overlapped, groups(full))


def worker_output(
    request_ids: list[str], token: int, kv: KVConnectorOutput | None = None
) -> ModelRunnerOutput:
    """What a worker hands back for a step that sampled ``token`` for each of ``request_ids``,
    with its connector's report (vLLM 0.34 indexes the requests itself)."""
    indexed = {f.name for f in dataclasses.fields(ModelRunnerOutput)} >= {"req_id_to_index"}
    index: dict[str, Any] = (
        {"req_id_to_index": {r: i for i, r in enumerate(request_ids)}} if indexed else {}
    )
    return ModelRunnerOutput(
        req_ids=request_ids,
        sampled_token_ids=[[token] for _ in request_ids],
        kv_connector_output=kv,
        **index,
    )


def test_a_retained_turn_s_handle_reaches_the_engine_output_and_its_blocks_outlive_it(
    decode_scheduler: Scheduler,
) -> None:
    """A turn through the scheduler's own output path, as the engine core runs it: the sampled
    token finishes the request, the engine output carries D's handle for the next turn, the
    blocks stay allocated while retained, and are freed once the worker reports the request
    done (``finished_sending``), never before."""
    pool = decode_scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    request = decode_local_request("d-out", prompt())
    decode_scheduler.add_request(request)
    step = decode_scheduler.schedule()
    assert scheduled_tokens(step, request) == PROMPT_TOKENS
    held = list(decode_scheduler.kv_cache_manager.get_block_ids("d-out")[0])

    outputs = decode_scheduler.update_from_output(step, worker_output(["d-out"], 42))
    (finished,) = [o for engine in outputs.values() for o in engine.outputs]
    assert finished.request_id == "d-out" and finished.finish_reason is not None
    assert finished.kv_transfer_params is not None
    handle = handles.handle_from_params(finished.kv_transfer_params)
    assert handle.remote_request_id == "d-out"
    assert list(handle.remote_block_groups[0].block_ids) == held
    assert pool.get_num_free_blocks() == free_before - len(held)  # retained, not freed

    # Steps go on while the turn is retained; then the worker reports it done.
    decode_scheduler.update_from_output(decode_scheduler.schedule(), worker_output([], 0))
    assert pool.get_num_free_blocks() == free_before - len(held)
    done = KVConnectorOutput(finished_sending={"d-out"})
    decode_scheduler.update_from_output(decode_scheduler.schedule(), worker_output([], 0, done))
    assert pool.get_num_free_blocks() == free_before
