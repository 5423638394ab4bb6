"""An engine step that scheduled nothing pauses, so that an engine holding retained blocks does
not spin: vLLM steps without pause while finished requests hold blocks (a retained one always
does). Briefly while requests wait (their progress is polled by steps); with nothing running or
waiting, until a client request comes or ``kvbroker_idle_wait_s`` has passed. A stopping engine
never pauses: the connector frees what it retains so that the engine core can exit, and says so
by asking ``stopping`` first."""

from __future__ import annotations

import time

from kvbroker.engine_ext import vllm_compat


class IdlePause:
    def __init__(self, wait_s: float, step_sleep_s: float) -> None:
        self._wait_s = wait_s
        self._step_sleep_s = step_sleep_s
        # The engine core's loop, found at the first step (None: not found there).
        self._loop: vllm_compat.EngineLoop | None = None
        self._sought = False

    def stopping(self) -> bool:
        """Whether the engine core was asked to shut down. Call from the connector's
        ``build_connector_meta`` (``find_engine_loop`` looks for vLLM's scheduler and engine
        core among the callers); an engine core not found there is never stopping."""
        loop = self._find()
        return loop is not None and loop.stopping()

    def pause(self) -> None:
        """Call from the connector's ``build_connector_meta``, as ``stopping``."""
        loop = self._find()
        if loop is not None and self._wait_s > 0 and not loop.unfinished():
            loop.wait_for_input(self._wait_s)
        elif self._step_sleep_s:
            time.sleep(self._step_sleep_s)

    def _find(self) -> vllm_compat.EngineLoop | None:
        if not self._sought:
            self._sought = True
            # Its caller's caller is the connector's build_connector_meta.
            self._loop = vllm_compat.find_engine_loop(depth=11)
        return self._loop
