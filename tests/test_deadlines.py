"""The deadline notifier in isolation, on a clock the test moves."""

from __future__ import annotations

import asyncio
import random

from kvbroker.controlplane.deadlines import BUCKET_S, DeadlineKey, DeadlineKind, DeadlineQueue
from kvbroker_tools.harness.factories import ManualClock
from tests.conftest import eventually

EXPIRY = DeadlineKind.LEASE_EXPIRY


def key(name: object) -> DeadlineKey:
    return (EXPIRY, str(name))


def test_pops_due_keys_in_order_and_skips_superseded() -> None:
    clock = ManualClock(100.0)
    queue = DeadlineQueue(clock)
    queue.schedule(key("a"), 105)
    queue.schedule(key("b"), 101)
    queue.schedule(key("c"), 103)
    queue.schedule(key("a"), 102)  # renewed earlier: the 105 entry must not fire
    queue.cancel(key("c"))
    assert queue.pop_due(10) == []
    clock.t = 110
    assert queue.pop_due(10) == [key("b"), key("a")]
    assert queue.pop_due(10) == []
    assert len(queue) == 0


def test_batches_respect_the_limit() -> None:
    clock = ManualClock(100.0)
    queue = DeadlineQueue(clock)
    for i in range(10):
        queue.schedule(key(i), 100 + i / 100)
    clock.t = 200
    assert queue.pop_due(4) == [key(i) for i in range(4)]
    assert queue.pop_due(100) == [key(i) for i in range(4, 10)]


def test_a_key_is_its_kind_and_id() -> None:
    clock = ManualClock(100.0)
    queue = DeadlineQueue(clock)
    queue.schedule((DeadlineKind.LEASE_EXPIRY, "x"), 101)
    queue.schedule((DeadlineKind.FORGET_LEASE, "x"), 102)
    queue.cancel((DeadlineKind.LEASE_EXPIRY, "x"))
    assert queue.deadline((DeadlineKind.FORGET_LEASE, "x")) == 102
    clock.t = 110
    due = queue.pop_due(10)
    assert due == [(DeadlineKind.FORGET_LEASE, "x")]
    assert due[0][0] is DeadlineKind.FORGET_LEASE


def test_within_a_due_bucket_the_earliest_comes_first_and_none_early() -> None:
    """A bucket falls due at its start; its entries still come out at their own times, and
    one scheduled into it meanwhile (or into one past: late) takes its place among them."""
    clock = ManualClock(100.0)
    queue = DeadlineQueue(clock)
    queue.schedule(key("late"), 100 + 0.9 * BUCKET_S)
    queue.schedule(key("soon"), 100 + 0.2 * BUCKET_S)
    clock.t = 100 + 0.5 * BUCKET_S
    assert queue.pop_due(10) == [key("soon")]
    queue.schedule(key("between"), 100 + 0.7 * BUCKET_S)
    queue.schedule(key("overdue"), 90)
    queue.schedule(key("late"), 100 + 0.6 * BUCKET_S)  # moved, within the bucket
    assert queue.pop_due(10) == [key("overdue")]
    clock.t = 100 + BUCKET_S
    assert queue.pop_due(10) == [key("late"), key("between")]
    assert len(queue) == 0


def test_it_answers_as_a_dictionary_and_a_sort_would() -> None:
    """Random schedules, cancels and pops against a dict of current deadlines."""
    chance = random.Random(7)
    clock = ManualClock(1000.0)
    queue = DeadlineQueue(clock)
    model: dict[DeadlineKey, float] = {}
    for _ in range(20_000):
        roll = chance.random()
        name = key(chance.randrange(2_000))
        if roll < 0.6:
            when = clock.t + chance.uniform(-2, 30)
            queue.schedule(name, when)
            model[name] = when
        elif roll < 0.8:
            queue.cancel(name)
            model.pop(name, None)
        elif roll < 0.99:
            assert queue.deadline(name) == model.get(name)
        else:
            clock.t += chance.uniform(0, 5)
            due = queue.pop_due(50)
            expected = sorted((w, k) for k, w in model.items() if w <= clock.t)[:50]
            assert [(model.pop(k), k) for k in due] == expected
        assert len(queue) == len(model)


def test_a_deadline_at_infinity_is_kept_and_never_falls_due() -> None:
    clock = ManualClock(100.0)
    queue = DeadlineQueue(clock)
    queue.schedule(key("never"), float("inf"))
    queue.schedule(key("soon"), 101)
    clock.t = 1e12
    assert queue.pop_due(10) == [key("soon")]
    assert queue.deadline(key("never")) == float("inf") and len(queue) == 1


async def test_run_wakes_for_an_earlier_deadline() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(loop.time)
    fired: list[tuple[DeadlineKey, float]] = []

    async def on_due(keys: list[DeadlineKey]) -> None:
        fired.extend((k, loop.time()) for k in keys)

    task = asyncio.create_task(queue.run(on_due, 100))
    start = loop.time()
    queue.schedule(key("late"), start + 5)
    await asyncio.sleep(0)  # the task starts, and sleeps until the late deadline
    queue.schedule(key("soon"), start + 0.1)
    await eventually(lambda: fired, within=4)  # before the late one is due
    task.cancel()
    assert [k for k, _ in fired] == [key("soon")]
    assert 0.1 <= fired[0][1] - start < 4


def test_entries_left_behind_do_not_pile_up() -> None:
    """Renewals and cancellations far ahead of their deadlines (a turn supersedes a lease
    hours before it would expire) must not grow the wheel without bound."""
    clock = ManualClock(100.0)
    queue = DeadlineQueue(clock)
    for renewal in range(20):
        for name in range(5_000):
            queue.schedule(key(name), 10_000 + renewal * 100 + name / 10_000)
    for name in range(0, 5_000, 2):
        queue.cancel(key(name))
    assert len(queue) == 2_500
    assert queue._filed <= 2 * 5_000  # 100,000 filings were made
    clock.t = 20_000
    due = queue.pop_due(10_000)
    assert due == [key(name) for name in range(1, 5_000, 2)]  # each live once, at its last
