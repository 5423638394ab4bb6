"""`kvbroker demo`'s session with reuse on, played on real vLLM CPU servers through the router
as the demo plays it (``kvbroker_tools.demo.play``): it takes every path, each chosen by the planner
and never asked for, and forks: turn 1 RECOMPUTE (nothing retained), a tool result DECODE_LOCAL,
the pasted test log over the decode node's local limit READ (P read from D), a short question
DECODE_LOCAL, and the sub-agent a miss for the router whose prefill read its parent's KV."""

from __future__ import annotations

import io

import httpx
from rich.console import Console

from kvbroker_tools.demo import play, shown_path
from kvbroker_tools.stack import Stack
from tests.e2e_stack import e2e_marks, stack_fixture

pytestmark = e2e_marks()


# The demo's stack: `kvbroker demo` runs StackConfig's defaults.
stack = stack_fixture()


async def test_the_demo_takes_every_path_and_forks(stack: Stack, http: httpx.AsyncClient) -> None:
    turns = await play(http, stack, Console(file=io.StringIO()), reuse=True)
    assert [shown_path(turn) for turn in turns] == [
        "RECOMPUTE",
        "DECODE_LOCAL",
        "READ",
        "DECODE_LOCAL",
        "fork: READ",
    ], turns
    assert [turn["decision"] for turn in turns] == ["MISS", "REUSE", "REUSE", "REUSE", "MISS"]
    # What moved: P read from D on the READ and the fork, and on nothing else.
    assert [turn["kv_reads"] > 0 for turn in turns] == [False, False, True, False, True]
    assert all(turn["consistency"] == "EXACT" for turn in turns)
