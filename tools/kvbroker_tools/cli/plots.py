"""The check every plotting benchmark's command makes first, in one place."""

from __future__ import annotations

from kvbroker.cli.output import fail
from kvbroker_tools.bench.plotting import PlottingUnavailable, ready_plotting


def plots_or_fail() -> None:
    """Stops a benchmark that ends in a plot before it runs when matplotlib (the plots extra)
    is missing, rather than after minutes of work."""
    try:
        ready_plotting()
    except PlottingUnavailable as error:
        fail(str(error))
