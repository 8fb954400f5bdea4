"""The generation queues' bound, against the project's Redis: ``GENERATION_QUEUE_MAX`` messages,
or more while the workers' measured rate drains them within ``GENERATION_QUEUE_MAX_WAIT_S``; a
refusal asks for the time to drain half of what waits (``inference/backpressure.py``). The queue
with real workers and web processes: tests/reliability/test_overload.py."""

from __future__ import annotations

import time
import uuid

import pytest

from inference import backpressure
from inference.backpressure import QueueFull
from ragsite.celery import queue_lists
from ragsite.redis import Role, redis_client


@pytest.fixture
def queue(settings):
    settings.GENERATION_QUEUE_MAX = 3
    settings.GENERATION_QUEUE_MAX_WAIT_S = 10
    settings.GENERATION_QUEUE_RETRY_AFTER_S = 2
    name = f"bp-{uuid.uuid4().hex[:8]}"
    yield name
    client = redis_client(Role.BROKER)
    client.delete(*queue_lists(name), backpressure.reservations_key(name), *client.keys(f"backpressure:taken:{name}:*"))


def waiting(queue: str, count: int) -> None:
    client = redis_client(Role.BROKER)
    client.delete(queue)
    if count:
        client.rpush(queue, *[f"message {n}" for n in range(count)])


def taken_before(queue: str, per_second: int) -> None:
    """The workers took ``per_second`` generations in each of the window's whole seconds."""
    now = int(time.time())
    client = redis_client(Role.BROKER)
    for second in range(now - backpressure.DRAIN_WINDOW_S - 2, now):
        client.set(backpressure._taken_key(queue, second), per_second, ex=60)


def refused(queue: str) -> QueueFull:
    with pytest.raises(QueueFull) as room:
        backpressure.queue_room(queue)
    with pytest.raises(QueueFull) as slot, backpressure.queue_slot(queue):
        pass
    assert (slot.value.waiting, slot.value.limit, slot.value.retry_after_s) == (
        room.value.waiting,
        room.value.limit,
        room.value.retry_after_s,
    )
    return slot.value


def admitted(queue: str) -> bool:
    backpressure.queue_room(queue)
    with backpressure.queue_slot(queue):
        return True


def test_without_a_measured_rate_the_bound_is_generation_queue_max(queue):
    waiting(queue, 2)
    assert admitted(queue)
    waiting(queue, 3)
    full = refused(queue)
    assert (full.waiting, full.limit, full.retry_after_s) == (3, 3, 2.0)
    assert "3 generations are waiting on queue" in str(full) and "try again in 2 s" in str(full)


def test_a_measured_rate_lets_wait_what_it_drains_within_the_max_wait(queue, settings):
    taken_before(queue, 2)  # 2 a second: 20 drained within 10 s
    waiting(queue, 19)
    assert admitted(queue)
    waiting(queue, 20)
    full = refused(queue)
    # Half of the 20 waiting drained at 2 a second: 5 s.
    assert (full.waiting, full.limit, full.retry_after_s) == (20, 20, 5.0)

    settings.GENERATION_QUEUE_MAX_WAIT_S = 0  # the count alone
    waiting(queue, 3)
    full = refused(queue)
    assert (full.limit, full.retry_after_s) == (3, 0.75)


def test_a_fast_queue_asks_for_no_less_than_the_shortest_wait(queue, settings):
    settings.GENERATION_QUEUE_MAX_WAIT_S = 0
    taken_before(queue, 100)
    waiting(queue, 3)
    assert refused(queue).retry_after_s == backpressure.RETRY_AFTER_MIN_S  # 3 / 100 / 2 would be 15 ms


def test_a_taken_generation_counts_in_its_second_for_a_while(queue, monkeypatch):
    now = time.time()
    monkeypatch.setattr(backpressure.time, "time", lambda: now)  # both in one second
    backpressure.generation_taken(queue)
    backpressure.generation_taken(queue)
    client = redis_client(Role.BROKER)
    (key,) = client.keys(f"backpressure:taken:{queue}:*")
    assert client.get(key) == b"2"
    assert 0 < client.ttl(key) <= 2 * backpressure.DRAIN_WINDOW_S + 1
