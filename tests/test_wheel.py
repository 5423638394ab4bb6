"""The packages a user installs: kvbroker's wheel and its tools' (kvbroker-tools), built from a
copy of this tree the way the images build them (deploy/images/steps.sh: the build context,
then ``pip wheel --no-deps``). kvbroker's holds every part, works outside the checkout and
ships no tool (no benchmark, harness, stack, demo or test model); the tools' holds the tools
and adds their commands to ``kvbroker``, which names where to get them while they are missing.

The parts (controlplane/, sidecar/, router/, engine_ext/) reach the ``kvbroker`` import root
only through directory links, so the wheel is compared file by file with what the links
lead to. Building writes into its tree (build/, *.egg-info), which is why it gets a copy; the
test checks that the checkout is left as it was.

The install is ``pip install --no-deps`` into a fresh venv whose dependencies come from this
environment's site-packages through a .pth file, kvbroker's own installs there left out (so
that only the wheels' entry points are found): fast, and what it checks is the wheels' own
files and entry points. Installing the dependencies from the index too (and without the
plots extra) is what tests/test_e2e_images.py does for the images.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest

from kvbroker.cli.main import TOOL_COMMANDS, TOOL_COMMANDS_GROUP
from kvbroker.cli.output import EXIT_REJECTED

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "deploy" / "images" / "steps.sh"
TOOLS = ROOT / "tools"
# Each part, as a subpackage of kvbroker, and a module of it that its command imports.
PARTS = {
    "controlplane": "kvbroker.controlplane.server",
    "sidecar": "kvbroker.sidecar.server",
    "router": "kvbroker.router.server",
    # The connector itself imports vLLM; its settings are plain Python.
    "engine_ext": "kvbroker.engine_ext.settings",
}
# What only the tools hold: a module or package of one of these names in kvbroker's wheel is
# a tool shipped with the product.
TOOL_NAMES = {"bench", "testing", "harness", "stack", "demo", "testmodel", "kvbroker_tools"}

pytestmark = pytest.mark.timeout(300)


def steps(*args: str | Path) -> None:
    """One step of deploy/images/steps.sh, with this interpreter as its python. A failed step
    fails the test with the end of its output, where pip puts its error (above it, pip may
    print a warning per package for each index location that lacks it)."""
    done = subprocess.run(
        ["sh", str(STEPS), *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        pytest.fail(f"steps.sh {args[0]} exited {done.returncode}; its last lines:\n{tail}")


class Wheels(NamedTuple):
    product: Path
    tools: Path


def built_wheels(workdir: Path) -> Wheels:
    """kvbroker's wheel and its tools', built from a copy of this tree in ``workdir``."""
    steps("context", ROOT, workdir / "src")
    steps("wheel", workdir / "src", workdir / "wheels")
    (product,) = (workdir / "wheels").glob("kvbroker-*.whl")
    (tools,) = (workdir / "wheels").glob("kvbroker_tools-*.whl")
    return Wheels(product, tools)


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
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    before = _checkout_state()
    built = built_wheels(tmp_path_factory.mktemp("wheel"))
    assert _checkout_state() == before, "building the wheels wrote into the checkout"
    return built


def _dependencies(into: Path) -> Path:
    """This environment's site-packages as links in ``into``, less kvbroker's and its tools'
    own installs (an editable install's metadata would add its entry points)."""
    into.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("kvbroker", "__editable__")):
            (into / entry.name).symlink_to(entry)
    return into


def _venv(prefix: Path, *wheels: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True)
    # Without PYTHONPATH: pip runs in the venv, where an install on that path (a checkout's
    # tools) would pass for the wheel's.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(prefix / "bin" / "python"), "install",
         "--quiet", "--no-deps", *map(str, wheels)],
        check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    site = prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    # This environment's packages after the venv's own.
    (site / "dependencies.pth").write_text(f"{_dependencies(prefix / 'dependencies')}\n")
    return prefix


