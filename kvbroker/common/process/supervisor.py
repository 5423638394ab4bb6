"""Child processes of the one-machine stack, the benchmarks and the tests: the one place that
starts a process, waits until it is ready, stops it and keeps its output.

Each child runs in a process group of its own, so that signals reach what it starts in turn
(vLLM's API server runs its engine core as a child) and so that a Ctrl-C meant for the parent
does not reach it first. When a child is ready is a probe's answer: its announcement line (every
kvbroker server prints one JSON line with its addresses once it serves) or a polled check (an
HTTP health route, a gRPC call). A child that exits while a probe waits fails the start at once,
with the end of its log; so does one whose log shows it never will be ready though it runs on
(FATAL_MARKERS: a vLLM server whose NIXL listener thread died on a taken port served nothing
and never exited, and the stack waited out its 600 s). The failure says why (StartFailure),
so that a caller can start again on fresh ports after a clash, and names the process that
holds the port (ports.who_holds). A child can be started again after it stopped or was
killed, on the same command line (and so the same ports); its log then grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvbroker.common.process.ports import ports_named, who_holds
from kvbroker.common.process.tasks import poll_until

# Bytes of stdout a child may print on one line before its announcement is cut.
_LINE_LIMIT = 1 << 20
# How often a starting child's log is read for FATAL_MARKERS.
_LOG_POLL_S = 0.2


class StartFailure(StrEnum):
    """Why a child did not become ready."""

    EXITED = "exited"
    # Its log names a port another process holds: worth a start on fresh ports.
    PORT_IN_USE = "port in use"
    # Its log shows an error it will not recover from, though it may still run.
    FATAL = "fatal error"


# Text in a starting child's log after which it will never be ready, and what it means:
# a port taken before the child bound it (vLLM's NIXL side channel raises ZMQError in a
# listener thread, and the server runs on without it), a thread that died (Python prints
# "Exception in thread NAME:" then its traceback), vLLM's engine core gone.
FATAL_MARKERS: dict[str, StartFailure] = {
    "Address already in use": StartFailure.PORT_IN_USE,
    "Exception in thread": StartFailure.FATAL,
    "EngineDeadError": StartFailure.FATAL,
}


class ChildStartError(RuntimeError):
    """A child that did not become ready, with why (``failure``), who holds the port it found
    taken (``holders``, for PORT_IN_USE; empty if none is known) and the end of its log."""

    def __init__(
        self, name: str, failure: StartFailure, detail: str, log_tail: str, holders: str = ""
    ) -> None:
        why = f"{failure}; {holders}" if holders else str(failure)
        super().__init__(f"{name} {detail} before it was ready ({why}):\n{log_tail}")
        self.name = name
        self.failure = failure
        self.holders = holders


class Probe(Protocol):
    """Says when a started child is ready to be used."""

    async def wait(self, child: ChildProcess) -> None: ...


@dataclass(frozen=True)
class Announces:
    """Ready once the child printed its announcement: one JSON line on stdout."""

    within_s: float = 60.0

    async def wait(self, child: ChildProcess) -> None:
        line = await asyncio.wait_for(child.first_line(), self.within_s)
        if not line:
            # Its stdout ended: it is exiting, and the start fails saying why (_until).
            await asyncio.wait_for(child.wait(), self.within_s)
            raise RuntimeError(f"{child.name} closed its stdout before it announced itself")
        child.announced = json.loads(line)


@dataclass(frozen=True)
class Answers:
    """Ready once ``check`` returns something truthy (its errors mean "not yet")."""

    check: Callable[[], Awaitable[object]]
    what: str
    within_s: float = 60.0
    every_s: float = 0.1

    async def wait(self, child: ChildProcess) -> None:
        await poll_until(self.check, self.within_s, self.what, self.every_s)


def http_ok(url: str, within_s: float = 600.0, every_s: float = 0.5) -> Answers:
    """Ready once ``url`` answers 200 (a server's health route)."""

    async def check() -> bool:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(url)).status_code == 200

    return Answers(check, f"{url} answering 200", within_s, every_s)


