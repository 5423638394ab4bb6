"""Installs a vLLM release into the running venv for ``make compat``, with the requirements
given, without those of the release that cannot be installed from the package index and that
nothing kvbroker tests needs.

vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, a release the index does not have (it has
0.7.2.post1 and 0.7.4), so ``pip install vllm==0.34.0`` cannot resolve. FlashInfer is a GPU
attention backend, imported only when a model runs on a GPU. So vLLM is installed without its
requirements, then every requirement of the release (markers evaluated) except the ones in
``SKIPPED``, and the ones given, in one resolve: nothing installed later moves vLLM's pins.

Both steps go through uv (``python -m uv``, installed in the venv first), not pip: the CUDA
wheels bring about 8 GB of torch and NVIDIA libraries per venv, which pip unpacks and
byte-compiles one file at a time (12 minutes per release on the 2-core CI machine), while uv
downloads in parallel, unpacks each wheel once into its cache and hard-links it into every venv
that needs it (under a minute per release from scratch; seconds for the second venv).

Usage: python scripts/install_vllm_compat.py 0.34.0 nixl==1.5.1 pytest ...
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


def install(*args: str) -> None:
    uv = [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable]
    subprocess.run([*uv, "--quiet", *args], check=True)


def release_requirements() -> list[str]:
    """The installed vLLM's requirements on this machine, less ``SKIPPED``."""
    wanted = []
    for line in requires("vllm") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if str(requirement) in SKIPPED:
            print(f"not installing {requirement}: {SKIPPED[str(requirement)]}")
            continue
        wanted.append(str(requirement))
    return wanted


def main(vllm_version: str, *also: str) -> None:
    install("--no-deps", f"vllm=={vllm_version}")
    install(*release_requirements(), *also)


if __name__ == "__main__":
    main(*sys.argv[1:])
