"""The import layering, read off the source (no imports run): a lower layer never imports a
higher one, and the parts (registry, sidecar, router, engine extension) never reach into each
other. The tree says the layering (``controlplane/__init__.py``); this test keeps it true.

- Registry: ``REGISTRY_LAYERS``, lowest first. A module may import its own layer's package and
  any lower layer; two packages of one layer (replication and api) do not import each other.
- Common: rules (pure) < process helpers < client helpers, and common imports no part.
- vLLM: only the engine extension's ``vllm_compat`` package imports it (``VLLM_TOUCHERS``);
  the rest of the extension reaches vLLM through that package's names.
- Parts: the registry, the sidecar, the router, the engine extension and the gateway hop
  import only themselves,
  ``kvbroker.common`` and the generated ``kvbroker.v1``. The operator's command line and the
  tools (``kvbroker_tools``: benchmarks, the one-machine stack, the test harness) import a part
  only through its ``PUBLIC`` modules.
- Tools: the product (``kvbroker``) never imports ``kvbroker_tools``, which ships apart;
  inside the tools, ``TOOLS_LAYERS`` lowest first, and no import circle anywhere.
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
TOOLS_DIR = ROOT / "tools" / "kvbroker_tools"
# The product's own tools (the operator's command line), and the tools' package as one.
TOOLS = ("cli", "calibration", "kvbroker_tools")
PARTS = ("controlplane", "sidecar", "router", "engine_ext", "gateway")
# kvbroker_tools' layers, lowest first: a module imports its own layer and lower ones only.
TOOLS_LAYERS: list[tuple[str, ...]] = [
    ("testmodel", "stack"),  # the generated model; the whole stack on one machine
    ("chat",),  # one streamed turn through a stack's router
    ("harness",),  # stand-ins and fixtures the tests and the benchmarks share
    ("bench",),
    ("demo",),
    ("cli",),  # the commands kvbroker finds by entry point
]

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
    "router": {"config", "server", "auth", "local_hints", "metrics"},
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
    for path in TOOLS_DIR.rglob("*.py"):
        modules[_module_of(path, TOOLS_DIR, "kvbroker_tools")] = path
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


def _third_party(path: Path) -> Iterator[str]:
    """The top-level packages outside kvbroker a file imports, lazy imports included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


# The package whose modules are the only ones that import vLLM.
VLLM_TOUCHERS = "kvbroker.engine_ext.vllm_compat"


def vllm_violations(imports: dict[str, list[str]]) -> list[str]:
    return [
        f"{module} imports vllm: only {VLLM_TOUCHERS} does"
        for module, imported in sorted(imports.items())
        if "vllm" in imported
        and module != VLLM_TOUCHERS
        and not module.startswith(VLLM_TOUCHERS + ".")
    ]


def _edges() -> Iterator[tuple[str, str]]:
    for module, path in sorted(SOURCES.items()):
        for imported in _imports(path):
            yield module, imported


def _part(module: str) -> str:
    """``kvbroker.router.proxy``: ``router``; ``kvbroker`` itself: ``""``; any module of the
    tools: ``kvbroker_tools``."""
    if module.partition(".")[0] == "kvbroker_tools":
        return "kvbroker_tools"
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


def _tools_layer(module: str) -> tuple[int, str]:
    top = [*module.split("."), ""][1]
    for index, names in enumerate(TOOLS_LAYERS):
        if top in names:
            return index, top
    raise AssertionError(f"{module} is in no layer: add it to TOOLS_LAYERS")


def tools_violations(edges: list[tuple[str, str]]) -> list[str]:
    found = []
    for importer, imported in edges:
        source, target = _part(importer), _part(imported)
        if target == "kvbroker_tools" and source != "kvbroker_tools":
            found.append(f"{importer} imports {imported}: the product never imports the tools")
        if source == target == "kvbroker_tools" and importer != "kvbroker_tools":
            (low, low_name), (high, high_name) = _tools_layer(importer), _tools_layer(imported)
            if high > low:
                found.append(f"{importer} ({low_name}) imports {imported} ({high_name})")
    return found


def circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The import circles: each set of modules that import each other, directly or not
    (Tarjan's strongly connected components, without recursion)."""
    graph: dict[str, list[str]] = {}
    for importer, imported in edges:
        graph.setdefault(importer, []).append(imported)
        graph.setdefault(imported, [])
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root, targets in graph.items():
        if root in order:
            continue
        work = [(root, iter(targets))]
        order[root] = low[root] = len(order)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in order:
                order[child] = low[child] = len(order)
                stack.append(child)
                work.append((child, iter(graph[child])))
            elif child in stack:
                low[node] = min(low[node], order[child])
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


def test_the_product_never_imports_the_tools_and_the_tools_import_downwards() -> None:
    assert tools_violations(EDGES) == []


def test_no_module_imports_itself_through_others() -> None:
    """Imports only under TYPE_CHECKING count too: a circle there is one in the design."""
    assert circles(EDGES) == []


def test_a_circle_is_found() -> None:
    edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d")]
    assert sorted(circles(edges)) == [["a", "b", "c"], ["d", "e"]]
    assert circles([("a", "b"), ("b", "c"), ("a", "c")]) == []


def test_only_the_vllm_compat_package_imports_vllm() -> None:
    imports = {module: list(_third_party(path)) for module, path in SOURCES.items()}
    touchers = [module for module, imported in imports.items() if "vllm" in imported]
    assert VLLM_TOUCHERS in touchers and f"{VLLM_TOUCHERS}.metrics" in touchers
    assert vllm_violations(imports) == []
    assert vllm_violations({"kvbroker.engine_ext.connector": ["vllm"]}) != []
    assert vllm_violations({"kvbroker.engine_ext.vllm_compatible": ["vllm"]}) != []


@pytest.mark.parametrize(
    ("edge", "check"),
    [
        (("kvbroker.controlplane.records.model", "kvbroker.controlplane.lessor.leases"), "r"),
        (("kvbroker.controlplane.api.service", "kvbroker.controlplane.replication.replica"), "r"),
        (("kvbroker.common.rules.routing", "kvbroker.common.client.grpc_client"), "c"),
        (("kvbroker.common.rules.ids", "kvbroker.controlplane.config"), "c"),
        (("kvbroker.router.proxy", "kvbroker.sidecar.config"), "p"),
        (("kvbroker.cli.node", "kvbroker.controlplane.registry"), "p"),
        (("kvbroker_tools.bench.fleet", "kvbroker.controlplane.registry"), "p"),
        (("kvbroker.cli.main", "kvbroker_tools.cli.bench"), "t"),
        (("kvbroker.common.rules.engine_metrics", "kvbroker_tools.testmodel"), "t"),
        (("kvbroker_tools.harness.turns", "kvbroker_tools.bench.turns"), "t"),
        (("kvbroker_tools.stack", "kvbroker_tools.harness.processes"), "t"),
    ],
)
def test_each_rule_refuses_an_import_against_it(edge: tuple[str, str], check: str) -> None:
    rule = {
        "r": registry_violations,
        "c": common_violations,
        "p": part_violations,
        "t": tools_violations,
    }[check]
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
