"""Serving the router with uvicorn."""

from __future__ import annotations

import uvicorn

from kvbroker.common.grpc_client import RegistryEndpoint
from router.proxy import Router, RouterConfig, build_app


def serve(registry: RegistryEndpoint, host: str, port: int, config: RouterConfig) -> None:
    app = build_app(Router(registry, config))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
