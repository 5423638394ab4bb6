"""The Kubernetes manifests under deploy/kubernetes as the tests read them: rendered by
``kubectl kustomize``, taken apart into the pods they describe and each container's command,
and run as local processes.

Running a rendered overlay here changes only what a cluster would provide: every pod's IP, a
Service's name and a pod's DNS name become 127.0.0.1, every container port a free loopback port
(per pod, so that two pods may both use 8000), the pod network's device (eth0) loopback, and
each volume a directory (a Secret's holding its keys; one per pod, unless the caller shares
it between pods). The command lines, their
flags and the environment are the manifests' own, with Kubernetes' ``$(VAR)`` expansion.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import Answers, ChildProcess, Probe, http_ok, stop_all

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
# The namespace the local cluster's pods are in (the manifests name none: kubectl's current).
NAMESPACE = "default"
MAKE_SECRETS = DEPLOY / "make-secrets.sh"

# The wrapper that reads a node's token from its Secret key into KVBROKER_TOKEN and then runs
# ``kvbroker "$@"``: the container's args are kvbroker's.
_EXEC_ARGS = 'exec kvbroker "$@"'
# ``exec kvbroker ...`` in a shell script (a preStop hook), up to the end of its command.
_EXEC_KVBROKER = re.compile(r"exec (kvbroker\b[^;&|\n]*)")
_EXPORTED = re.compile(r"\b(KVBROKER_[A-Z0-9_]+)=")
_SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_HOST_PORT = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9.-]*):(\d{2,5})\b")
_LOCAL_HOSTS = {"0.0.0.0", "127.0.0.1", "localhost"}


def kustomize(target: Path) -> str:
    """``kubectl kustomize target``; raises CalledProcessError with kubectl's message."""
    return subprocess.run(
        ["kubectl", "kustomize", str(target)], check=True, capture_output=True, text=True
    ).stdout


def render(target: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(kustomize(target)) if doc]


@dataclass(frozen=True)
class Container:
    workload: str
    name: str
    # "init" (runs to completion), "sidecar" (an init container that keeps running) or "main".
    stage: str
    spec: dict[str, Any]

    @property
    def argv(self) -> list[str]:
        """What the container runs: its command and then its args, as Kubernetes joins them."""
        return [*self.spec.get("command", []), *self.spec.get("args", [])]

    @property
    def env(self) -> list[dict[str, Any]]:
        return list(self.spec.get("env", []))

    @property
    def ports(self) -> dict[str, int]:
        """Container ports by name (unnamed ones by their number)."""
        return {
            str(p.get("name", p["containerPort"])): int(p["containerPort"])
            for p in self.spec.get("ports", [])
        }

    @property
    def pre_stop(self) -> list[str]:
        hook = self.spec.get("lifecycle", {}).get("preStop", {})
        return list(hook.get("exec", {}).get("command", []))

    def scripts(self) -> list[str]:
        """The shell scripts it runs (``sh -c`` in its command or its preStop hook)."""
        found = []
        for argv in (self.argv, self.pre_stop):
            if len(argv) >= 3 and argv[0] in ("/bin/sh", "sh") and argv[1] == "-c":
                found.append(argv[2])
        return found

    def kvbroker_invocations(self) -> list[tuple[str, list[str]]]:
        """Each ``kvbroker`` command line it runs (its command, its preStop hook), named by
        where it comes from, with shell variables left as ``$NAME`` words."""
        found: list[tuple[str, list[str]]] = []
        for where, argv in (("command", self.argv), ("preStop", self.pre_stop)):
            if argv[:1] == ["kvbroker"]:
                found.append((where, argv[1:]))
            elif len(argv) >= 3 and argv[0] in ("/bin/sh", "sh") and argv[1] == "-c":
                if _EXEC_ARGS in argv[2]:
                    found.append((where, argv[4:]))
                    continue
                for match in _EXEC_KVBROKER.finditer(argv[2]):
                    found.append((where, shlex.split(match.group(1))[1:]))
        return found

    def env_names(self) -> set[str]:
        """Every variable the container's environment gets: its env list and what its
        scripts export."""
        names = {str(entry["name"]) for entry in self.env}
        for script in self.scripts():
            names |= set(_EXPORTED.findall(script))
        return names

    def script_variables(self) -> set[str]:
        return {name for script in self.scripts() for name in _SHELL_VAR.findall(script)}


