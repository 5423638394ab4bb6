"""The registry process's collector tuning: startup's objects are frozen and the young
generation is collected less often (``tune_gc_for_serving``); the test restores the
process's collector afterwards, since the thresholds and the frozen set are process-wide."""

from __future__ import annotations

import gc

from kvbroker.controlplane.server import GC_YOUNG_THRESHOLD, tune_gc_for_serving


def test_serving_freezes_startup_objects_and_raises_the_young_threshold() -> None:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    startup_object: list[list[str]] = [["built before serving"]]  # a container: tracked
    assert gc.is_tracked(startup_object)
    try:
        tune_gc_for_serving()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *thresholds[1:])
        assert gc.get_freeze_count() > 0
        # Frozen: in the permanent generation, which no collection walks.
        assert not any(startup_object is o for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
