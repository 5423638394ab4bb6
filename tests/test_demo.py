"""`kvbroker demo`'s result as a new user's 80-column terminal shows it, from recorded turns
(measured_turn's measurements, as a run of the demo on vLLM CPU engines gave them): each
turn's path and what it read from D on one line, nothing cut, and a caption that says what
each path is rather than promising one."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from kvbroker.demo import show_turns


def _turn(tokens: int, path: str, read_bytes: float, prefill_ms: float, ttft_ms: float) -> Any:
    return {
        "input_num_tokens": tokens,
        "output_num_tokens": 24,
        "ttft_ms": ttft_ms,
        "e2e_ms": ttft_ms + 900.0,
        "prefill_leg_ms": prefill_ms,
        "kv_read_ms": 41.0 if read_bytes else 0.0,
        "kv_read_bytes": read_bytes,
        "kv_reads": 1 if read_bytes else 0,
        "decision": "MISS" if path == "RECOMPUTE" else "REUSE",
        "path": path,
    }


# A run of the demo (vLLM CPU engines, this machine): turn 1 recomputed, the rest stayed on D.
ON = [
    _turn(881, "RECOMPUTE", 0.0, 1063.2, 1427.8),
    _turn(1862, "DECODE_LOCAL", 0.0, 0.0, 706.9),
    _turn(2817, "DECODE_LOCAL", 0.0, 0.0, 1027.4),
    _turn(3785, "DECODE_LOCAL", 0.0, 0.0, 622.6),
    _turn(3859, "DECODE_LOCAL", 0.0, 0.0, 233.1),
]
OFF = [
    _turn(881, "RECOMPUTE", 0.0, 430.1, 505.7),
    _turn(1862, "RECOMPUTE", 0.0, 997.6, 1064.8),
    _turn(2817, "RECOMPUTE", 0.0, 2451.9, 2589.3),
    _turn(3785, "RECOMPUTE", 0.0, 5134.8, 5260.2),
    _turn(3859, "RECOMPUTE", 0.0, 3233.7, 3322.4),
]
# The same turns had turn 2 read its history from D (as a longer new suffix makes it).
READ_ON = [ON[0], _turn(1862, "READ", 1_769_472.0, 987.1, 1402.6), *ON[2:]]


def _rendered(width: int, on: list[Any] = ON) -> list[str]:
    out = io.StringIO()
    show_turns(Console(file=out, width=width, color_system=None), on, OFF)
    return out.getvalue().splitlines()


def _rows(lines: list[str]) -> list[list[str]]:
    """The table's turn rows, split into words."""
    return [
        line.split() for line in lines if line.split()[:1] in (["1"], ["2"], ["3"], ["4"], ["5"])
    ]


def test_each_turn_is_one_line_with_its_path_and_what_it_read() -> None:
    lines = _rendered(80)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert not any("…" in line for line in lines), "a cell was cut:\n" + "\n".join(lines)
    rows = _rows(lines)
    assert rows == [
        ["1", "881", "RECOMPUTE", "none", "1063", "430", "1428", "506"],
        ["2", "1862", "DECODE_LOCAL", "none", "0", "998", "707", "1065"],
        ["3", "2817", "DECODE_LOCAL", "none", "0", "2452", "1027", "2589"],
        ["4", "3785", "DECODE_LOCAL", "none", "0", "5135", "623", "5260"],
        ["5", "3859", "DECODE_LOCAL", "none", "0", "3234", "233", "3322"],
    ]


def test_a_read_shows_what_moved() -> None:
    lines = _rendered(80, READ_ON)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert _rows(lines)[1] == ["2", "1862", "READ", "1.8", "MB", "987", "998", "1403", "1065"]


def test_the_caption_says_what_each_path_is() -> None:
    lines = _rendered(80)
    for path in ("READ", "DECODE_LOCAL", "RECOMPUTE"):
        assert any(line.strip().startswith(path) for line in lines), path
    text = "\n".join(lines)
    assert "from turn 2 the prefill node reads" not in text
    assert "nothing moves" in text
