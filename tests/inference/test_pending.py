"""Generations published and not yet started (inference/pending.py), against the project's Redis:
a generation whose message is in no queue and not in kombu's ``unacked`` hash is lost at its
second look ``RECHECK_S`` apart, and published again; a delivery that starts after another has
is skipped. The whole path with a worker killed: benchmarks.scale_out (tests/benchmarks)."""

from __future__ import annotations

import json
import uuid

import pytest

from inference import pending
from inference.tasks import generate_routed, generations_lost_requeue
from ragsite.celery import queue_lists
from ragsite.redis import Role, redis_client

QUEUE = "remote"


@pytest.fixture
def broker():
    client = redis_client(Role.BROKER)
    client.delete(pending.INDEX_KEY, pending.SUSPECT_KEY, pending.UNACKED_KEY, *queue_lists(QUEUE))
    yield client
    client.delete(pending.INDEX_KEY, pending.SUSPECT_KEY, pending.UNACKED_KEY, *queue_lists(QUEUE))


@pytest.fixture
def clock(monkeypatch):
    """pending's clock, moved by hand."""
    now = [1_000_000.0]
    monkeypatch.setattr(pending.time, "time", lambda: now[0])
    return now


def message(task_id: str) -> str:
    """A message as kombu's Redis transport keeps it (what is read of it: its task id)."""
    return json.dumps({"body": "", "headers": {"id": task_id, "task": "inference.tasks.generate_routed"}})


def test_a_generation_no_queue_holds_is_lost_at_its_second_look(broker, clock):
    request_id = str(uuid.uuid4())
    pending.recorded(request_id, QUEUE, {"pending": True, "route_id": 7})
    assert pending.lost([QUEUE]) == []  # too young
    clock[0] += pending.LOST_AFTER_S
    assert pending.lost([QUEUE]) == []  # first look: suspected
    clock[0] += pending.RECHECK_S - 1
    assert pending.lost([QUEUE]) == []
    clock[0] += 1
    assert pending.lost([QUEUE]) == [(request_id, QUEUE, {"pending": True, "route_id": 7})]
    pending.requeued(request_id)
    assert pending.lost([QUEUE]) == []  # looked at afresh LOST_AFTER_S from now
    assert pending.started(request_id) is True and pending.started(request_id) is False
    clock[0] += pending.LOST_AFTER_S + pending.RECHECK_S
    assert pending.lost([QUEUE]) == [] and broker.zcard(pending.INDEX_KEY) == 0


@pytest.mark.parametrize("where", ["queue", "unacked"])
def test_a_generation_whose_message_waits_or_was_taken_is_not_lost(broker, clock, where):
    request_id = str(uuid.uuid4())
    pending.recorded(request_id, QUEUE, {"pending": True})
    if where == "queue":
        broker.lpush(QUEUE, message(request_id))
    else:  # taken by a worker that has not acknowledged it: kombu restores it if the worker dies
        broker.hset(pending.UNACKED_KEY, "tag-1", json.dumps([json.loads(message(request_id)), "", QUEUE]))
    for _ in range(3):
        clock[0] += pending.LOST_AFTER_S + pending.RECHECK_S
        assert pending.lost([QUEUE]) == []
    # Gone from there without starting (a worker killed as it took it): lost two looks later.
    broker.delete(QUEUE, pending.UNACKED_KEY)
    clock[0] += 1
    assert pending.lost([QUEUE]) == []
    clock[0] += pending.RECHECK_S
    assert [found[0] for found in pending.lost([QUEUE])] == [request_id]


def test_the_sweep_publishes_a_lost_generation_again_with_its_id(broker, clock):
    request_id = str(uuid.uuid4())
    pending.recorded(request_id, QUEUE, {"pending": True, "route_id": 7})
    clock[0] += pending.LOST_AFTER_S
    assert generations_lost_requeue() == 0
    clock[0] += pending.RECHECK_S
    assert generations_lost_requeue() == 1
    (raw,) = broker.lrange(QUEUE, 0, -1)
    assert pending._message_id(raw) == request_id  # the queue shows it: no third publish
    clock[0] += pending.LOST_AFTER_S + pending.RECHECK_S
    assert generations_lost_requeue() == 0


def test_a_delivery_that_starts_after_another_is_skipped(broker):
    request_id = str(uuid.uuid4())
    pending.recorded(request_id, QUEUE, {"pending": True})
    assert pending.started(request_id) is True  # the first delivery (found after all)
    # The message published again as lost, started second: skipped before any work.
    result = generate_routed.apply((request_id, {"pending": True})).get()
    assert result == {"skipped": "another delivery of this generation started first"}
