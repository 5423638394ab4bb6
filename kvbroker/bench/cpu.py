"""What a benchmark's child process costs in CPU, read from Linux's /proc: the registry bench
and the placement bench report their servers' cores, which on a shared machine says more
than their latencies do."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User and system CPU the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