class ChildProcess:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path | None,
        ready: Sequence[Probe] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``log`` takes stdout and stderr (None: both are dropped); ``ready`` are the probes
        ``start`` waits for, in order; ``env`` is added to this process's environment."""
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.ready = tuple(ready)
        self.env = dict(env or {})
        # What the child printed in its announcement (see Announces).
        self.announced: dict[str, Any] = {}
        self.process: asyncio.subprocess.Process | None = None
        self._first_line: asyncio.Future[bytes] | None = None
        self._output: asyncio.Task[None] | None = None
        self._starts = 0
        # Where this start's part of the log begins (a restart appends to it).
        self._log_start = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    async def start(self) -> None:
        """Starts the child and returns once every probe says it is ready."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running")
        stderr: Any = asyncio.subprocess.DEVNULL
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            stderr = self.log.open("ab" if self._starts else "wb")
            self._log_start = stderr.tell()
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env={**os.environ, **self.env} if self.env else None,
                start_new_session=True,
                limit=_LINE_LIMIT,
            )
        finally:
            if stderr is not asyncio.subprocess.DEVNULL:
                stderr.close()
        self._starts += 1
        self.announced = {}
        self._first_line = asyncio.get_running_loop().create_future()
        assert self.process.stdout is not None
        self._output = asyncio.create_task(self._keep_output(self.process.stdout, self._first_line))
        for probe in self.ready:
            await self._until(probe)

    async def first_line(self) -> bytes:
        """The first line the child printed on stdout (empty if it printed none)."""
        assert self._first_line is not None, f"{self.name} was never started"
        return await asyncio.shield(self._first_line)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to the child's process group (SIGKILL unless said otherwise)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    async def wait(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return await self.process.wait()

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if the child has not exited after ``grace_s``; returns once
        nothing of its process group is left (what it started may outlive it a moment)."""
        if self.process is None:
            return
        if self.process.returncode is None:
            self.kill(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), grace_s)
        except TimeoutError:
            self.kill(signal.SIGKILL)
            await self.process.wait()
        await self._reap_group(grace_s)
        if self._output is not None:
            # Its output ends with the last process that held it; nothing is left to hold it.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._output, grace_s)

    def log_tail(self, chars: int = 3000) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        return self.log.read_text(errors="replace")[-chars:]

    async def _until(self, probe: Probe) -> None:
        """Waits for ``probe``; raises ChildStartError as soon as the child exits or its log
        shows a fatal error."""
        assert self.process is not None
        ready = asyncio.ensure_future(probe.wait(self))
        exited = asyncio.ensure_future(self.process.wait())
        fatal = asyncio.ensure_future(self._fatal_in_log())
        try:
            await asyncio.wait({ready, exited, fatal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (ready, exited, fatal):
                task.cancel()
            await asyncio.gather(ready, exited, fatal, return_exceptions=True)
        if ready.done() and not ready.cancelled() and ready.exception() is None:
            return
        if fatal.done() and not fatal.cancelled():
            failure, line = fatal.result()
            raise await self._start_error(failure, f"logged {line!r}", line)
        if self.process.returncode is not None:
            # Its log may still say why it exited (a taken port, then a clean exit).
            found = _fatal_line(self._log_since_start())
            failure, line = found or (StartFailure.EXITED, "")
            detail = f"exited with {self.process.returncode}"
            raise await self._start_error(failure, detail, line)
        ready.result()  # the probe's own error (not ready in time)

    async def _start_error(self, failure: StartFailure, detail: str, line: str) -> ChildStartError:
        holders = ""
        if failure is StartFailure.PORT_IN_USE:
            holders = await asyncio.to_thread(self._port_holders, line)
        return ChildStartError(self.name, failure, detail, self.log_tail(), holders)

    def _port_holders(self, line: str) -> str:
        """Who holds the port ``line`` (the log's "address in use") names; where it names none
        (Python's own bind error does not), who holds any port the child was given."""
        named = ports_named(line)
        if named:
            return who_holds(named) or f"nothing holds port {', '.join(map(str, named))} now"
        given = [*self.argv, *self.env.values()]
        numbers = [int(word) for word in given if word.isdigit() and 1024 <= int(word) < 65_536]
        return who_holds([*numbers, *ports_named(" ".join(given))])

    def _log_since_start(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        with self.log.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    async def _fatal_in_log(self) -> tuple[StartFailure, str]:
        """Returns once this start's log shows a fatal marker: what it means, and its line.
        Waits forever for a child without a log."""
        if self.log is None:
            await asyncio.Event().wait()
        while True:
            await asyncio.sleep(_LOG_POLL_S)
            # Read whole each time: a start's log is small, and a marker may span two reads.
            if found := _fatal_line(self._log_since_start()):
                return found

    async def _keep_output(
        self, stdout: asyncio.StreamReader, first_line: asyncio.Future[bytes]
    ) -> None:
        """Copies the child's stdout into its log, keeping the first line for the probes."""
        line = b""
        try:
            line = await stdout.readline()
        finally:
            if not first_line.done():
                first_line.set_result(line)
        sink = self.log.open("ab") if self.log is not None else None
        try:
            chunk = line
            while chunk:
                if sink is not None:
                    sink.write(chunk)
                    sink.flush()
                chunk = await stdout.read(1 << 16)
        finally:
            if sink is not None:
                sink.close()

    async def _reap_group(self, grace_s: float) -> None:
        """Waits until every process of the child's group is gone, killing what is left after
        the grace."""
        assert self.process is not None
        deadline = asyncio.get_running_loop().time() + grace_s
        while True:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            if asyncio.get_running_loop().time() > deadline:
                self.kill(signal.SIGKILL)
            await asyncio.sleep(0.1)


def _fatal_line(text: str) -> tuple[StartFailure, str] | None:
    """What the fatal markers in a log mean, and the line that says it. A taken port comes
    first: it is what a start on fresh ports cures, and a thread dies of it too."""
    found = [
        (failure, line.strip())
        for line in text.splitlines()
        for marker, failure in FATAL_MARKERS.items()
        if marker.lower() in line.lower()  # uvicorn says "address already in use"
    ]
    found.sort(key=lambda hit: hit[0] is not StartFailure.PORT_IN_USE)
    return found[0] if found else None


async def start_together(children: Sequence[ChildProcess]) -> None:
    """Starts children at once and returns when every one is ready. When one fails, the
    others' waits end too and its error is raised; stopping them is the caller's (what it
    started, it stops)."""
    starts = [asyncio.ensure_future(child.start()) for child in children]
    try:
        await asyncio.gather(*starts)
    finally:
        for start in starts:
            start.cancel()
        await asyncio.gather(*starts, return_exceptions=True)


async def stop_all(children: Sequence[ChildProcess], grace_s: float = 10.0) -> None:
    """Stops children together, the last started first."""
    await asyncio.gather(*(child.stop(grace_s) for child in reversed(children)))
