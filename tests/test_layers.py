"""The import layering, read off the source (no imports run): a lower layer never imports a
higher one, and the parts (registry, sidecar, router, engine extension) never reach into each
other. The tree says the layering (``controlplane/__init__.py``); this test keeps it true.

- Registry: ``REGISTRY_LAYERS``, lowest first. A module may import its own layer's package and
  any lower layer; two packages of one layer (replication and api) do not import each other.
- Common: rules (pure) < process helpers < client helpers, and common imports no part.
- Parts: the registry, the sidecar, the router, the engine extension and the gateway hop
  import only themselves,
  ``kvbroker.common`` and the generated ``kvbroker.v1``. The operator's tools (CLI, benchmarks,
  the one-machine stack, test helpers) import a part only through its ``PUBLIC`` modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each part's source lives (kvbroker/<part> is a link to the top-level folder).
PART_DIRS = {
    "controlplane": ROOT / "controlplane",
    "sidecar": ROOT / "sidecar",
    "router": ROOT / "router",
    "engine_ext": ROOT / "engine_ext",
    "gateway": ROOT / "gateway",
    "common": ROOT / "kvbroker" / "common",
}
TOOLS = ("cli", "bench", "testing", "stack", "demo", "calibration")
PARTS = ("controlplane", "sidecar", "router", "engine_ext", "gateway")

# The registry's layers, lowest first; a name is a top-level module or a sub-package.
REGISTRY_LAYERS: list[tuple[str, ...]] = [
    ("errors", "config", "metrics", "deadlines"),  # what every part of the registry shares
    ("records",),
    ("storage",),
    ("context",),  # the shared collaborators, handed to each part once
    ("sessions",),
    ("lessor",),
    ("placement",),
    ("registry",),
    ("replication", "api"),
    ("server",),
]
# The registry's settings hold each part's own settings class; the modules that define them
# import nothing of the registry (checked below), so the settings stay at the bottom.
SETTINGS_FROM = {("config", "placement.planner"), ("config", "sessions.idle_ttl")}
COMMON_LAYERS = ["rules", "process", "client"]
# What the operator's tools may import of each part: how to configure and serve it.
PUBLIC = {
    "controlplane": {
        "config",
        "server",
        "placement.planner",  # PlannerConfig, a part of RegistryConfig
        "storage.etcd_store",  # EtcdEndpoints, the --store option
        "api.identity",  # Principal, for `registry token`
    },
    "sidecar": {"config", "server"},
    "router": {"config", "server", "auth"},
    "engine_ext": set(),
    "gateway": {
        "config",
        "server",
        # Envoy's ext_proc messages, for the picker stand-in the tests put after the hop.
        "envoy_v3.envoy.config.core.v3.base_pb2",
        "envoy_v3.envoy.service.ext_proc.v3.external_processor_pb2",
        "envoy_v3.envoy.type.v3.http_status_pb2",
    },
}


def _module_of(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _sources() -> dict[str, Path]:
    """Every module kvbroker ships, by dotted name."""
    modules: dict[str, Path] = {}
    for part, folder in PART_DIRS.items():
        for path in folder.rglob("*.py"):
            modules[_module_of(path, folder, f"kvbroker.{part}")] = path
    for path in (ROOT / "kvbroker").rglob("*.py"):
        relative = path.relative_to(ROOT / "kvbroker").parts
        if relative[0] not in {"v1", *PART_DIRS}:
            modules[_module_of(path, ROOT / "kvbroker", "kvbroker")] = path
    return modules


SOURCES = _sources()


def _imports(path: Path) -> Iterator[str]:
    """The kvbroker modules a file imports, lazy imports included; ``from a import b`` names
    module ``a.b`` when there is one."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("kvbroker"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvbroker"):
            module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names]
            inner = [name for name in names if name in SOURCES]
            yield from inner or [module]


def _edges() -> Iterator[tuple[str, str]]:
    for module, path in sorted(SOURCES.items()):
        for imported in _imports(path):
            yield module, imported


def _part(module: str) -> str:
    """``kvbroker.router.proxy``: ``router``; ``kvbroker`` itself: ``""``."""
    return [*module.split("."), ""][1]


