"""`kvbroker demo`'s result as a new user's 80-column terminal shows it, from recorded turns
(measured_turn's measurements, as a run of the demo on vLLM CPU engines gave them): each
turn's path and what it read from D on one line, nothing cut; every path (RECOMPUTE,
DECODE_LOCAL, READ) and the fork appear, each with why it was taken; and a caption that says
what each path is rather than promising one. ``tests/test_e2e_demo.py`` plays the session on
real engines and checks that it takes these paths."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from kvbroker_tools.demo import LOCAL_LIMIT, STEPS, show_turns, shown_path, why


def _turn(
    tokens: int,
    path: str,
    read_bytes: float,
    prefill_ms: float,
    ttft_ms: float,
    decision: str = "REUSE",
) -> Any:
    return {
        "input_num_tokens": tokens,
        "output_num_tokens": 24,
        "ttft_ms": ttft_ms,
        "e2e_ms": ttft_ms + 900.0,
        "prefill_leg_ms": prefill_ms,
        "kv_read_ms": 41.0 if read_bytes else 0.0,
        "kv_read_bytes": read_bytes,
        "kv_reads": 1 if read_bytes else 0,
        "decision": decision,
        "path": path,
        "consistency": "EXACT",
    }


# A run of the demo (vLLM CPU engines, this machine): turn 1 recomputed, two stayed on D, the
# pasted test log was read from D, and the sub-agent (the router's miss) read its parent's KV.
ON = [
    _turn(881, "RECOMPUTE", 0.0, 1061.0, 1315.0, "MISS"),
    _turn(1610, "DECODE_LOCAL", 0.0, 0.0, 1613.0),
    _turn(4064, "READ", 10_223_616.0, 5142.0, 5385.0),
    _turn(4138, "DECODE_LOCAL", 0.0, 0.0, 227.0),
    _turn(4220, "RECOMPUTE", 25_821_184.0, 473.0, 549.0, "MISS"),
]
OFF = [
    _turn(881, "RECOMPUTE", 0.0, 892.0, 959.0, "MISS"),
    _turn(1610, "RECOMPUTE", 0.0, 2426.0, 2509.0, "MISS"),
    _turn(4064, "RECOMPUTE", 0.0, 7712.0, 7804.0, "MISS"),
    _turn(4138, "RECOMPUTE", 0.0, 7605.0, 7677.0, "MISS"),
    _turn(4220, "RECOMPUTE", 0.0, 10060.0, 10488.0, "MISS"),
]


def _rendered(width: int) -> list[str]:
    out = io.StringIO()
    show_turns(Console(file=out, width=width, color_system=None), ON, OFF)
    return out.getvalue().splitlines()


def _rows(lines: list[str]) -> list[list[str]]:
    """The table's turn rows, split into words (the first lines that start with a turn's
    number: the reasons, which do too, come after the table)."""
    numbers = [[str(n)] for n in range(1, len(ON) + 1)]
    return [line.split() for line in lines if line.split()[:1] in numbers][: len(ON)]


def test_each_turn_is_one_line_with_its_path_and_what_it_read() -> None:
    lines = _rendered(80)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert not any("…" in line for line in lines), "a cell was cut:\n" + "\n".join(lines)
    assert _rows(lines) == [
        ["1", "881", "RECOMPUTE", "none", "1061", "892", "1315", "959"],
        ["2", "1610", "DECODE_LOCAL", "none", "0", "2426", "1613", "2509"],
        ["3", "4064", "READ", "10.2", "MB", "5142", "7712", "5385", "7804"],
        ["4", "4138", "DECODE_LOCAL", "none", "0", "7605", "227", "7677"],
        ["5", "4220", "fork:", "READ", "25.8", "MB", "473", "10060", "549", "10488"],
    ]


def test_every_path_and_the_fork_appear_each_with_why() -> None:
    assert [shown_path(turn) for turn in ON] == [
        "RECOMPUTE",
        "DECODE_LOCAL",
        "READ",
        "DECODE_LOCAL",
        "fork: READ",
    ]
    lines = _rendered(80)
    start = next(n for n, line in enumerate(lines) if line.startswith("why (ON)"))
    reasons = [line.strip() for line in lines[start + 1 : start + 1 + len(ON)]]
    assert reasons == [
        "1  a new session: nothing is retained yet, P computes it all",
        "2  705 new tokens: D computes them on the history it holds",
        f"3  2,430 new tokens, over D's {LOCAL_LIMIT:,} limit: P reads the history",
        "4  50 new tokens: D computes them on the history it holds",
        "5  new session id, its prompt a parent's: P read the parent's KV",
    ]


def test_why_says_what_the_headers_and_sizes_say() -> None:
    """The reasons the recorded run does not show: each from the headers alone, never longer
    than a numbered line of 80 columns leaves."""
    read = _turn(1000, "READ", 1e6, 500.0, 600.0)
    reasons = [
        why(read, 300),
        why(_turn(1000, "RECOMPUTE", 0.0, 900.0, 950.0, "RECOMPUTE"), 300),
        why({**read, "consistency": "DEGRADED"}, 300),
    ]
    assert reasons == [
        "300 new tokens, estimated faster on P: P reads the history",
        "the registry found no retained KV worth using: P computes it all",
        "a DEGRADED hint (the registry away or behind): REUSE READ",
    ]
    assert all(len(reason) <= 64 for reason in reasons)


def test_the_session_is_written_for_every_path() -> None:
    """The pasted log is over the decode node's local limit (so the planner weighs only READ
    and RECOMPUTE), the other tool result under it, and the last step is a fork."""
    pasted = [step.pasted_tokens for step in STEPS if step.pasted_tokens]
    assert max(pasted) > LOCAL_LIMIT > min(pasted)
    assert [step.fork for step in STEPS] == [False] * (len(STEPS) - 1) + [True]


def test_the_caption_says_what_each_path_is() -> None:
    lines = _rendered(80)
    for path in ("READ", "DECODE_LOCAL", "RECOMPUTE", "fork: READ"):
        assert any(line.strip().startswith(path) for line in lines), path
    text = "\n".join(lines)
    assert "from turn 2 the prefill node reads" not in text
    assert "nothing moves" in text
