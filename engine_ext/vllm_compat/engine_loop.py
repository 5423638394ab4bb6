"""vLLM's engine-core loop as kvbroker's connector sees it: vLLM gives a connector no handle on
the loop that steps it, yet the connector must know two things about it. An engine that
retains KV is stepped without pause while finished requests hold blocks, so an idle step
waits on the loop's queue of client requests instead of spinning (``engine_ext.idle``); and a
stopping engine core exits only once no finished request holds blocks, so the connector must
see the stop to free what it retains (``NixlConnector._depart``). Both come from the engine
core object, found once on the scheduler's call stack.
"""

from __future__ import annotations

import queue
import sys
import types
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineLoop:
    """The engine core (``EngineCoreProc``), its queue of client requests and its scheduler."""

    engine: Any
    input_queue: queue.Queue[Any]
    scheduler: Any

    def unfinished(self) -> int:
        """Requests running or waiting (waiting for remote KV included)."""
        running, waiting = self.scheduler.get_request_counts()
        return int(running) + int(waiting)

    def wait_for_input(self, timeout_s: float) -> None:
        """Returns after ``timeout_s``, or as soon as a client request is queued."""
        inputs = self.input_queue
        with inputs.not_empty:  # the queue's own lock and condition, which put() notifies
            if not inputs._qsize():  # empty() would take the lock again
                inputs.not_empty.wait(timeout_s)

    def stopping(self) -> bool:
        """Whether the engine core was asked to shut down (SIGTERM or SIGINT: vLLM's
        ``shutdown_state`` left RUNNING). From then on it steps only while it has work, and
        a finished request that holds blocks counts as work (``Scheduler.has_requests``); at
        the end of its grace the process manager kills it."""
        return not self.engine.is_running()


def find_engine_loop(depth: int = 10) -> EngineLoop | None:
    """From the connector's ``build_connector_meta``: ``Scheduler.schedule`` and then
    ``EngineCore.step`` are its callers (vLLM 0.32 to 0.34). None where the stack is not that
    (another caller, an engine core without a request queue, or another vLLM)."""
    frame: types.FrameType | None = sys._getframe(1)
    scheduler = None
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if scheduler is None and callable(getattr(owner, "get_request_counts", None)):
            scheduler = owner
        inputs = getattr(owner, "input_queue", None)
        if isinstance(inputs, queue.Queue):
            found = scheduler is not None and callable(getattr(owner, "is_running", None))
            return EngineLoop(owner, inputs, scheduler) if found else None
        frame = frame.f_back
    return None
