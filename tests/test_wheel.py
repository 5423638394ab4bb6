"""The package a user installs: kvbroker's wheel, built from a copy of this tree the way the
images build it (deploy/images/steps.sh: the build context, then ``pip wheel --no-deps``),
holds every part and works outside the checkout.

The parts (controlplane/, sidecar/, router/, engine_ext/) reach the ``kvbroker`` import root
only through directory links, so the wheel is compared file by file with what the links
lead to. Building writes into its tree (build/, *.egg-info), which is why it gets a copy; the
test checks that the checkout is left as it was.

The install is ``pip install --no-deps`` into a fresh venv whose dependencies come from this
environment's site-packages through a .pth file: fast, and what it checks is the wheel's own
files and entry point. Installing the dependencies from the index too (and without the
plotting extra) is what tests/test_e2e_images.py does for the control plane's image.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "deploy" / "images" / "steps.sh"
# Each part, as a subpackage of kvbroker, and a module of it that its command imports.
PARTS = {
    "controlplane": "kvbroker.controlplane.server",
    "sidecar": "kvbroker.sidecar.server",
    "router": "kvbroker.router.server",
    # The connector itself imports vLLM; its settings are plain Python.
    "engine_ext": "kvbroker.engine_ext.settings",
}

pytestmark = pytest.mark.timeout(300)


def steps(*args: str | Path) -> None:
    """One step of deploy/images/steps.sh, with this interpreter as its python."""
    subprocess.run(
        ["sh", str(STEPS), *map(str, args)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )


def built_wheel(workdir: Path) -> Path:
    """kvbroker's wheel, built from a copy of this tree in ``workdir``."""
    steps("context", ROOT, workdir / "src")
    steps("wheel", workdir / "src", workdir / "wheels")
    (wheel,) = (workdir / "wheels").glob("kvbroker-*.whl")
    return wheel


def outside(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` run in ``cwd`` without this checkout on its path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


def _checkout_state() -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--ignored", "--untracked-files=all"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    before = _checkout_state()
    built = built_wheel(tmp_path_factory.mktemp("wheel"))
    assert _checkout_state() == before, "building the wheel wrote into the checkout"
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(prefix / "bin" / "python"), "install",
         "--quiet", "--no-deps", str(wheel)],
        check=True,
    )  # fmt: skip
    site = prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    # This environment's packages after the venv's own, so kvbroker is the wheel's.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return prefix


def _sources(directory: Path) -> set[str]:
    """The package's files (modules, stubs, markers) under ``directory``, links followed."""
    found = set()
    for parent, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith((".py", ".pyi")) or name == "py.typed":
                found.add(str((Path(parent) / name).relative_to(directory.parent)))
    return found


def test_the_wheel_holds_every_part_through_its_link(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {n for n in names if n.startswith("kvbroker/")}
    assert in_wheel == _sources(ROOT / "kvbroker")
    for part in PARTS:
        assert (ROOT / "kvbroker" / part).is_symlink()
        assert f"kvbroker/{part}/__init__.py" in in_wheel


def test_the_installed_command_runs_outside_the_checkout(venv: Path, tmp_path: Path) -> None:
    shown = outside(venv / "bin" / "kvbroker", "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    for group in ("registry", "sidecar", "router", "node", "demo"):
        assert group in shown.stdout


def test_each_part_imports_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    probe = (
        "import importlib\n"
        f"for name in {list(PARTS.values())!r}: print(importlib.import_module(name).__file__)"
    )
    imported = outside(venv / "bin" / "python", "-c", probe, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    site = (venv / "lib").resolve()
    for path in imported.stdout.split():
        assert Path(path).resolve().is_relative_to(site), path


def test_a_plot_without_the_bench_extra_names_it(venv: Path, tmp_path: Path) -> None:
    """matplotlib is the bench extra: without it (hidden here; tests/test_e2e_images.py
    installs without it), a benchmark that plots stops before it runs, saying what to
    install."""
    hidden = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kvbroker.cli.main import app; app(prog_name='kvbroker')"
    )
    argv = ("bench", "retention", "--output", "out")
    ran = outside(venv / "bin" / "python", "-c", hidden, *argv, cwd=tmp_path)
    assert ran.returncode == 1, ran.stderr
    assert "pip install 'kvbroker[bench]'" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert not (tmp_path / "out").exists()
