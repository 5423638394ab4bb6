"""One registry session's lifetime, apart from the loop that runs it (``agent.Agent``): the
retention relay reports in the same session and ends it when a report fails, so both need it
and neither should import the other for it."""

from __future__ import annotations

import asyncio

from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

# How long a call to the registry may take; a replay, which carries all the engine retains,
# four times as long.
RPC_TIMEOUT_S = 5.0


class SessionLostError(Exception):
    """The registry no longer knows this node's session; register again and replay."""


class Session:
    """One registry session of one incarnation, and why it must end when something outside
    its own loops (a failed report, the engine re-attaching) decides so."""

    def __init__(self, stub: RegistryServiceStub, incarnation: str) -> None:
        self.stub = stub
        self.incarnation = incarnation
        self.replayed = False
        self._ended = asyncio.Event()
        self._error: Exception | None = None

    @property
    def live(self) -> bool:
        """Its replay was acknowledged and nothing has ended it since."""
        return self.replayed and not self._ended.is_set()

    def end(self, error: Exception) -> None:
        if not self._ended.is_set():
            self._error = error
            self._ended.set()

    async def until_ended(self) -> None:
        await self._ended.wait()
        assert self._error is not None
        raise self._error
