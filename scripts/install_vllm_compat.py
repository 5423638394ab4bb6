"""Installs a vLLM release into the running venv for ``make compat``, without the requirements
that cannot be installed from the package index and that nothing kvbroker tests needs.

vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, a release the index does not have (it has
0.7.2.post1 and 0.7.4), so ``pip install vllm==0.34.0`` cannot resolve. FlashInfer is a GPU
attention backend, imported only when a model runs on a GPU. So vLLM is installed without its
requirements, then every requirement of the release (markers evaluated) except the ones in
``SKIPPED``, in one resolve, with the NIXL release the connector needs.

Usage: python scripts/install_vllm_compat.py 0.34.0 1.5.1
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

# Requirements left out, exactly as a release states them, and why.
SKIPPED = {
    "flashinfer-python==0.7.3": "vLLM 0.34.0's pin, a release the index lacks; GPU-only",
}


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args], check=True)


def main(vllm_version: str, nixl_version: str) -> None:
    pip("--no-deps", f"vllm=={vllm_version}")
    wanted = []
    for line in requires("vllm") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if str(requirement) in SKIPPED:
            print(f"not installing {requirement}: {SKIPPED[str(requirement)]}")
            continue
        wanted.append(str(requirement))
    pip(*wanted, f"nixl=={nixl_version}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