@dataclass(frozen=True)
class Workload:
    kind: str
    name: str
    replicas: int
    spec: dict[str, Any]  # the pod template's spec
    labels: dict[str, str]
    claims: tuple[str, ...] = ()  # a StatefulSet's volumeClaimTemplates

    def containers(self) -> list[Container]:
        """In the order a kubelet starts them."""
        out = []
        for spec in self.spec.get("initContainers", []):
            stage = "sidecar" if spec.get("restartPolicy") == "Always" else "init"
            out.append(Container(self.name, spec["name"], stage, spec))
        for spec in self.spec.get("containers", []):
            out.append(Container(self.name, spec["name"], "main", spec))
        return out

    def pod_names(self) -> list[str]:
        return [f"{self.name}-{index}" for index in range(self.replicas)]


def workloads(manifests: list[dict[str, Any]]) -> list[Workload]:
    found = []
    for doc in manifests:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            template = doc["spec"]["template"]
            claims = tuple(
                c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])
            )
            found.append(
                Workload(
                    doc["kind"],
                    doc["metadata"]["name"],
                    int(doc["spec"].get("replicas", 1)),
                    template["spec"],
                    dict(template["metadata"].get("labels", {})),
                    claims,
                )
            )
    return found


def containers(manifests: list[dict[str, Any]]) -> Iterator[Container]:
    for workload in workloads(manifests):
        yield from workload.containers()