def _within(module: str, part: str) -> str:
    """``kvbroker.controlplane.records.model`` within controlplane: ``records.model``."""
    return module.removeprefix(f"kvbroker.{part}").removeprefix(".")


def _registry_layer(module: str) -> tuple[int, str]:
    top = _within(module, "controlplane").split(".")[0]
    for index, names in enumerate(REGISTRY_LAYERS):
        if top in names:
            return index, top
    raise AssertionError(f"{module} is in no layer: add it to REGISTRY_LAYERS")


def registry_violations(edges: list[tuple[str, str]]) -> list[str]:
    found = []
    for importer, imported in edges:
        if _part(importer) != "controlplane" or _part(imported) != "controlplane":
            continue
        if importer == "kvbroker.controlplane":
            found.append(f"{importer} imports {imported}: the map imports nothing")
            continue
        (low, low_name), (high, high_name) = _registry_layer(importer), _registry_layer(imported)
        pair = (_within(importer, "controlplane"), _within(imported, "controlplane"))
        if pair in SETTINGS_FROM:
            continue
        if high > low or (high == low and low_name != high_name and low > 0):
            found.append(f"{importer} ({low_name}) imports {imported} ({high_name})")
    return found


def common_violations(edges: list[tuple[str, str]]) -> list[str]:
    found = []
    for importer, imported in edges:
        if _part(importer) != "common":
            continue
        if _part(imported) not in {"common", "v1"}:
            found.append(f"{importer} imports {imported}: common imports no part")
            continue
        if _part(imported) == "common" and imported != "kvbroker.common":
            low = COMMON_LAYERS.index(_within(importer, "common").split(".")[0])
            high = COMMON_LAYERS.index(_within(imported, "common").split(".")[0])
            if high > low:
                found.append(f"{importer} imports {imported}, a higher layer of common")
    return found


def part_violations(edges: list[tuple[str, str]]) -> list[str]:
    found = []
    for importer, imported in edges:
        source, target = _part(importer), _part(imported)
        if target not in PARTS or source == target:
            continue
        if source in PARTS:
            found.append(f"{importer} imports {imported}: parts talk over gRPC, not imports")
        elif source in TOOLS and _within(imported, target) not in PUBLIC[target]:
            found.append(f"{importer} imports {imported}, inside {target}")
    return found


EDGES = list(_edges())


def test_the_registry_layers_import_only_downwards() -> None:
    assert registry_violations(EDGES) == []


def test_the_settings_classes_config_holds_import_nothing_of_the_registry() -> None:
    for _, source in SETTINGS_FROM:
        module = f"kvbroker.controlplane.{source}"
        assert [i for i in _imports(SOURCES[module]) if _part(i) == "controlplane"] == []


def test_common_layers_import_only_downwards_and_no_part() -> None:
    assert common_violations(EDGES) == []


def test_parts_import_only_themselves_and_tools_only_public_modules() -> None:
    assert part_violations(EDGES) == []


@pytest.mark.parametrize(
    ("edge", "check"),
    [
        (("kvbroker.controlplane.records.model", "kvbroker.controlplane.lessor.leases"), "r"),
        (("kvbroker.controlplane.api.service", "kvbroker.controlplane.replication.replica"), "r"),
        (("kvbroker.common.rules.routing", "kvbroker.common.client.grpc_client"), "c"),
        (("kvbroker.common.rules.ids", "kvbroker.controlplane.config"), "c"),
        (("kvbroker.router.proxy", "kvbroker.sidecar.config"), "p"),
        (("kvbroker.cli.node", "kvbroker.controlplane.registry"), "p"),
    ],
)
def test_each_rule_refuses_an_import_against_it(edge: tuple[str, str], check: str) -> None:
    rule = {"r": registry_violations, "c": common_violations, "p": part_violations}[check]
    assert len(rule([edge])) == 1


@pytest.mark.parametrize(
    "package",
    sorted(
        module
        for module, path in SOURCES.items()
        if path.name == "__init__.py" and _part(module) in {"controlplane", "common"}
    ),
)
def test_every_package_of_the_registry_and_common_says_its_job(package: str) -> None:
    assert ast.get_docstring(ast.parse(SOURCES[package].read_text())), package
