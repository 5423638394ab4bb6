"""The Kubernetes manifests (deploy/kubernetes) and the Grafana dashboard (deploy/grafana),
checked against the code: every overlay renders, every kvbroker command line and KVBROKER_*
variable in them is one the CLI accepts, and every metric the dashboard queries is served by
the running processes (vLLM's: defined by the installed vLLM)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer._click.core import Command, Context
from typer._click.exceptions import UsageError
from typer.core import TyperGroup

from kvbroker.cli.main import app
from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import ChildProcess, http_ok
from kvbroker.controlplane.storage.etcd_store import EtcdEndpoints
from kvbroker_tools.harness.engine import FakeEngine
from kvbroker_tools.harness.manifests import (
    DEPLOY,
    OVERLAYS,
    Container,
    containers,
    kustomize,
    make_secrets,
    render,
    secret_data,
    workloads,
)
from kvbroker_tools.harness.processes import RegistryProcess, sidecar_process
from kvbroker_tools.stack import router_command

TARGETS = {"base": DEPLOY / "base", **{name: DEPLOY / "overlays" / name for name in OVERLAYS}}
DASHBOARD = DEPLOY.parent / "grafana" / "kvbroker.json"
# What the downward API and Secrets would give a container, for parsing its flags.
SAMPLE_POD_IP = "10.1.2.3"


@pytest.fixture(scope="module", params=sorted(TARGETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(TARGETS[request.param])


# Rendering and the shape of what is rendered.


def test_every_overlay_renders_with_kubectl_kustomize() -> None:
    for name, target in TARGETS.items():
        assert "kind: StatefulSet" in kustomize(target), name


def test_overlays_describe_the_whole_deployment(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, manifests = rendered
    by_name = {w.name: w for w in workloads(manifests)}
    registry = by_name["kvbroker-registry"]
    assert registry.replicas == 3
    store = {e["name"]: str(e.get("value")) for e in registry.containers()[0].env}["KVBROKER_STORE"]
    assert store.startswith("etcd://")
    if name != "base":  # the base leaves etcd to an overlay
        assert by_name["kvbroker-etcd"].kind == "StatefulSet"
    assert {"kvbroker-router", "kvbroker-prefill", "kvbroker-decode"} <= set(by_name)
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
               for d in manifests if d["kind"] == "PodDisruptionBudget"}  # fmt: skip
    assert budgets == set(by_name)
    for workload in by_name.values():
        assert workload.spec.get("containers"), workload.name
        annotations = next(
            d["spec"]["template"]["metadata"].get("annotations", {})
            for d in manifests
            if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == workload.name
        )
        assert annotations.get("prometheus.io/scrape") == "true", workload.name
        for container in workload.containers():
            assert container.spec["resources"]["requests"], container.name
    block_sizes: dict[str, str | None] = {}
    for role in ("prefill", "decode"):
        engine = by_name[f"kvbroker-{role}"]
        stages = {c.name: c.stage for c in engine.containers()}
        assert stages["sidecar"] == "sidecar" and stages["vllm"] == "main"
        sidecar, vllm = (c for c in engine.containers() if c.name in ("sidecar", "vllm"))
        shared = {m["name"] for m in sidecar.spec["volumeMounts"]}
        shared &= {m["name"] for m in vllm.spec["volumeMounts"]}
        assert "run" in shared
        assert any(v["name"] == "run" and "emptyDir" in v for v in engine.spec["volumes"])
        assert vllm.ports["nixl"] == 5600
        env = {e["name"]: str(e.get("value")) for e in vllm.env}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        config = json.loads(env["KV_TRANSFER_CONFIG"])
        assert config["kv_connector_module_path"] == "kvbroker.engine_ext.connector"
        assert config["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        socket = config["kv_connector_extra_config"]["kvbroker_sidecar"]
        assert socket in sidecar.argv
        # The sidecar tells the registry what the engine does with its prefix cache.
        engine_caches = "--no-enable-prefix-caching" not in vllm.argv
        assert ("--no-prefix-caching" not in sidecar.argv) == engine_caches, role
        assert vllm.spec["readinessProbe"]["httpGet"]["path"] == "/health"
        block_sizes[role] = _flag(vllm.argv, "--block-size")
        # Tool calling on, as agents need (Claude Code's turns carry tools).
        assert "--enable-auto-tool-choice" in vllm.argv, role
        assert _flag(vllm.argv, "--tool-call-parser") == "hermes", role
    # P and D share the KV block size (vLLM's default for the device where none is given).
    assert block_sizes["prefill"] == block_sizes["decode"]
    if name == "cpu":
        assert block_sizes["decode"] == "32"
    registry_container = registry.containers()[0]
    assert registry_container.spec["readinessProbe"]["grpc"]["port"] == 7070
    router = by_name["kvbroker-router"].containers()[0]
    assert router.spec["readinessProbe"]["httpGet"]["path"] == "/health"
    drain = by_name["kvbroker-decode"].containers()[-1].kvbroker_invocations()
    assert ("preStop", ["node", "drain", "$KVBROKER_NODE_ID", "--wait"]) in drain
    assert by_name["kvbroker-decode"].spec["terminationGracePeriodSeconds"] >= 60


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_make_secrets_issues_a_credential_per_engine_pod() -> None:
    secrets = {s["metadata"]["name"]: secret_data(s) for s in make_secrets(1, 2)}
    pods = {
        pod
        for w in workloads(render(TARGETS["gpu"]))
        if w.name in ("kvbroker-prefill", "kvbroker-decode")
        for pod in w.pod_names()
    }
    assert set(secrets["kvbroker-node-tokens"]) == pods
    lines = secrets["kvbroker-registry"]["credentials"].splitlines()
    holders = {f"node:{p}:{p.split('-')[1]}" for p in pods}  # kvbroker-ROLE-N
    assert {line.split()[0] for line in lines} == {"admin", "router"} | holders
    assert secrets["kvbroker-router"]["token"]


# Every kvbroker command line parses with the real CLI.


def _cli() -> Command:
    # typer (0.29) carries its own click, as typer._click: the CLI is parsed by that one.
    return typer.main.get_command(app)


def _resolve(args: list[str]) -> tuple[Command, list[str], list[str]]:
    """The (sub)command ``kvbroker args`` runs, its path, and the arguments left for it."""
    command, path, rest = _cli(), ["kvbroker"], list(args)
    while isinstance(command, TyperGroup):
        if not rest:
            raise UsageError(f"{' '.join(path)} needs a command")
        name = rest.pop(0)
        sub = command.get_command(Context(command), name)
        if sub is None:
            raise UsageError(f"{' '.join(path)} has no command {name!r}")
        command, path = sub, [*path, name]
    return command, path, rest


def _sample_env(container: Container) -> dict[str, str]:
    """The container's environment as a pod would see it, with sample values where a cluster
    fills them in (pod IP, pod name, Secrets)."""
    env: dict[str, str] = {}
    for entry in container.env:
        if "value" in entry:
            env[entry["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"]
            )
        else:
            field = entry["valueFrom"].get("fieldRef", {}).get("fieldPath")
            env[entry["name"]] = {"status.podIP": SAMPLE_POD_IP}.get(
                field or "", f"{container.workload}-0" if field else "sample-token"
            )
    for name in container.env_names() - set(env):
        env[name] = "sample-token"  # exported by its script (the node's token)
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), arg)


def check_invocation(args: list[str], env: dict[str, str]) -> Context:
    """Parses ``kvbroker args`` with the CLI itself in environment ``env`` (its KVBROKER_*
    variables only); raises click's UsageError when a flag, value or command is not accepted,
    and ValueError when an address the command will parse is malformed."""
    command, path, rest = _resolve([_expand(a, env) for a in args])
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVBROKER_")}
    try:
        for name in saved:
            del os.environ[name]
        os.environ.update({k: v for k, v in env.items() if k.startswith("KVBROKER_")})
        context = command.make_context(" ".join(path), rest)
    finally:
        for name in [k for k in os.environ if k.startswith("KVBROKER_")]:
            del os.environ[name]
        os.environ.update(saved)
    params = context.params
    if params.get("registry"):
        RegistryEndpoint.parse(params["registry"])
    if params.get("store") not in (None, "memory"):
        EtcdEndpoints.parse(params["store"])
    listen = params.get("listen") or ""
    if listen and not listen.startswith("unix:"):
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen {listen!r} is not HOST:PORT")
    return context


def envvars_read(command: Command) -> set[str]:
    names: set[str] = set()
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        if isinstance(envvar, str):
            names.add(envvar)
        elif envvar:
            names.update(envvar)
    return names


def check_environment(container: Container, commands: list[Command]) -> None:
    """Every KVBROKER_* variable the container gets is read by a kvbroker command it runs or
    used by its own scripts; every variable its scripts use is one it gets."""
    read = set().union(*(envvars_read(c) for c in commands)) if commands else set()
    used = container.script_variables()
    given = container.env_names()
    for name in sorted(n for n in given if n.startswith("KVBROKER_")):
        if name not in read and name not in used:
            raise ValueError(f"{container.workload}/{container.name}: nothing reads {name}")
    for name in sorted(used - given):
        raise ValueError(f"{container.workload}/{container.name}: {name} is never set")


def _invocations(manifests: list[dict[str, Any]]) -> Iterator[tuple[Container, str, list[str]]]:
    for container in containers(manifests):
        for where, args in container.kvbroker_invocations():
            yield container, where, args


def test_every_kvbroker_command_line_and_variable_is_accepted_by_the_cli(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, manifests = rendered
    checked = 0
    for container in containers(manifests):
        commands = []
        for where, args in container.kvbroker_invocations():
            try:
                check_invocation(args, _sample_env(container))
            except (UsageError, ValueError) as error:
                pytest.fail(f"{container.workload}/{container.name} {where}: kvbroker {args}: "
                            f"{error}")  # fmt: skip
            commands.append(_resolve(args)[0])
            checked += 1
        check_environment(container, commands)
    # registry, router, and a sidecar per engine role at least.
    assert checked >= 4


def test_the_decode_pods_prestop_drain_parses(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, manifests = rendered
    hooks = [(c, a) for c, where, a in _invocations(manifests) if where == "preStop"]
    assert hooks
    for container, args in hooks:
        context = check_invocation(args, _sample_env(container))
        assert context.params["node_id"] == f"{container.workload}-0"
        assert context.params["wait"] is True


@pytest.mark.parametrize(
    ("args", "env", "error"),
    [
        (["registry", "serve", "--listn", "0.0.0.0:7070"], {}, UsageError),
        (["sidecar", "run", "--role", "decoder", "--engine-url", "http://e"], {}, UsageError),
        (["sidecar", "run", "--role", "decode"], {}, UsageError),  # no engine URL
        (["router", "run"], {"KVBROKER_REGISTRY": "registry"}, ValueError),
        (["registry", "serve"], {"KVBROKER_STORE": "etcd://"}, ValueError),
        (["registry", "srve"], {}, UsageError),
    ],
)
def test_a_manifest_the_cli_does_not_accept_fails_the_check(
    args: list[str], env: dict[str, str], error: type[Exception]
) -> None:
    with pytest.raises(error):
        check_invocation(args, env)


def test_a_kvbroker_variable_nothing_reads_fails_the_check() -> None:
    manifests = render(TARGETS["cpu"])
    router = next(c for c in containers(manifests) if c.name == "router")
    spec = {**router.spec, "env": [*router.env, {"name": "KVBROKER_REGISTRY_ADDR", "value": "x"}]}
    wrong = Container(router.workload, router.name, router.stage, spec)
    with pytest.raises(ValueError, match="KVBROKER_REGISTRY_ADDR"):
        check_environment(wrong, [_resolve(["router", "run"])[0]])


# Every metric the dashboard queries exists.


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs
    return {name for expr in exprs for name in re.findall(r"\b(kvbroker_\w+|vllm:[\w:]+)", expr)}


def exposed(text: str) -> set[str]:
    """Every series name a /metrics page can have: its samples, and for each declared family
    (even one with no sample yet, a labelled counter nothing has counted) its series."""
    names = set(re.findall(r"^([a-zA-Z_:][\w:]*)[{ ]", text, re.MULTILINE))
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names.add(name)
        if kind in ("histogram", "summary"):
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return names


def vllm_metric_names() -> set[str]:
    """The ``vllm:`` metric names the installed vLLM defines, with the series its
    prometheus_client types expose (found in its source: starting an engine is not needed)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    names: set[str] = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "vllm:" not in text:
            continue
        names |= set(re.findall(r"""name=["'](vllm:\w+)["']""", text))
    series = set()
    for name in names:
        series |= {name, f"{name}_total", f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return series


async def test_every_metric_the_dashboard_queries_is_served(tmp_path: Path) -> None:
    wanted = dashboard_metrics()
    assert any(n.startswith("vllm:nixl_") for n in wanted)
    registry = RegistryProcess("--metrics-listen", "127.0.0.1:0", log=tmp_path / "registry.log")
    router_port = free_port()
    router = ChildProcess(
        "router",
        router_command(registry.address, f"127.0.0.1:{router_port}"),
        tmp_path / "router.log",
        ready=[http_ok(f"http://127.0.0.1:{router_port}/health", within_s=30, every_s=0.1)],
    )
    async with FakeEngine("decode-0") as engine:
        sidecar = sidecar_process(
            registry.address, engine.url, "decode-0", tmp_path / "s.sock", log=tmp_path / "s.log"
        )
        sidecar.argv += ["--metrics-listen", "127.0.0.1:0"]
        try:
            for child in (registry, sidecar, router):
                await child.start()
            pages = {
                "registry": f"http://{registry.announced['metrics']}/metrics",
                "sidecar": f"http://{sidecar.announced['metrics']}/metrics",
                "router": f"http://127.0.0.1:{router_port}/metrics",
            }
            served: set[str] = set()
            async with httpx.AsyncClient(timeout=5) as client:
                for url in pages.values():
                    served |= exposed((await client.get(url)).text)
        finally:
            for child in (router, sidecar, registry):
                await child.stop()
    missing = {n for n in wanted if n.startswith("kvbroker_")} - served
    assert not missing, f"the dashboard queries metrics no process serves: {sorted(missing)}"
    missing_vllm = {n for n in wanted if n.startswith("vllm:")} - vllm_metric_names()
    assert not missing_vllm, f"vLLM defines no such metrics: {sorted(missing_vllm)}"
