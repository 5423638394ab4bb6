"""The child-process supervisor on small Python children: readiness, early exits, children
that will never be ready, stopping a whole process group, restarts; and the stack's start
failing fast (its engines replaced by such children)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvbroker.common.process.supervisor import (
    Announces,
    Answers,
    ChildProcess,
    ChildStartError,
    StartFailure,
)
from kvbroker_tools.stack import EngineSpec, Stack, StackConfig

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


async def never() -> bool:
    return False


# A vLLM server whose NIXL listener thread died on a taken port: it says so, then serves
# nothing and never exits.
TAKEN_PORT_AND_HANGS = """
import sys, time
print("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5600')",
      file=sys.stderr, flush=True)
time.sleep(120)
"""
THREAD_DIES_AND_HANGS = """
import threading, time
def listen():
    raise OSError("listener broke")
threading.Thread(target=listen, name="handshake").start()
time.sleep(120)
"""


@pytest.mark.parametrize(
    ("script", "failure", "cause"),
    [
        (TAKEN_PORT_AND_HANGS, StartFailure.PORT_IN_USE, "Address already in use"),
        (THREAD_DIES_AND_HANGS, StartFailure.FATAL, "Exception in thread handshake"),
        (
            "import sys; print('[Errno 98] address already in use', file=sys.stderr); sys.exit(1)",
            StartFailure.PORT_IN_USE,
            "exited with 1",
        ),
    ],
    ids=["taken port, hangs", "dead thread, hangs", "taken port, exits"],
)
async def test_a_child_that_will_never_be_ready_fails_the_start_at_once(
    tmp_path: Path, script: str, failure: StartFailure, cause: str
) -> None:
    child = ChildProcess(
        "engine",
        [sys.executable, "-c", script],
        tmp_path / "engine.log",
        ready=[Answers(never, "the engine healthy", within_s=60)],
    )
    started = time.monotonic()
    try:
        with pytest.raises(ChildStartError) as error:
            await child.start()
        assert time.monotonic() - started < 10  # not the probe's 60 s
        assert error.value.failure is failure and error.value.name == "engine"
        assert cause in str(error.value)
    finally:
        await child.stop()


async def test_a_marker_from_an_earlier_start_does_not_fail_a_restart(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("")
    child = ChildProcess("server", [sys.executable, "-c", SERVER], log, ready=[Announces()])
    await child.start()
    await child.stop()
    with log.open("a") as earlier:
        earlier.write("OSError: [Errno 98] Address already in use\n")
    await child.start()  # the old line is not this start's
    await child.stop()


class FakeEngineStack(Stack):
    """The stack with each vLLM server replaced by a script that finds its NIXL port taken
    and hangs; every child it starts is kept, to be checked after the start failed."""

    def __init__(self, config: StackConfig) -> None:
        self.started: list[ChildProcess] = []
        self.messages: list[str] = []
        super().__init__(config, progress=self.messages.append)

    def engine_argv(self, engine: EngineSpec) -> list[str]:
        return [sys.executable, "-c", TAKEN_PORT_AND_HANGS]

    def _child(self, child: ChildProcess) -> ChildProcess:
        self.started.append(child)
        return super()._child(child)


async def test_a_stack_start_on_a_taken_port_tries_fresh_ports_once_then_stops_everything(
    tmp_path: Path,
) -> None:
    stack = FakeEngineStack(StackConfig(workdir=tmp_path, model_dir=tmp_path))
    first_ports = (stack.registry_address, stack.prefill, stack.router_url)
    started = time.monotonic()
    with pytest.raises(ChildStartError) as error:
        await stack.start()
    assert time.monotonic() - started < 60  # not the engines' 600 s
    assert error.value.failure is StartFailure.PORT_IN_USE
    assert "Address already in use" in str(error.value)
    # Once again on fresh ports, then given up.
    assert sum("fresh ports" in message for message in stack.messages) == 1
    assert (stack.registry_address, stack.prefill, stack.router_url) != first_ports
    names = [child.name for child in stack.started]
    assert names.count("registry") == 2 and names.count("vllm-prefill") == 2
    assert "router" in names and "sidecar-decode" in names
    assert all(not child.running for child in stack.started)
    assert all(not group_alive(child.pid) for child in stack.started)
    assert stack.children == []


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize(("block_size", "passed"), [(32, "32"), (128, "128"), (None, None)])
def test_both_engines_get_the_stacks_block_size(
    tmp_path: Path, block_size: int | None, passed: str | None
) -> None:
    """P and D must agree on it; 32 by default, so that a reused turn recomputes at most 31
    retained tokens that fill no whole block instead of vLLM's CPU default's 127; None
    leaves vLLM's default."""
    assert StackConfig(workdir=tmp_path).block_size == 32
    stack = Stack(StackConfig(workdir=tmp_path, model_dir=tmp_path, block_size=block_size))
    for engine in (stack.prefill, stack.decode):
        assert _flag(stack.engine_argv(engine), "--block-size") == passed, engine.role


@pytest.mark.parametrize("on", [True, False])
def test_kv_events_give_each_engine_its_own_publisher_socket(tmp_path: Path, on: bool) -> None:
    """With kv_events each engine publishes on an ipc socket of its own in the workdir (a
    bound endpoint: vLLM binds ipc and wildcard ones, connects to others); without, no flag."""
    stack = Stack(StackConfig(workdir=tmp_path, model_dir=tmp_path, kv_events=on))
    endpoints = set()
    for engine in (stack.prefill, stack.decode):
        given = _flag(stack.engine_argv(engine), "--kv-events-config")
        if not on:
            assert given is None
            continue
        assert given is not None
        config = json.loads(given)
        assert config == {"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": stack.kv_events_endpoint(engine)}  # fmt: skip
        assert config["endpoint"].startswith(f"ipc://{tmp_path}/")
        endpoints.add(config["endpoint"])
    assert len(endpoints) == (2 if on else 0)
    assert (stack.describe()["kv_events"] is None) is not on
