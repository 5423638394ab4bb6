"""Moved to kvbroker.testing.engine; this name stays only while test modules that other
changes are editing still import it from here."""

from kvbroker.testing.engine import FakeEngine, serving

__all__ = ["FakeEngine", "serving"]
