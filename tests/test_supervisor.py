"""The child-process supervisor on small Python children: readiness, early exits, stopping a
whole process group, restarts."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvbroker.common.supervisor import Announces, Answers, ChildProcess

# Starts a grandchild in its own process group, logs to stderr, announces itself, then waits.
SERVER = """
import json, signal, subprocess, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("serving", file=sys.stderr, flush=True)
print(json.dumps({"grandchild": grandchild.pid}), flush=True)
time.sleep(60)
"""


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


async def test_stop_ends_the_whole_group_and_a_restart_appends_to_the_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    child = ChildProcess("server", [sys.executable, "-c", SERVER], log, ready=[Announces()])
    await child.start()
    grandchild = child.announced["grandchild"]
    assert os.getpgid(grandchild) == child.pid  # its own group, led by the child
    await child.stop()
    assert not group_alive(child.pid)
    assert child.process is not None and child.process.returncode == -signal.SIGTERM

    await child.start()
    assert child.announced["grandchild"] != grandchild
    child.kill()
    assert await child.wait() == -signal.SIGKILL
    await child.stop()  # what the kill left of the group
    assert not group_alive(child.pid)
    text = log.read_text()
    assert text.count("serving") == 2 and text.count('"grandchild"') == 2


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    child = ChildProcess(
        "stubborn", [sys.executable, "-c", SERVER, "--ignore-term"], None, ready=[Announces()]
    )
    await child.start()
    started = time.monotonic()
    await child.stop(grace_s=0.5)
    assert time.monotonic() - started < 5
    assert child.process is not None and child.process.returncode == -signal.SIGKILL
    assert not group_alive(child.pid)


async def test_a_child_that_exits_before_it_is_ready_fails_the_start_with_its_log(
    tmp_path: Path,
) -> None:
    script = "import sys; print('no model here', file=sys.stderr); sys.exit(3)"

    async def never() -> bool:
        return False

    child = ChildProcess(
        "broken",
        [sys.executable, "-c", script],
        tmp_path / "broken.log",
        ready=[Answers(never, "never", within_s=60)],
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="broken exited with 3") as error:
        await child.start()
    assert "no model here" in str(error.value)
    assert time.monotonic() - started < 10  # not the probe's 60 s


async def test_a_probe_that_is_never_satisfied_times_out() -> None:
    child = ChildProcess(
        "silent",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        None,
        ready=[Announces(within_s=0.5)],
    )
    try:
        with pytest.raises(TimeoutError):
            await child.start()
        assert child.running
    finally:
        await child.stop()
    assert not child.running
