"""A fork's match by content inside vLLM's real scheduler, with a fake sidecar link: a prefill
leg of a conversation with no handle of its own waits, without blocking the scheduler, for
the registry's MatchPrefix; a match becomes its handle, and the leg goes on as a kvbroker-
routed one (the lease check, the verified prefix, the read), reading without freeing the
decode node's blocks. No session id (reuse off), the operator's switch off, or no answer in
time: the prompt is computed here, whole."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvbroker.common.client.engine_link import LeaseAnswer, PrefixAnswer
from kvbroker.common.rules import handles
from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.engine_ext.connector import NixlConnector
from kvbroker.engine_ext.prefix import prefix_hashes
from kvbroker.engine_ext.prefix_match import FORK_KEY, probes
from kvbroker.v1 import lease_pb2, registry_pb2
from tests.test_connector_scheduler import (
    BLOCK_SIZE,
    PROMPT_TOKENS,
    WAIT_S,
    FakeLeaseLink,
    engine_config,
    params_of,
    prompt,
    real_scheduler,
    scheduled_tokens,
)


class FakeForkLink(FakeLeaseLink):
    """Lease checks and prefix matches are futures the test answers."""

    def __init__(self) -> None:
        super().__init__()
        self.matches: list[tuple[str, int, list[bytes], Future[PrefixAnswer]]] = []
        self.ended_pins: list[tuple[str, str]] = []

    def start_prefix_match(
        self, conversation_id: str, block_size: int, probes: list[bytes], timeout_s: float
    ) -> Future[PrefixAnswer]:
        future: Future[PrefixAnswer] = Future()
        self.matches.append((conversation_id, block_size, probes, future))
        return future

    def end_pin(self, lease_id: str, pin_id: str) -> None:
        self.ended_pins.append((lease_id, pin_id))


def configured(extra: dict[str, object]) -> VllmConfig:
    return engine_config(
        "kv_producer",
        prefix_caching=False,
        extra={"kvbroker_lease_check_timeout_s": WAIT_S, "kvbroker_idle_step_sleep_s": 0, **extra},
    )


@pytest.fixture(scope="module")
def on_config() -> VllmConfig:
    return configured({})


@pytest.fixture
def scheduler(on_config: VllmConfig) -> Iterator[Scheduler]:
    built = real_scheduler(on_config, 256)
    yield built
    built.shutdown()


@pytest.fixture
def link(scheduler: Scheduler) -> FakeForkLink:
    connector = scheduler.connector
    assert isinstance(connector, NixlConnector)
    fake = FakeForkLink()
    connector.link = fake
    return fake


def prefill_leg(request_id: str, tokens: list[int], session: str | None) -> Request:
    """A prefill leg kvbroker's router sends for a MISS (no handle), with the turn's session."""
    request = Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        session_id=session,
    )
    request.kv_transfer_params = handles.prefill_params(None)
    return request


def parent_lease(tokens: list[int], retained: int) -> lease_pb2.Lease:
    """The parent's lease as MatchPrefix answers it: it retained the prompt's first tokens."""
    kept = Checkpoints.of(prefix_hashes(tokens, BLOCK_SIZE, retained))
    return lease_pb2.Lease(
        lease_id="parent-lease",
        conversation_id="acme/parent",
        epoch=7,
        handle=lease_pb2.KvHandle(
            remote_engine_id="decode-0",
            remote_request_id="d-parent",
            remote_block_groups=[
                lease_pb2.BlockIdGroup(block_ids=range(-(-retained // BLOCK_SIZE)))
            ],
            remote_host="127.0.0.1",
            remote_port=5600,
            remote_num_tokens=retained,
        ),
        block_hashes=kept.hashes,
        block_hash_stride=kept.stride,
        state=lease_pb2.LEASE_STATE_ACTIVE,
    )


def test_a_fork_waits_for_its_match_then_reads_the_parent_s_prefix_without_freeing_it(
    scheduler: Scheduler, link: FakeForkLink
) -> None:
    tokens = prompt()
    request = prefill_leg("fork-1", tokens, "acme/fork")
    scheduler.add_request(request)
    for _ in range(3):
        started = time.monotonic()
        output = scheduler.schedule()
        assert time.monotonic() - started < WAIT_S / 2
        assert scheduled_tokens(output, request) == 0
    assert len(link.matches) == 1
    conversation, block_size, asked, answer = link.matches[0]
    # 199 tokens before the last: 12 full blocks, probed at 0, 1, 3 and 7.
    assert (conversation, block_size) == ("acme/fork", BLOCK_SIZE)
    assert asked == probes(tokens, BLOCK_SIZE) and len(asked) == 4
    match = registry_pb2.MatchPrefixResponse(
        lease=parent_lease(tokens, 160), matched_blocks=8, pin_id="pin-1"
    )
    answer.set_result(PrefixAnswer(match))
    scheduler.schedule()
    # From here on, the leg of a handle: the lease check, asked once.
    assert [(lease, epoch) for lease, epoch, _ in link.checks] == [("parent-lease", 7)]
    link.checks[0][2].set_result(LeaseAnswer(True, "pinned", shared=True))
    scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    params = params_of(request)
    assert params[FORK_KEY] and params["remote_num_tokens"] == 160
    # What the prefill engine will tell the router it read by content.
    assert handles.content_read_tokens(params) == 160
    # The read's completion names no request the decode node retains: it frees nothing.
    assert params["remote_request_id"] != "d-parent"
    assert params["remote_request_id"].startswith("HB:")
    assert params["remote_request_id"].endswith("d-parent")
    assert len(link.matches) == 1
    # Its read over (here: the request ends), the pin ends at once, not at its timeout.
    assert link.ended_pins == []
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert link.ended_pins == [("parent-lease", "pin-1")]


def test_no_match_means_the_prompt_is_computed_here(
    scheduler: Scheduler, link: FakeForkLink
) -> None:
    request = prefill_leg("fork-2", prompt(), "acme/fork")
    scheduler.add_request(request)
    assert scheduled_tokens(scheduler.schedule(), request) == 0
    none = registry_pb2.MatchPrefixResponse(no_reuse=registry_pb2.NO_REUSE_REASON_NO_PREFIX_MATCH)
    link.matches[0][3].set_result(PrefixAnswer(none))
    assert scheduled_tokens(scheduler.schedule(), request) == PROMPT_TOKENS
    assert link.checks == [] and "remote_block_ids" not in params_of(request)


def test_an_unanswered_match_means_compute_after_its_bound(
    scheduler: Scheduler, link: FakeForkLink
) -> None:
    request = prefill_leg("fork-3", prompt(), "acme/fork")
    scheduler.add_request(request)
    started = time.monotonic()
    while scheduled_tokens(output := scheduler.schedule(), request) == 0:
        assert time.monotonic() - started < WAIT_S + 2.0, "the request was never scheduled"
        time.sleep(0.01)
    assert time.monotonic() - started >= WAIT_S
    assert scheduled_tokens(output, request) == PROMPT_TOKENS
    assert len(link.matches) == 1


def test_a_request_without_a_session_id_is_plain_p_d_and_asks_nothing(
    scheduler: Scheduler, link: FakeForkLink
) -> None:
    request = prefill_leg("plain", prompt(), None)
    scheduler.add_request(request)
    assert scheduled_tokens(scheduler.schedule(), request) == PROMPT_TOKENS
    assert link.matches == []


def test_a_short_prompt_asks_nothing(scheduler: Scheduler, link: FakeForkLink) -> None:
    request = prefill_leg("short", prompt(40), "acme/fork")
    scheduler.add_request(request)
    assert scheduled_tokens(scheduler.schedule(), request) == 40
    assert link.matches == []


def test_the_operator_s_switch_turns_matching_off() -> None:
    built = real_scheduler(configured({"kvbroker_prefix_match": False}), 256)
    try:
        connector = built.connector
        assert isinstance(connector, NixlConnector)
        fake = connector.link = FakeForkLink()
        request = prefill_leg("off", prompt(), "acme/fork")
        built.add_request(request)
        assert scheduled_tokens(built.schedule(), request) == PROMPT_TOKENS
        assert fake.matches == []
    finally:
        built.shutdown()
