"""Claude Code itself, headless (``claude -p``, then ``--continue``), through the router on real
vLLM CPU engines: two turns of one session, the second reused.

Claude Code is installed from npm (pinned, ``CLAUDE_CODE``) into kvbroker's cache unless
``KVBROKER_CLAUDE_CODE`` names a ``claude`` to run. It runs with its built-in tools off
(``--tools ""``): its prompt is then its system prompt and the turn, which fits the engines'
16,384-token window (with its 12-21 tool schemas it would not, whatever the model).

The generated model has random weights and never ends an answer, so every answer stops at
Claude Code's output-token bound, which Claude Code reports as an error and retries: the test
accepts that one failure, since it is the model's, and checks what kvbroker did with every
request Claude Code sent (the router's log): they name Claude Code's session, the first is a
MISS and every later one, the ``--continue`` turn's first among them, is REUSE.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbroker_tools.harness.turns import retained_after
from kvbroker_tools.stack import SERVED_MODEL, Stack
from kvbroker_tools.testmodel import default_cache_dir
from tests.e2e_stack import e2e_marks, stack_fixture

pytestmark = e2e_marks()

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
# What Claude Code says when an answer stops at its output-token bound (the random model's
# every answer does).
OUTPUT_BOUND = "output token maximum"


def claude_code() -> Path:
    """The ``claude`` to run: ``KVBROKER_CLAUDE_CODE``, else the pinned one, installed from
    npm into kvbroker's cache the first time."""
    given = os.environ.get("KVBROKER_CLAUDE_CODE")
    if given:
        return Path(given)
    prefix = default_cache_dir().parent / "claude-code" / CLAUDE_CODE.rpartition("@")[2]
    binary = prefix / "node_modules" / ".bin" / "claude"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: Claude Code cannot be installed")
        subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", CLAUDE_CODE],
            check=True,
            capture_output=True,
            timeout=600,
        )
    return binary


stack = stack_fixture(max_model_len=16384)


@dataclass(frozen=True)
class Run:
    """One ``claude -p`` and what the router did with its requests."""

    returncode: int
    output: str
    routed: list[dict[str, Any]]


class ClaudeCode:
    """``claude -p`` against the router, in a home and project of its own (so that
    ``--continue`` finds the session before it)."""

    def __init__(self, binary: Path, stack: Stack, root: Path) -> None:
        self.binary, self.stack = binary, stack
        self.home, self.project = root / "home", root / "project"
        self.home.mkdir()
        self.project.mkdir()
        self.seen = 0  # routed log lines already read

    async def run(self, prompt: str, *flags: str) -> Run:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(self.home),
            "ANTHROPIC_BASE_URL": self.stack.router_url,
            "ANTHROPIC_API_KEY": "sk-unused",
            "ANTHROPIC_MODEL": SERVED_MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": SERVED_MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16",
        }
        done = await asyncio.to_thread(
            subprocess.run,
            [str(self.binary), "-p", prompt, "--tools", "", *flags],
            check=False,
            env=env,
            cwd=self.project,
            capture_output=True,
            text=True,
            timeout=600,
        )
        routed = self._routed()
        return Run(done.returncode, done.stdout + done.stderr, routed)

    def _routed(self) -> list[dict[str, Any]]:
        """The router's ``routed`` log events since the last call."""
        lines = (self.stack.config.workdir / "router.log").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        routed = [e for e in events if e.get("event") == "routed"]
        new, self.seen = routed[self.seen :], len(routed)
        return new


def served(run: Run) -> None:
    """Claude Code got its answers: it succeeded, or its one complaint is that the random
    model's answer reached the output-token bound."""
    assert run.returncode == 0 or OUTPUT_BOUND in run.output, run.output
    assert run.routed, run.output
    assert all(event["api"] == "messages" for event in run.routed), run.routed


async def test_claude_code_runs_two_turns_and_the_second_is_reused(
    stack: Stack, tmp_path: Path
) -> None:
    claude = ClaudeCode(claude_code(), stack, tmp_path)
    first = await claude.run("Say hi.")
    served(first)
    session = first.routed[0]["conversation"]
    assert session, "Claude Code's requests name no session"
    assert first.routed[0]["decision"] == "MISS"
    # D's retention report of the first turn's last request has reached the registry.
    await retained_after(stack.registry_address, session, 0)

    second = await claude.run("And again?", "--continue")
    served(second)
    assert {event["conversation"] for event in first.routed + second.routed} == {session}
    decisions = [event["decision"] for event in second.routed]
    assert decisions == ["REUSE"] * len(decisions), second.routed
    print(  # what the run saw, for the record (pytest -s)
        f"claude code: session {session}; first turn "
        f"{[(e['decision'], e['path']) for e in first.routed]}, second "
        f"{[(e['decision'], e['path']) for e in second.routed]}"
    )
