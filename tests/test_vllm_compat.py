"""The compat module: its version gate (engine_ext loads only into the vLLM series it was
written against, and says which versions are involved when it refuses), what it answers per
release (sleep mode, the registration generation), and how an idle step finds the engine
core's loop and waits on it."""

from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Any

import pytest

from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.connector import NixlConnector
from kvbroker.engine_ext.engine_info import engine_info
from kvbroker.engine_ext.vllm_compat import (
    SUPPORTED_VLLM,
    VLLM_SERIES,
    EngineLoop,
    find_engine_loop,
    vllm_series,
)
from tests.test_connector_scheduler import engine_config, real_scheduler


@pytest.mark.parametrize("series", SUPPORTED_VLLM)
@pytest.mark.parametrize("release", ["", ".0", ".2rc1"])
def test_releases_of_every_supported_series_are_accepted(series: str, release: str) -> None:
    assert vllm_series(series + release) == series


@pytest.mark.parametrize("installed", ["0.35.0", "0.31.9", "0.3.2", "0.320.0", "1.0.0"])
def test_other_versions_are_refused_naming_the_supported_ones(installed: str) -> None:
    with pytest.raises(
        ImportError, match=rf"supports vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x, but vLLM {installed} "
    ):
        vllm_series(installed)


def test_the_installed_vllm_is_one_of_the_supported_series() -> None:
    assert VLLM_SERIES in SUPPORTED_VLLM
    assert vllm_compat.VLLM_VERSION.startswith(VLLM_SERIES)


class _Scheduler:
    """Calls the connector as vLLM's scheduler does, under an engine core's step."""

    def __init__(self, running: int = 0, waiting: int = 0) -> None:
        self.counts = (running, waiting)

    def get_request_counts(self) -> tuple[int, int]:
        return self.counts

    def schedule(self) -> EngineLoop | None:
        return find_engine_loop()


class _EngineCore:
    def __init__(self, scheduler: _Scheduler) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.scheduler = scheduler
        self.shutdown_requested = False

    def is_running(self) -> bool:
        return not self.shutdown_requested

    def step(self) -> EngineLoop | None:
        return self.scheduler.schedule()


def test_an_idle_step_finds_the_engine_core_s_queue_and_scheduler_on_its_stack() -> None:
    scheduler = _Scheduler(running=1, waiting=2)
    core = _EngineCore(scheduler)
    loop = core.step()
    assert loop is not None
    assert loop.input_queue is core.input_queue and loop.scheduler is scheduler
    assert loop.unfinished() == 3
    assert not loop.stopping()
    core.shutdown_requested = True  # vLLM's SIGTERM handler: shutdown_state leaves RUNNING
    assert loop.stopping()
    assert _Scheduler().schedule() is None  # no engine core above: nothing to wait on


def test_an_idle_wait_ends_when_a_request_is_queued_or_at_its_timeout() -> None:
    scheduler = _Scheduler()
    loop = EngineLoop(_EngineCore(scheduler), queue.Queue(), scheduler)
    started = time.monotonic()
    loop.wait_for_input(0.05)
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, loop.input_queue.put_nowait, args=("request",)).start()
    started = time.monotonic()
    loop.wait_for_input(5.0)
    assert time.monotonic() - started < 2.0
    loop.wait_for_input(5.0)  # already queued: no wait at all
    assert time.monotonic() - started < 2.0


def test_a_retaining_engine_refuses_sleep_mode() -> None:
    """vLLM 0.33+ asks the connector class at start when --enable-sleep-mode is set; a
    sleeping engine would discard KV held under live leases, so the answer is no."""
    config = engine_config("kv_consumer", True, {"bidirectional_kv_xfer": True})
    assert config.kv_transfer_config is not None
    assert not NixlConnector.supports_sleep_mode(config.kv_transfer_config)