def make_secrets(prefill: int, decode: int) -> list[dict[str, Any]]:
    """The Secrets deploy/kubernetes/make-secrets.sh prints, with fresh tokens."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        ["sh", str(MAKE_SECRETS), str(prefill), str(decode)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


@dataclass
class _Pod:
    name: str
    workload: Workload
    # Container port -> the loopback port it gets here.
    ports: dict[int, int]
    volumes: dict[str, Path] = field(default_factory=dict)


class LocalCluster:
    """The rendered manifests' pods as local processes (see the module's docstring)."""

    def __init__(
        self,
        manifests: list[dict[str, Any]],
        secrets: list[dict[str, Any]],
        workdir: Path,
        shared_volumes: frozenset[str] = frozenset(),
    ) -> None:
        """``shared_volumes`` name volumes that get one directory for every pod (a path that
        must read the same in every pod, as a cluster's mount paths do: vLLM's NIXL handshake
        compares the engines' model paths); every other volume is one directory per pod."""
        self.workdir = workdir
        self.shared_volumes = shared_volumes
        self.children: list[ChildProcess] = []
        self._secrets = {s["metadata"]["name"]: secret_data(s) for s in secrets}
        self._services = {
            doc["metadata"]["name"]: doc["spec"] for doc in manifests if doc["kind"] == "Service"
        }
        self.pods: dict[str, _Pod] = {}
        for workload in workloads(manifests):
            declared = {
                port for container in workload.containers() for port in container.ports.values()
            }
            for name in workload.pod_names():
                self.pods[name] = _Pod(name, workload, {p: free_port() for p in declared})

    # Where a cluster address points here.

    def _service_pod(self, service: str) -> _Pod:
        selector = self._services[service].get("selector", {})
        for pod in self.pods.values():
            if all(pod.workload.labels.get(k) == v for k, v in selector.items()):
                return pod
        raise KeyError(f"service {service} selects no pod")

    def _service_target(self, service: str, port: int) -> int:
        """The container port a Service's port leads to."""
        pod = self._service_pod(service)
        for entry in self._services[service].get("ports", []):
            if int(entry["port"]) == port:
                target = entry.get("targetPort", port)
                if isinstance(target, int):
                    return target
                for container in pod.workload.containers():
                    if target in container.ports:
                        return container.ports[target]
        return port

    def address(self, host: str, port: int, pod: _Pod) -> tuple[str, int]:
        """Where ``host:port``, as a container of ``pod`` names it, is reached here."""
        if host in _LOCAL_HOSTS:
            return "127.0.0.1", pod.ports.get(port, port)
        if host in self._services:
            target = self._service_pod(host)
            return "127.0.0.1", target.ports[self._service_target(host, port)]
        name, _, service = host.partition(".")
        if name in self.pods and service.split(".")[0] in self._services:
            return "127.0.0.1", self.pods[name].ports[port]
        raise KeyError(f"{pod.name}: cannot resolve {host}:{port}")

    def url(self, service: str, port: int) -> str:
        host, local = self.address(service, port, next(iter(self.pods.values())))
        return f"http://{host}:{local}"

    def pod_port(self, pod: str, port: int) -> int:
        return self.pods[pod].ports[port]

    # Turning a container's values into local ones.

    def _volume_dir(self, pod: _Pod, volume: str) -> Path:
        if volume in pod.volumes:
            return pod.volumes[volume]
        owner = "shared" if volume in self.shared_volumes else pod.name
        directory = self.workdir / owner / volume
        directory.mkdir(parents=True, exist_ok=True)
        volumes: list[dict[str, Any]] = pod.workload.spec.get("volumes", [])
        spec = next((v for v in volumes if v["name"] == volume), {})
        if "secret" in spec:
            data = self._secrets[spec["secret"]["secretName"]]
            items = spec["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                (directory / item["path"]).write_text(data[item["key"]])
        pod.volumes[volume] = directory
        return directory

    def _env(self, container: Container, pod: _Pod) -> dict[str, str]:
        env: dict[str, str] = {}
        for entry in container.env:
            name = entry["name"]
            if "value" in entry:
                env[name] = _K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), entry["value"])
                continue
            source = entry["valueFrom"]
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                env[name] = {
                    "status.podIP": "127.0.0.1",
                    "metadata.name": pod.name,
                    "metadata.namespace": NAMESPACE,
                }[path]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[name] = self._secrets[ref["name"]][ref["key"]]
            else:
                raise ValueError(f"{pod.name}/{container.name}: env {name} from {source}")
        return env

    def _local(self, value: str, container: Container, pod: _Pod, env: Mapping[str, str]) -> str:
        value = _K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), value)
        mounts = sorted(container.spec.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
        for mount in mounts:
            if mount["mountPath"] != "/dev/shm" and mount["mountPath"] in value:
                local = str(self._volume_dir(pod, mount["name"]))
                value = value.replace(mount["mountPath"], local)

        def address(match: re.Match[str]) -> str:
            host, port = self.address(match.group(1), int(match.group(2)), pod)
            return f"{host}:{port}"

        return _HOST_PORT.sub(address, value)

    def command(self, container: Container, pod_name: str) -> tuple[list[str], dict[str, str]]:
        """The argv and environment a container of ``pod_name`` runs with here."""
        pod = self.pods[pod_name]
        env = self._env(container, pod)
        local_env = {}
        for name, value in env.items():
            if name.endswith("_PORT") and value.isdigit():
                local_env[name] = str(pod.ports.get(int(value), int(value)))
            elif name == "UCX_NET_DEVICES":
                local_env[name] = value.replace("eth0", "lo")
            else:
                local_env[name] = self._local(value, container, pod, env)
        argv = []
        for index, arg in enumerate(container.argv):
            if index and container.argv[index - 1] == "--port" and arg.isdigit():
                argv.append(str(pod.ports.get(int(arg), int(arg))))
            else:
                argv.append(self._local(arg, container, pod, env))
        # The image's PATH: this environment's python, kvbroker and etcd.
        local_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        return argv, local_env

    def _probe(self, container: Container, pod: _Pod) -> Probe | None:
        spec = container.spec.get("startupProbe") or container.spec.get("readinessProbe")
        if spec is None:
            return None
        if "httpGet" in spec:
            port = spec["httpGet"]["port"]
            number = container.ports[port] if isinstance(port, str) else int(port)
            url = f"http://127.0.0.1:{pod.ports[number]}{spec['httpGet'].get('path', '/')}"
            return http_ok(url, within_s=900, every_s=0.25)
        if "grpc" in spec:
            return _grpc_health(f"127.0.0.1:{pod.ports[int(spec['grpc']['port'])]}")
        raise ValueError(f"{pod.name}/{container.name}: unsupported probe {spec}")

    async def start(self, order: list[str]) -> None:
        """Starts the workloads named in ``order``, one after another; each pod's containers
        in a kubelet's order (init containers to completion, then sidecars, then the main
        containers), each ready when its startup or readiness probe passes."""
        by_name = {pod.workload.name: pod.workload for pod in self.pods.values()}
        for workload_name in order:
            workload = by_name[workload_name]
            for pod_name in workload.pod_names():
                pod = self.pods[pod_name]
                for claim in workload.claims:
                    self._volume_dir(pod, claim)
                for container in workload.containers():
                    argv, env = self.command(container, pod_name)
                    probe = self._probe(container, pod)
                    child = ChildProcess(
                        f"{pod_name}/{container.name}",
                        argv,
                        self.workdir / f"{pod_name}-{container.name}.log",
                        ready=[probe] if probe is not None else [],
                        env=env,
                    )
                    self.children.append(child)
                    await child.start()
                    if container.stage == "init":
                        code = await child.wait()
                        if code != 0:
                            raise RuntimeError(f"{child.name} failed:\n{child.log_tail()}")

    async def stop(self) -> None:
        await stop_all(list(reversed(self.children)), grace_s=15)
        self.children.clear()


def _grpc_health(target: str) -> Answers:
    """Ready once the gRPC health service answers SERVING (what a ``grpc:`` probe asks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def check() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    return Answers(check, f"gRPC health SERVING on {target}", within_s=120, every_s=0.25)
