"""The benchmarks' plots. matplotlib is kvbroker-tools' ``plots`` extra, not a dependency (the
engine image installs the tools for the test model, and carries no plotting stack), so every
plot readies it here: one place that picks the file backend and turns its absence into a
sentence naming the extra. Callers import ``matplotlib.pyplot`` only after ``ready_plotting``
returned, and commands that plot call it before they run, so that a missing extra is found
before a long benchmark, not after it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS_EXTRA = "kvbroker-tools[plots]"


class PlottingUnavailable(RuntimeError):
    """matplotlib is not installed: the ``plots`` extra is missing."""

    def __init__(self) -> None:
        super().__init__(
            f"the benchmarks' plots need matplotlib, which is not installed: "
            f"pip install '{PLOTS_EXTRA}'"
        )


def ready_plotting() -> None:
    """Makes matplotlib draw into files (no display on a server); PlottingUnavailable when it
    is not installed."""
    try:
        import matplotlib
    except ImportError as error:
        raise PlottingUnavailable() from error
    matplotlib.use("Agg")


def save_figure(fig: Any, path: Path) -> Path:
    """Lays the figure out, writes it to ``path`` (its folder made if need be) as every
    benchmark's plot is written, and frees it; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
