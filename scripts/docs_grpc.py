"""The documentation site's gRPC API page, generated from the comments in the proto files (a
part of the reference generator, ``scripts/docs_reference.py``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"


def cell(text: str) -> str:
    """Text made safe for a Markdown table cell."""
    return text.replace("|", "\\|")


def proto_files() -> descriptor_pb2.FileDescriptorSet:
    """The schema as protoc parses it, comments included (``--include_source_info``). protoc
    runs in a process of its own: its C++ runtime, loaded into a process that has loaded
    vLLM's native libraries (the test suite's workers), can crash it."""
    files = sorted(str(path.relative_to(PROTO_ROOT)) for path in PROTO_ROOT.rglob("*.proto"))
    spec = importlib.util.find_spec("grpc_tools")
    assert spec is not None and spec.submodule_search_locations
    well_known = Path(next(iter(spec.submodule_search_locations))) / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "schema.pb"
        protoc = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}"]
        done = subprocess.run(
            [*protoc, "--include_source_info", f"--descriptor_set_out={out}", *files],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"protoc could not parse {PROTO_ROOT}: {done.stderr.strip()}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


# Where descriptor.proto puts each kind of child (the numbers in a SourceCodeInfo path).
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM = 2, 3, 4
_METHOD = 2
_VALUE = 2


def grpc_page() -> str:
    """The gRPC API page: each service's methods, then each message's fields and each enum's
    values, described by the comments in the proto files."""
    out = [
        "# gRPC API",
        "",
        "Generated from the comments in `proto/kvbroker/v1/*.proto` (package `kvbroker.v1`). "
        "Fields without a comment are named for what they hold.",
        "",
    ]
    for file in proto_files().file:
        comments = {
            tuple(location.path): _comment(location) for location in file.source_code_info.location
        }
        out += [f"## `{file.name}`", ""]
        for s, service in enumerate(file.service):
            out += [f"### service `{service.name}`", "", comments.get((_SERVICE, s), ""), ""]
            out += ["| method | request → response | description |", "|---|---|---|"]
            for m, method in enumerate(service.method):
                stream = "stream " if method.server_streaming else ""
                signature = (
                    f"`{_short(method.input_type)}` → {stream}`{_short(method.output_type)}`"
                )
                text = comments.get((_SERVICE, s, _METHOD, m), "")
                out.append(f"| `{method.name}` | {signature} | {cell(text)} |")
            out.append("")
        for e, enum in enumerate(file.enum_type):
            out += _enum(enum, (_ENUM, e), comments)
        for m, message in enumerate(file.message_type):
            out += _message(message, (_MESSAGE, m), comments, "")
    return "\n".join(out) + "\n"


def _message(
    message: descriptor_pb2.DescriptorProto,
    path: tuple[int, ...],
    comments: dict[tuple[int, ...], str],
    outer: str,
) -> list[str]:
    name = f"{outer}{message.name}"
    out = [f"### message `{name}`", ""]
    if comments.get(path):
        out += [comments[path], ""]
    if message.field:
        out += ["| field | type | description |", "|---|---|---|"]
        for f, field in enumerate(message.field):
            text = comments.get((*path, _FIELD, f), "")
            out.append(f"| `{field.name}` | {_field_type(field)} | {cell(text)} |")
        out.append("")
    for e, enum in enumerate(message.enum_type):
        out += _enum(enum, (*path, _NESTED_ENUM, e), comments, f"{name}.")
    for n, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            out += _message(nested, (*path, _NESTED, n), comments, f"{name}.")
    return out


def _enum(
    enum: descriptor_pb2.EnumDescriptorProto,
    path: tuple[int, ...],
    comments: dict[tuple[int, ...], str],
    outer: str = "",
) -> list[str]:
    out = [f"### enum `{outer}{enum.name}`", ""]
    if comments.get(path):
        out += [comments[path], ""]
    out += ["| value | number | description |", "|---|---:|---|"]
    for v, value in enumerate(enum.value):
        text = comments.get((*path, _VALUE, v), "")
        out.append(f"| `{value.name}` | {value.number} | {cell(text)} |")
    return [*out, ""]


def _field_type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type_name:
        kind = f"`{_short(field.type_name)}`"
    else:
        kind = descriptor_pb2.FieldDescriptorProto.Type.Name(field.type)
        kind = kind.removeprefix("TYPE_").lower()
    return f"repeated {kind}" if field.label == field.LABEL_REPEATED else kind


def _short(type_name: str) -> str:
    return type_name.removeprefix(".").removeprefix("kvbroker.v1.")


def _comment(location: descriptor_pb2.SourceCodeInfo.Location) -> str:
    text = location.leading_comments or location.trailing_comments
    return " ".join(text.split())
