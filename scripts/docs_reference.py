"""The documentation site's reference pages, generated from the code when the site is built.

Each page is read from what defines the thing it documents, so the site cannot drift from the
code and nothing is written twice: the CLI from the typer app (every command and option with
its help), the settings from the config dataclasses (each field's description is the comment
directly above it, or on its line), the connector's ``kv_connector_extra_config`` keys from
``KvBrokerSettings.from_extra_config``, the gRPC API from the proto files' comments (parsed by
protoc itself, with source info), and the metrics from the Prometheus registries that serve
them. ``undocumented`` lists every flag, setting and metric without a description; the tests
require it to be empty.

MkDocs loads this file as a hook (``hooks:`` in mkdocs.yml): ``on_files`` adds the pages as
generated files, so none of them is committed.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from prometheus_client.metrics import MetricWrapperBase
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from kvbroker.cli.main import app
from kvbroker.controlplane.config import RegistryConfig
from kvbroker.controlplane.metrics import RegistryMetrics
from kvbroker.engine_ext.metric_catalog import ENGINE_METRICS, VLLM_LABELS
from kvbroker.engine_ext.settings import KvBrokerSettings
from kvbroker.gateway.config import PlacementConfig
from kvbroker.router.config import RouterConfig
from kvbroker.router.metrics import RouterMetrics
from kvbroker.sidecar.config import SidecarConfig
from kvbroker.sidecar.metrics import SidecarMetrics
from scripts.docs_grpc import cell, grpc_page

ROOT = Path(__file__).resolve().parent.parent

# The config dataclasses documented on the settings page, under the part that reads each.
CONFIGS: tuple[tuple[str, type[Any]], ...] = (
    ("registry", RegistryConfig),
    ("router", RouterConfig),
    ("sidecar", SidecarConfig),
    ("placement", PlacementConfig),
)
# Every Prometheus registry kvbroker serves, by the process that serves it.
METRICS: tuple[tuple[str, type[Any]], ...] = (
    ("registry", RegistryMetrics),
    ("sidecar", SidecarMetrics),
    ("router", RouterMetrics),
)


@dataclass(frozen=True)
class Param:
    """One option or argument of a command."""

    names: str
    envvar: str
    default: str
    help: str


@dataclass(frozen=True)
class Command:
    """One command (``kvbroker lease ls``), with its help and parameters."""

    path: str
    help: str
    params: tuple[Param, ...]


@dataclass(frozen=True)
class Setting:
    """One field of a config dataclass, or one ``kv_connector_extra_config`` key."""

    name: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Metric:
    """One metric as Prometheus scrapes it (counters with their ``_total``)."""

    process: str
    name: str
    type: str
    labels: tuple[str, ...]
    help: str


# --- CLI ------------------------------------------------------------------------------------


def cli_commands() -> list[Command]:
    """Every command of the ``kvbroker`` CLI that runs something, in the order ``--help``
    lists them, with its options and arguments (``--help`` itself left out)."""
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup), "the kvbroker app has command groups"
    return list(_commands(root, "kvbroker", typer.Context(root, info_name="kvbroker")))


def _commands(
    command: TyperCommand | TyperGroup, path: str, context: typer.Context
) -> Iterator[Command]:
    if isinstance(command, TyperGroup):
        for name in command.list_commands(context):
            child = command.get_command(context, name)
            if isinstance(child, TyperCommand | TyperGroup) and not child.hidden:
                yield from _commands(child, f"{path} {name}", typer.Context(child, context, name))
        return
    params = tuple(
        _param(param)
        for param in command.params
        if isinstance(param, TyperOption | TyperArgument) and not param.hidden
    )
    yield Command(path, _paragraphs(command.help or ""), params)


def _param(param: TyperOption | TyperArgument) -> Param:
    if isinstance(param, TyperOption):
        names = ", ".join([*param.opts, *param.secondary_opts])
    else:
        names = (param.metavar or param.name or "").upper()
    default = "" if param.required or param.default is None else _shown(param.default)
    envvar = param.envvar if isinstance(param.envvar, str) else ", ".join(param.envvar or ())
    return Param(names, envvar, default, " ".join((param.help or "").split()))


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return ", ".join(str(item) for item in value)
    if hasattr(value, "value"):  # an Enum choice
        return str(value.value)
    return str(value)


def _paragraphs(text: str) -> str:
    """A command's help as typer prints it: paragraphs joined, ``\\b`` markers dropped."""
    return "\n\n".join(
        " ".join(paragraph.split()) for paragraph in text.split("\n\n") if paragraph.strip()
    ).replace("\b", "")


