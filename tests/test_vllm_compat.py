"""The compat module: its version gate (engine_ext loads only into the vLLM series it was
written against, and says which versions are involved when it refuses), and how an idle step
finds the engine core's loop and waits on it."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from kvbroker.engine_ext.vllm_compat import (
    SUPPORTED_VLLM,
    EngineLoop,
    check_vllm_version,
    find_engine_loop,
)


@pytest.mark.parametrize(
    "installed", [SUPPORTED_VLLM, f"{SUPPORTED_VLLM}.0", f"{SUPPORTED_VLLM}.2rc1"]
)
def test_releases_of_the_supported_series_are_accepted(installed: str) -> None:
    check_vllm_version(installed)


@pytest.mark.parametrize("installed", ["0.33.0", "0.31.9", "0.3.2", "0.320.0", "1.0.0"])
def test_other_versions_are_refused_naming_both(installed: str) -> None:
    with pytest.raises(ImportError, match=rf"supports vLLM {SUPPORTED_VLLM}\.x.*vLLM {installed} "):
        check_vllm_version(installed)


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

    def step(self) -> EngineLoop | None:
        return self.scheduler.schedule()


def test_an_idle_step_finds_the_engine_core_s_queue_and_scheduler_on_its_stack() -> None:
    scheduler = _Scheduler(running=1, waiting=2)
    core = _EngineCore(scheduler)
    loop = core.step()
    assert loop is not None
    assert loop.input_queue is core.input_queue and loop.scheduler is scheduler
    assert loop.unfinished() == 3
    assert _Scheduler().schedule() is None  # no engine core above: nothing to wait on


def test_an_idle_wait_ends_when_a_request_is_queued_or_at_its_timeout() -> None:
    loop = EngineLoop(queue.Queue(), _Scheduler())
    started = time.monotonic()
    loop.wait_for_input(0.05)
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, loop.input_queue.put_nowait, args=("request",)).start()
    started = time.monotonic()
    loop.wait_for_input(5.0)
    assert time.monotonic() - started < 2.0
    loop.wait_for_input(5.0)  # already queued: no wait at all
    assert time.monotonic() - started < 2.0
