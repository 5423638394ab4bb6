"""The heap-based deadline notifier in isolation, on a clock the test moves."""

from __future__ import annotations

import asyncio

from kvbroker.controlplane.deadlines import DeadlineQueue
from kvbroker_tools.harness.factories import ManualClock
from tests.conftest import eventually


def test_pops_due_keys_in_order_and_skips_superseded() -> None:
    clock = ManualClock(100.0)
    queue: DeadlineQueue[str] = DeadlineQueue(clock)
    queue.schedule("a", 105)
    queue.schedule("b", 101)
    queue.schedule("c", 103)
    queue.schedule("a", 102)  # renewed earlier: the 105 entry must not fire
    queue.cancel("c")
    assert queue.pop_due(10) == []
    clock.t = 110
    assert queue.pop_due(10) == ["b", "a"]
    assert queue.pop_due(10) == []
    assert len(queue) == 0


def test_batches_respect_the_limit() -> None:
    clock = ManualClock(100.0)
    queue: DeadlineQueue[int] = DeadlineQueue(clock)
    for i in range(10):
        queue.schedule(i, 100 + i / 100)
    clock.t = 200
    assert queue.pop_due(4) == [0, 1, 2, 3]
    assert queue.pop_due(100) == [4, 5, 6, 7, 8, 9]


async def test_run_wakes_for_an_earlier_deadline() -> None:
    loop = asyncio.get_running_loop()
    queue: DeadlineQueue[str] = DeadlineQueue(loop.time)
    fired: list[tuple[str, float]] = []

    async def on_due(keys: list[str]) -> None:
        fired.extend((k, loop.time()) for k in keys)

    task = asyncio.create_task(queue.run(on_due, 100))
    start = loop.time()
    queue.schedule("late", start + 5)
    await asyncio.sleep(0)  # the task starts, and sleeps until the late deadline
    queue.schedule("soon", start + 0.1)
    await eventually(lambda: fired, within=4)  # before the late one is due
    task.cancel()
    assert [k for k, _ in fired] == ["soon"]
    assert 0.1 <= fired[0][1] - start < 4


def test_entries_left_behind_do_not_pile_up() -> None:
    """Renewals and cancellations far ahead of their deadlines (a turn supersedes a lease
    hours before it would expire) must not grow the heap without bound."""
    clock = ManualClock(100.0)
    queue: DeadlineQueue[int] = DeadlineQueue(clock)
    for renewal in range(20):
        for key in range(5_000):
            queue.schedule(key, 10_000 + renewal + key / 10_000)
    for key in range(0, 5_000, 2):
        queue.cancel(key)
    assert len(queue) == 2_500
    assert len(queue._heap) <= 2 * 5_000  # 100,000 entries were pushed
    clock.t = 20_000
    due = queue.pop_due(10_000)
    assert due == list(range(1, 5_000, 2))  # each live key once, at its last deadline
