"""An engine step that scheduled nothing pauses, so that an engine holding retained blocks does
not spin: vLLM steps without pause while finished requests hold blocks (a retained one always
does). Briefly while requests wait (their progress is polled by steps); with nothing running or
waiting, until a client request comes or ``kvbroker_idle_wait_s`` has passed."""

from __future__ import annotations

import time

from kvbroker.engine_ext import vllm_compat


class IdlePause:
    def __init__(self, wait_s: float, step_sleep_s: float) -> None:
        self._wait_s = wait_s
        self._step_sleep_s = step_sleep_s
        # The engine core's loop, found at the first idle step (None: not found there).
        self._loop: vllm_compat.EngineLoop | None = None
        self._sought = False

    def pause(self) -> None:
        """Call from the connector's ``build_connector_meta`` (``find_engine_loop`` looks for
        vLLM's scheduler and engine core among the callers)."""
        if not self._sought:
            self._sought = True
            self._loop = vllm_compat.find_engine_loop()
        loop = self._loop
        if loop is not None and self._wait_s > 0 and not loop.unfinished():
            loop.wait_for_input(self._wait_s)
        elif self._step_sleep_s:
            time.sleep(self._step_sleep_s)
