"""NIXL's progress thread, calmed: NIXL's Python API gives no option for the delay between the
UCX progress thread's polls, so this patches the bindings vLLM's NIXL worker builds its agent
with (``calm_progress_thread``); on a small CPU host an idle worker otherwise burns a core.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

_PROGRESS_DELAY_MARK = "_kvbroker_progress_delay_us"


def calm_progress_thread(delay_us: int) -> None:
    """Makes NIXL's UCX progress thread sleep ``delay_us`` between polls.

    NIXL 1.5.1's Python API builds every agent with ``pthrDelay = 0``, so the progress thread
    polls with a zero timeout and each idle vLLM worker burns a whole core; on a small CPU host
    that starves the model's own threads. There is no option for it, so before vLLM creates its
    agent we hand NIXL's ``_api`` module a view of its bindings whose agent config never accepts
    a delay below ours. Only this process is affected; nothing installed is changed.
    """
    if delay_us <= 0:
        return
    agent_cls = getattr(base_worker, "NixlWrapper", None)
    if agent_cls is None:  # NIXL is not installed; vLLM reports that itself
        return
    api = sys.modules[agent_cls.__module__]
    bindings: Any = getattr(api, "nixlBind")  # noqa: B009 - not in NIXL's type stubs
    if getattr(bindings, _PROGRESS_DELAY_MARK, None) == delay_us:
        return
    original = getattr(bindings, "_kvbroker_original", bindings)

    class AgentConfig(original.nixlAgentConfig):  # type: ignore[name-defined,misc]
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay":
                value = max(int(value), delay_us)
            super().__setattr__(name, value)

    view = types.ModuleType(original.__name__)
    view.__dict__.update(original.__dict__)
    view.nixlAgentConfig = AgentConfig  # type: ignore[attr-defined]
    setattr(view, _PROGRESS_DELAY_MARK, delay_us)
    view._kvbroker_original = original  # type: ignore[attr-defined]
    setattr(api, "nixlBind", view)  # noqa: B010
