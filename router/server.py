"""Serving the router with uvicorn."""

from __future__ import annotations

import uvicorn

from kvbroker.common.client.grpc_client import RegistryEndpoint
from kvbroker.common.process.heap import freeze_startup_heap
from kvbroker.router.auth import ApiKeys
from kvbroker.router.config import RouterConfig
from kvbroker.router.handlers import build_app
from kvbroker.router.proxy import Router


def serve(registry: RegistryEndpoint, config: RouterConfig, api_keys: ApiKeys | None) -> None:
    host, port = config.host_and_port()
    app = build_app(Router(registry, config, api_keys=api_keys))
    # Everything imported and built by now; what uvicorn adds when it starts is small.
    freeze_startup_heap()
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
