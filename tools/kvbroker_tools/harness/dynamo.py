"""NVIDIA Dynamo's frontend and mocker workers as child processes, for the tests of the
placement hop in front of Dynamo.

They run from the venv ``make dynamo`` builds (``.venv-dynamo``; ``$KVBROKER_DYNAMO_PYTHON``
names another Python): Dynamo's own requirements cannot all be installed here and clash with
vLLM's (``scripts/dynamo-requirements.txt``). The processes find each other through Dynamo's
file discovery backend in a folder of the caller's, over its TCP request plane and ZMQ event
plane: no etcd, no NATS. A mocker is Dynamo's simulated engine: a worker the frontend routes to
as to a vLLM one, answering with random tokens of the model's tokenizer, without weights.

Workers start one at a time, so that the instance the frontend newly lists is the one just
started (``DynamoWorker.instance_id``, the id Dynamo's pin headers name). A fleet is ready once
the frontend has served a request pinned to each of its workers: a disaggregated frontend
serves nothing before it has both a prefill and a decode worker, so that is waited for after
they all started.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx

from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Answers, ChildProcess, http_ok, stop_all
from kvbroker.common.process.tasks import poll_until
from kvbroker_tools.stack import SERVED_MODEL

DYNAMO_PYTHON_ENV = "KVBROKER_DYNAMO_PYTHON"
# The checkout (tools/kvbroker_tools/harness/ -> the root), where `make dynamo` puts .venv-dynamo.
_ROOT = Path(__file__).resolve().parents[3]
# Discovery in files, requests over TCP, events over ZMQ: nothing else to run.
_PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]


def dynamo_python() -> Path | None:
    """The Python that runs Dynamo, None when it is not there (run `make dynamo`)."""
    named = os.environ.get(DYNAMO_PYTHON_ENV)
    python = Path(named) if named else _ROOT / ".venv-dynamo" / "bin" / "python"
    return python if python.exists() else None


class Role(StrEnum):
    """A mocker's ``--disaggregation-mode``."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def component(self) -> str:
        """The Dynamo component its instances register under."""
        return "prefill" if self is Role.PREFILL else "backend"

    def pin(self, instance_id: int) -> dict[str, int]:
        """The ``nvext`` fields that route a request to this worker: prefill workers by
        their own field; the others by the decode field, which (unlike the
        ``x-worker-instance-id`` header) a disaggregated frontend honours without a
        prefill pin."""
        field = "prefill_worker_id" if self is Role.PREFILL else "decode_worker_id"
        return {field: instance_id}


def chat_body(content: str, **nvext: Any) -> dict[str, Any]:
    """A short chat request that asks the frontend which workers served it."""
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "nvext": {"extra_fields": ["worker_id"], **nvext},
    }


def served_by(answer: Mapping[str, Any]) -> tuple[int, int]:
    """The (prefill, decode) worker instance ids that served an answer of ``chat_body``'s
    (the same worker twice for an aggregated one)."""
    workers = answer["nvext"]["worker_id"]
    return int(workers["prefill_worker_id"]), int(workers["decode_worker_id"])


class DynamoFrontend(ChildProcess):
    """``python -m dynamo.frontend`` with the KV router, ready once its HTTP server answers."""

    def __init__(self, python: Path, workdir: Path, *flags: str) -> None:
        self.port = free_port()
        self.discovery = workdir / "dynamo-discovery"
        argv = [
            str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
            "--http-port", str(self.port), "--router-mode", "kv", *_PLANES, *flags,
        ]  # fmt: skip
        ready = http_ok(f"{self.url}/health", within_s=60, every_s=0.1)
        env = {"DYN_FILE_KV": str(self.discovery)}
        super().__init__("dynamo-frontend", argv, workdir / "dynamo-frontend.log", [ready], env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def instances(self, component: str) -> set[int]:
        """The worker instances the frontend lists (its ``/health``) of ``component``."""
        async with httpx.AsyncClient(timeout=2) as http:
            health = (await http.get(f"{self.url}/health")).json()
        return {
            int(i["instance_id"])
            for i in health.get("instances", [])
            if i["component"] == component and i["endpoint"] == "generate"
        }


class DynamoWorker(ChildProcess):
    """``python -m dynamo.mocker`` in ``role``, ready once ``frontend`` lists it;
    ``instance_id`` is then its id."""

    def __init__(
        self, python: Path, frontend: DynamoFrontend, model_dir: Path, role: Role, name: str
    ) -> None:
        self.frontend, self.role = frontend, role
        self.instance_id = 0
        self._known: set[int] = set()
        argv = [
            str(python), "-m", "dynamo.mocker", "--model-path", str(model_dir),
            "--model-name", SERVED_MODEL, "--disaggregation-mode", role.value, *_PLANES,
        ]  # fmt: skip
        ready = Answers(self._listed, f"{name} listed by the frontend", 60, 0.1)
        env = {"DYN_FILE_KV": str(frontend.discovery)}
        log = frontend.log.with_name(f"{name}.log") if frontend.log else None
        super().__init__(name, argv, log, [ready], env)

    async def start(self) -> None:
        self._known = await self.frontend.instances(self.role.component)
        await super().start()

    async def _listed(self) -> bool:
        new = await self.frontend.instances(self.role.component) - self._known
        if len(new) == 1:
            self.instance_id = new.pop()
        return bool(self.instance_id)

    async def serves(self) -> bool:
        """Whether the frontend served a request pinned to this worker."""
        body = chat_body("ready?", **self.role.pin(self.instance_id))
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{self.frontend.url}/v1/chat/completions", json=body)
        if answer.status_code != 200:
            return False
        prefill, decode = served_by(answer.json())
        return self.instance_id == (prefill if self.role is Role.PREFILL else decode)


class DynamoFleet:
    """A frontend and its workers, stopped together (the workers first)."""

    def __init__(self, python: Path, workdir: Path, model_dir: Path) -> None:
        self.python, self.workdir, self.model_dir = python, workdir, model_dir
        self.frontend = DynamoFrontend(python, workdir)
        self.workers: list[DynamoWorker] = []

    async def start(self, *roles: Role) -> None:
        """The frontend, then a worker of each role in turn; returns once each serves."""
        await self.frontend.start()
        for role in roles:
            worker = DynamoWorker(
                self.python, self.frontend, self.model_dir, role, f"mocker-{len(self.workers)}"
            )
            self.workers.append(worker)
            await worker.start()
        for worker in self.workers:
            await poll_until(worker.serves, 60, f"{worker.name} serving a request pinned to it")

    def of(self, role: Role) -> list[DynamoWorker]:
        return [w for w in self.workers if w.role is role]

    async def stop(self) -> None:
        await stop_all([self.frontend, *self.workers])
