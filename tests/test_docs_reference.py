"""The documentation site's reference pages: every flag, setting, connector key and metric has
a description (read by the same generator the site is built with), and the site builds with
``mkdocs build --strict`` (no broken link, no page missing from the navigation)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbroker.engine_ext.settings import KvBrokerSettings
from scripts import docs_grpc, docs_reference

ROOT = Path(__file__).resolve().parent.parent


def test_every_flag_setting_and_metric_has_a_description() -> None:
    assert docs_reference.undocumented() == []


@dataclass(frozen=True)
class _Example:
    # Described above.
    above: int = 1
    trailing: float = 2.0  # Described on its line.
    bare: str = ""
    # Described in two
    # lines.
    two_lines: bool = True

    bare_after_blank: int = 0


def test_a_field_is_described_by_the_comment_above_it_or_on_its_line_only() -> None:
    settings = {s.name: s.description for s in docs_reference.config_settings(_Example)}
    assert settings == {
        "above": "Described above.",
        "trailing": "Described on its line.",
        "bare": "",
        "two_lines": "Described in two lines.",
        "bare_after_blank": "",
    }


def test_the_reference_covers_every_part() -> None:
    commands = {command.path for command in docs_reference.cli_commands()}
    assert {"kvbroker registry serve", "kvbroker lease ls", "kvbroker demo"} <= commands
    keys = {key.name for key in docs_reference.connector_keys()}
    assert {"kvbroker_sidecar", "kv_recompute_threshold", "decoder_kv_blocks_ttl"} <= keys
    # Every field of the connector's settings is reachable by a key.
    assert len(keys) == len(docs_reference.config_settings(KvBrokerSettings))
    metrics = {(m.process, m.name): m for m in docs_reference.metric_docs()}
    assert metrics["registry", "kvbroker_hints_total"].labels == ("decision", "consistency")
    assert metrics["registry", "kvbroker_retained_bytes"].labels == ("node",)
    assert ("sidecar", "kvbroker_sidecar_engine_ready") in metrics
    assert metrics["router", "kvbroker_router_ttft_seconds"].type == "histogram"
    grpc = docs_grpc.grpc_page()
    assert "### service `RegistryService`" in grpc
    assert "Where to send a conversation's next turn" in grpc


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the docs extra)"
)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    for page in ("reference/cli", "reference/settings", "reference/grpc", "reference/metrics"):
        assert (tmp_path / page / "index.html").is_file()


# A test named on a page: its module and its function (a parameter set in brackets left off).
NAMED_TEST = re.compile(r"(tests/\w+\.py)::(\w+)")


def test_every_test_a_page_names_exists() -> None:
    """A page that lists tests (the development page's slowest tests, among others) names
    only tests the suite has: a test renamed or removed must be renamed there too."""
    named = {
        (module, name)
        for page in (ROOT / "docs").rglob("*.md")
        for module, name in NAMED_TEST.findall(page.read_text())
    }
    assert ("tests/test_drain.py", "test_drain_waits_for_the_read_in_flight_and_loses_no_turn") in (
        named
    )
    missing = [
        f"{module}::{name}"
        for module, name in sorted(named)
        if not (ROOT / module).is_file()
        or not re.search(rf"^(async )?def {name}\(", (ROOT / module).read_text(), re.M)
    ]
    assert missing == []