# --- Settings -------------------------------------------------------------------------------


def config_settings(cls: type[Any], prefix: str = "") -> list[Setting]:
    """The fields of a config dataclass, each described by the comment directly above it (or
    on its line); a field whose default is itself a config dataclass is listed field by field
    under its name (``planner.max_local_prefill_tokens``)."""
    comments = field_comments(cls)
    settings: list[Setting] = []
    for field in dataclasses.fields(cls):
        default = _default(field)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            settings.extend(config_settings(type(default), f"{prefix}{field.name}."))
            continue
        settings.append(
            Setting(
                name=prefix + field.name,
                type=str(field.type),
                default="required" if default is dataclasses.MISSING else repr(default),
                description=comments.get(field.name, ""),
            )
        )
    return settings


def _default(field: dataclasses.Field[Any]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def field_comments(cls: type[Any]) -> dict[str, str]:
    """Each field's description in a class's source: its trailing comment, else the block of
    comment lines directly above it (a blank line or code ends the block)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    described: dict[str, str] = {}
    class_node = ast.parse(source).body[0]
    assert isinstance(class_node, ast.ClassDef)
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = comments.get(node.end_lineno or node.lineno)
        if trailing is not None and not lines[node.lineno - 1].lstrip().startswith("#"):
            described[node.target.id] = trailing
            continue
        block: list[str] = []
        line = node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            block.insert(0, comments[line])
            line -= 1
        if block:
            described[node.target.id] = " ".join(block)
    return described


def connector_keys() -> list[Setting]:
    """The ``kv_connector_extra_config`` keys the connector reads, by the key vLLM is given:
    ``from_extra_config`` names each key beside the field it sets, so the key comes from there
    and the description and default from the field."""
    fields = {setting.name: setting for setting in config_settings(KvBrokerSettings)}
    source = textwrap.dedent(inspect.getsource(KvBrokerSettings.from_extra_config))
    keys: list[Setting] = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id != "cls":
            continue
        for keyword in node.keywords:
            key = next(
                (
                    constant.value
                    for constant in ast.walk(keyword.value)
                    if isinstance(constant, ast.Constant) and isinstance(constant.value, str)
                ),
                None,
            )
            if key is not None and keyword.arg in fields:
                keys.append(dataclasses.replace(fields[keyword.arg], name=key))
    return keys


# --- Metrics --------------------------------------------------------------------------------


def metric_docs() -> list[Metric]:
    """Every metric in the registries kvbroker's processes serve, read from a fresh instance
    of each (the per-node gauges of the registry's own collector included)."""
    found: list[Metric] = []
    for process, metrics_class in METRICS:
        metrics = metrics_class()
        # prometheus_client has no public accessor for a metric's label names before it has
        # children: both its metric wrappers and its metric families keep them here.
        wrapper_labels = {
            wrapper._name: wrapper._labelnames
            for wrapper in vars(metrics).values()
            if isinstance(wrapper, MetricWrapperBase)
        }
        for family in metrics.registry.collect():
            labels = wrapper_labels.get(family.name, getattr(family, "_labelnames", ()))
            name = f"{family.name}_total" if family.type == "counter" else family.name
            found.append(Metric(process, name, family.type, tuple(labels), family.documentation))
    for metric in ENGINE_METRICS:  # served by vLLM's API server (engine_ext.connector_metrics)
        name = f"{metric.name}_total" if metric.kind == "counter" else metric.name
        labels = (*VLLM_LABELS, *metric.extra_labels)
        found.append(Metric("engine", name, metric.kind, labels, metric.documentation))
    return found


# --- Pages ----------------------------------------------------------------------------------


def cli_page() -> str:
    out = [
        "# CLI",
        "",
        "Generated from the `kvbroker` typer app. Every flag also reads the environment "
        "variable shown beside it.",
        "",
    ]
    for command in cli_commands():
        out += [f"## `{command.path}`", "", command.help, ""]
        if command.params:
            out += ["| option | env | default | description |", "|---|---|---|---|"]
            for p in command.params:
                env = f"`{p.envvar}`" if p.envvar else ""
                default = f"`{p.default}`" if p.default else ""
                out.append(f"| `{p.names}` | {env} | {default} | {cell(p.help)} |")
            out.append("")
    return "\n".join(out) + "\n"


def settings_page() -> str:
    out = [
        "# Settings",
        "",
        "Generated from the config dataclasses each part reads. Most of them are also flags "
        "of the part's command (see the [CLI](cli.md)); the rest are fixed by the code.",
        "",
    ]
    for part, cls in CONFIGS:
        out += [f"## {part} (`{cls.__name__}`)", ""]
        out += _settings_table("setting", config_settings(cls))
    out += [
        "## The connector's `kv_connector_extra_config` keys",
        "",
        "Given to vLLM in `--kv-transfer-config` (see "
        "[next to an existing vLLM](../deploy/existing-vllm.md)). "
        "`kv_recompute_threshold` and `decoder_kv_blocks_ttl` are vLLM's own keys, which "
        "kvbroker also reads.",
        "",
        *_settings_table("key", connector_keys()),
    ]
    return "\n".join(out) + "\n"


def _settings_table(what: str, settings: list[Setting]) -> list[str]:
    out = [f"| {what} | type | default | description |", "|---|---|---|---|"]
    for s in settings:
        out.append(f"| `{s.name}` | `{s.type}` | `{s.default}` | {cell(s.description)} |")
    return [*out, ""]


def metrics_page() -> str:
    out = [
        "# Metrics",
        "",
        "Generated from the Prometheus registries kvbroker's processes serve. The D→P reads "
        "themselves are vLLM's `vllm:nixl_*` metrics on the prefill servers; the *engine* "
        "series are kvbroker's connector's, on each vLLM server's own `/metrics`.",
        "",
    ]
    for process in [*(process for process, _ in METRICS), "engine"]:
        out += [
            f"## {process}",
            "",
            "| metric | type | labels | description |",
            "|---|---|---|---|",
        ]
        for m in metric_docs():
            if m.process == process:
                labels = ", ".join(f"`{label}`" for label in m.labels)
                out.append(f"| `{m.name}` | {m.type} | {labels} | {cell(m.help)} |")
        out.append("")
    return "\n".join(out) + "\n"


def pages() -> dict[str, str]:
    """The generated pages by their path in the site's sources."""
    return {
        "reference/cli.md": cli_page(),
        "reference/settings.md": settings_page(),
        "reference/grpc.md": grpc_page(),
        "reference/metrics.md": metrics_page(),
    }


def undocumented() -> list[str]:
    """Every flag, setting, connector key and metric that has no description."""
    missing = [
        f"{command.path} {param.names}"
        for command in cli_commands()
        for param in command.params
        if not param.help
    ]
    missing += [f"{command.path} (the command)" for command in cli_commands() if not command.help]
    for part, cls in CONFIGS:
        missing += [f"{part} setting {s.name}" for s in config_settings(cls) if not s.description]
    missing += [f"connector key {s.name}" for s in connector_keys() if not s.description]
    missing += [f"{m.process} metric {m.name}" for m in metric_docs() if not m.help]
    return missing


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: adds the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files
