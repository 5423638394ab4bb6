"""The end-to-end stage, several times in a row: a proof that it is stable rather than lucky
(issue 43). ``make e2e-repeat N=3 LOAD=1`` runs it.

Each run is what ``make test`` runs second, ``pytest -q -m "e2e or soak"``, from this checkout,
with a JUnit XML report per run under ``--out``; with ``--load`` a CPU hog
(scripts/cpu_hog.py) spins beside every run. At the end it prints each run's result, time and
the ids of the tests that failed (also in ``summary.txt`` under ``--out``), and exits 1 unless
every run passed.

    python -m scripts.e2e_repeat [--runs N] [--load] [--out DIR] [-- PYTEST ARGS...]

Arguments after ``--`` go to every pytest run (``-- tests/test_e2e_images.py``: one module).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

STAGE = ["-q", "-m", "e2e or soak"]
HOG = Path(__file__).with_name("cpu_hog.py")


@dataclass
class Run:
    number: int
    returncode: int
    seconds: float
    tests: int | None = None  # None: pytest wrote no report (it crashed or was stopped)
    failed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def read_report(path: Path) -> tuple[int, list[str]] | None:
    """How many tests a JUnit report (pytest's xunit1 flavour) holds, and the ids of those
    that failed or errored, as pytest names them; None where there is no readable report."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = list(root.iter("testcase"))
    failed = [
        node_id(case)
        for case in cases
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return len(cases), failed


def node_id(case: ET.Element) -> str:
    """tests/test_x.py::TestClass::test_name[param] from a testcase's file, classname and name."""
    name = case.get("name", "?")
    file = case.get("file")
    classname = case.get("classname", "")
    if not file:
        return f"{classname}::{name}" if classname else name
    module = file.removesuffix(".py").replace("/", ".")
    classes = classname.removeprefix(module).strip(".")
    return "::".join([file, *(classes.split(".") if classes else []), name])


def run_once(number: int, out: Path, pytest_args: list[str]) -> Run:
    report = out / f"run-{number}.xml"
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", *STAGE, f"--junitxml={report}"]
    argv += ["-o", "junit_family=xunit1", *pytest_args]
    print(f"== run {number}: {shlex.join(argv)}", flush=True)
    started = time.monotonic()
    returncode = subprocess.call(argv)
    run = Run(number, returncode, time.monotonic() - started)
    read = read_report(report)
    if read is not None:
        run.tests, run.failed = read
    print(f"== run {number}: {describe(run)}", flush=True)
    return run


def describe(run: Run) -> str:
    result = "passed" if run.passed else f"FAILED (pytest exited {run.returncode})"
    tests = "no report" if run.tests is None else f"{run.tests} tests, {len(run.failed)} failed"
    return f"{result} in {run.seconds:.0f} s; {tests}"


def summary(runs: list[Run], asked: int, load: bool) -> str:
    lines = [f"run {run.number}: {describe(run)}" for run in runs]
    for run in runs:
        lines += [f"  run {run.number} failed: {node_id}" for node_id in run.failed]
    passed = sum(run.passed for run in runs)
    beside = "beside a CPU hog (one core, nice 19)" if load else "without added load"
    lines.append(f"{passed} of {len(runs)} runs passed ({asked} asked), {beside}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    pytest_args: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, pytest_args = args_in[:cut], args_in[cut + 1 :]
    parser = argparse.ArgumentParser(description="The end-to-end stage, several times in a row.")
    parser.add_argument("--runs", type=int, default=3, help="how many runs (default 3)")
    parser.add_argument("--load", action="store_true", help="a CPU hog beside every run")
    parser.add_argument(
        "--out", type=Path, default=Path("results/e2e-repeat"), help="where the reports go"
    )
    args = parser.parse_args(args_in)
    args.out.mkdir(parents=True, exist_ok=True)
    hog = subprocess.Popen([sys.executable, str(HOG)]) if args.load else None
    runs: list[Run] = []
    try:
        for number in range(1, args.runs + 1):
            runs.append(run_once(number, args.out, pytest_args))
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    said = summary(runs, args.runs, args.load)
    (args.out / "summary.txt").write_text(said + "\n")
    print(said, flush=True)
    return 0 if len(runs) == args.runs and all(run.passed for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