@pytest.fixture(scope="module")
def venv(wheels: Wheels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvbroker's wheel alone."""
    return _venv(tmp_path_factory.mktemp("venv"), wheels.product)


@pytest.fixture(scope="module")
def tools_venv(wheels: Wheels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvbroker's wheel and its tools'."""
    return _venv(tmp_path_factory.mktemp("tools-venv"), *wheels)


def _sources(directory: Path) -> set[str]:
    """The package's files (modules, stubs, markers) under ``directory``, links followed."""
    found = set()
    for parent, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith((".py", ".pyi")) or name == "py.typed":
                found.add(str((Path(parent) / name).relative_to(directory.parent)))
    return found


def _entry_points(wheel: Path, group: str) -> set[str]:
    """The names under ``group`` in the wheel's entry_points.txt."""
    archive = zipfile.ZipFile(wheel)
    listed = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser(delimiters=("=",))
    for name in listed:
        parser.read_string(archive.read(name).decode())
    return set(parser[group]) if parser.has_section(group) else set()


def test_the_wheel_holds_every_part_through_its_link(wheels: Wheels) -> None:
    names = set(zipfile.ZipFile(wheels.product).namelist())
    in_wheel = {n for n in names if n.startswith("kvbroker/")}
    assert in_wheel == _sources(ROOT / "kvbroker")
    for part in PARTS:
        assert (ROOT / "kvbroker" / part).is_symlink()
        assert f"kvbroker/{part}/__init__.py" in in_wheel


def test_the_product_wheel_holds_no_tool(wheels: Wheels) -> None:
    names = zipfile.ZipFile(wheels.product).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"kvbroker"}
    shipped = {Path(n).with_suffix("").name for n in names} | {
        part for n in names for part in Path(n).parent.parts
    }
    assert shipped & TOOL_NAMES == set()
    assert _entry_points(wheels.product, TOOL_COMMANDS_GROUP) == set()


def test_the_tools_wheel_holds_the_tools_and_their_commands(wheels: Wheels) -> None:
    names = set(zipfile.ZipFile(wheels.tools).namelist())
    assert {n for n in names if not n.split("/")[0].endswith(".dist-info")} == _sources(
        TOOLS / "kvbroker_tools"
    )
    assert _entry_points(wheels.tools, TOOL_COMMANDS_GROUP) == set(TOOL_COMMANDS)


def test_the_product_names_the_commands_the_tools_register() -> None:
    """kvbroker.cli.main lists the tools' commands for a product installed without them: the
    list is the one tools/pyproject.toml registers."""
    project = tomllib.loads((TOOLS / "pyproject.toml").read_text())["project"]
    assert set(project["entry-points"][TOOL_COMMANDS_GROUP]) == set(TOOL_COMMANDS)


def test_the_installed_command_runs_outside_the_checkout(venv: Path, tmp_path: Path) -> None:
    shown = outside(venv / "bin" / "kvbroker", "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    for group in ("registry", "sidecar", "router", "node", "calibrate", *TOOL_COMMANDS):
        assert group in shown.stdout
    assert "Not installed" in shown.stdout


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


@pytest.mark.parametrize(
    "argv",
    [
        ("bench", "retention", "--output", "out"),
        ("bench", "--help"),
        ("demo",),
        ("up", "--reuse", "off", "--workdir", "out"),
    ],
)
def test_a_tool_without_the_tools_says_how_to_get_them(
    venv: Path, tmp_path: Path, argv: tuple[str, ...]
) -> None:
    ran = outside(venv / "bin" / "kvbroker", *argv, cwd=tmp_path)
    assert ran.returncode == EXIT_REJECTED, ran.stderr
    assert f"`kvbroker {argv[0]}` is one of kvbroker's tools" in ran.stderr
    assert "pip install kvbroker-tools" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert not (tmp_path / "out").exists()


def test_the_tools_add_their_commands(tools_venv: Path, tmp_path: Path) -> None:
    kvbroker = tools_venv / "bin" / "kvbroker"
    shown = outside(kvbroker, "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "Not installed" not in shown.stdout
    benches = outside(kvbroker, "bench", "--help", cwd=tmp_path)
    assert benches.returncode == 0, benches.stderr
    for bench in ("multiturn", "retention", "registry", "failover", "fleet", "agentic"):
        assert bench in benches.stdout
    probe = "import kvbroker_tools.bench.retention as m; print(m.__file__)"
    imported = outside(tools_venv / "bin" / "python", "-c", probe, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).resolve().is_relative_to(tools_venv.resolve())


def test_a_plot_without_the_plots_extra_names_it(tools_venv: Path, tmp_path: Path) -> None:
    """matplotlib is the tools' plots extra: without it (hidden here; tests/test_e2e_images.py
    installs without it), a benchmark that plots stops before it runs, saying what to
    install."""
    hidden = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kvbroker.cli.main import app; app(prog_name='kvbroker')"
    )
    argv = ("bench", "retention", "--output", "out")
    ran = outside(tools_venv / "bin" / "python", "-c", hidden, *argv, cwd=tmp_path)
    assert ran.returncode == 1, ran.stderr
    assert "pip install 'kvbroker-tools[plots]'" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert not (tmp_path / "out").exists()