def test_vllm_itself_refuses_to_start_a_retaining_engine_with_sleep_mode() -> None:
    """vLLM 0.33+'s own check, which its config runs at start: with ``--enable-sleep-mode``
    it loads the connector class named by the config and refuses the configuration on its
    answer. An engine that retains nothing passes it."""
    if not hasattr(vllm_compat.VllmNixlPullConnector, "supports_sleep_mode"):
        assert VLLM_SERIES == "0.32"  # no sleep-mode question to connectors before 0.33
        return
    retaining = engine_config("kv_consumer", True, {"bidirectional_kv_xfer": True})
    plain = engine_config("kv_consumer", True, {"bidirectional_kv_xfer": False})
    for config in (retaining, plain):
        assert config.model_config is not None
        config.model_config.enable_sleep_mode = True  # as --enable-sleep-mode sets it
    with pytest.raises(ValueError, match="NixlConnector does not support sleep mode"):
        retaining._verify_kv_transfer_compat()
    plain._verify_kv_transfer_compat()


def test_an_engine_that_retains_nothing_keeps_vllm_s_answer() -> None:
    config = engine_config("kv_producer", False, {"bidirectional_kv_xfer": False})
    assert config.kv_transfer_config is not None
    vllm_answer = getattr(vllm_compat.VllmNixlPullConnector, "supports_sleep_mode", None)
    if vllm_answer is None:
        # vLLM 0.32 asks connectors no sleep-mode question, so kvbroker's answer is never
        # read there; 0.33 and 0.34 (``make compat``) check the answer itself.
        assert VLLM_SERIES == "0.32"
        return
    assert NixlConnector.supports_sleep_mode(config.kv_transfer_config) == vllm_answer(
        config.kv_transfer_config
    )


def test_the_engine_reports_its_vllm_and_handshake_versions() -> None:
    """What the registry plans compatible reads from (docs/vllm-versions.md)."""
    config = engine_config("kv_consumer", True, {"bidirectional_kv_xfer": True})
    scheduler = real_scheduler(config, num_blocks=64)
    try:
        info = engine_info(config, scheduler.kv_cache_config, budget_blocks=8, hard_cap_s=60.0)
    finally:
        scheduler.shutdown()
    assert info.vllm_version == vllm_compat.VLLM_VERSION
    assert info.nixl_connector_version == {"0.32": 14, "0.33": 15, "0.34": 16}[VLLM_SERIES]
    # One worker (tp 1, pp 1): vLLM 0.33+ counts its first publish; 0.32 has no generations.
    assert info.registration_generation == (0 if VLLM_SERIES == "0.32" else 1)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (4, 2)], ids=str)
def test_the_reported_generation_is_vllm_s_count_once_every_rank_has_published(
    tp: int, pp: int
) -> None:
    """The engine reports its registration generation before its workers publish their NIXL
    payloads (``handshake_generation``); vLLM 0.33+'s scheduler then counts one per (pp rank,
    tp rank) payload that changes. Both must agree for any number of ranks, and a publish that
    changes nothing (the workers' payloads as they were) must not move the count."""
    config = engine_config("kv_consumer", True, {"bidirectional_kv_xfer": True})
    ranks = copy.deepcopy(config)
    # Set after the config is built: one process plays every rank's publish here.
    ranks.parallel_config.tensor_parallel_size = tp
    ranks.parallel_config.pipeline_parallel_size = pp
    reported = vllm_compat.handshake_generation(ranks)
    if VLLM_SERIES == "0.32":
        assert reported == 0  # no generations before 0.33
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlHandshakePayload,
    )

    scheduler = real_scheduler(config, num_blocks=64)
    connector = scheduler.connector
    assert isinstance(connector, NixlConnector)
    nixl: Any = connector._sched  # typed as vLLM 0.32's, which has no generations
    # No side-channel listener: what is counted is the publish, not the serving of it.
    nixl._nixl_handshake_listener_t = threading.Thread(target=lambda: None)
    payloads: dict[tuple[int, int], Any] = {
        (p, t): NixlHandshakePayload(
            compatibility_hash="same", agent_metadata_bytes=f"pp{p}-tp{t}".encode()
        )
        for p in range(pp)
        for t in range(tp)
    }
    try:
        nixl.set_xfer_handshake_metadata(payloads)
        assert nixl._registration_generation == reported == tp * pp
        nixl.set_xfer_handshake_metadata(payloads)
        assert nixl._registration_generation == reported
    finally:
        nixl._nixl_handshake_listener_t = None
        scheduler.shutdown()
