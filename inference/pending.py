"""Generations published and not yet started: each is kept (its queue and payload) from its
publish until a worker starts it, so that one whose message was lost is queued again within
seconds rather than failed an hour later (``search.answering.answers.answers_reap``).

kombu's Redis transport takes a message off its list (``BRPOP``) and records it as
unacknowledged (the ``unacked`` hash, from which a vanished worker's messages are restored) in
a second round trip: a worker killed between the two loses the message without a trace
(benchmarks.scale_out lost one answer so in each of three runs: docs/benchmarks.md,
"Scale-out"). ``lost`` finds the generations published ``LOST_AFTER_S`` ago or more that no
worker has started and whose message is in no queue list and not in ``unacked``, found so twice
``RECHECK_S`` apart (a live worker holds a message between its two round trips for
milliseconds); ``inference.tasks.generations_lost_requeue`` publishes them again with the same
task id. Whichever delivery starts first runs (``started``); a later one is skipped, so a
message found again after all does not run twice. Keys are the broker's, beside the queues.
"""

from __future__ import annotations

import json
import time

from ragsite.celery import queue_lists
from ragsite.redis import Role, redis_client

INDEX_KEY = "generations:pending"  # sorted set: request id -> when it was published (Unix s)
SUSPECT_KEY = "generations:pending:suspect"  # hash: request id -> when it was first found lost
UNACKED_KEY = "unacked"  # kombu's Redis transport: delivery tag -> [message, exchange, routing key]
LOST_AFTER_S = 20
RECHECK_S = 10
# A record nothing starts within a day is dropped, and a delivery that comes later is skipped as
# if another had started: its answer was failed by answers-reap 23 hours before.
KEEP_S = 24 * 3600
SWEEP_MAX = 1000


def _record_key(request_id: str) -> str:
    return f"generations:record:{request_id}"


def recorded(request_id: str, queue: str, payload: dict) -> None:
    """Keep the generation about to be published on ``queue`` until a worker starts it."""
    with redis_client(Role.BROKER).pipeline(transaction=True) as pipe:
        pipe.set(_record_key(request_id), json.dumps({"queue": queue, "payload": payload}), ex=KEEP_S)
        pipe.zadd(INDEX_KEY, {request_id: time.time()})
        pipe.execute()


def forget(request_id: str) -> None:
    """The publish failed: nothing to queue again."""
    with redis_client(Role.BROKER).pipeline(transaction=True) as pipe:
        pipe.delete(_record_key(request_id))
        pipe.zrem(INDEX_KEY, request_id)
        pipe.hdel(SUSPECT_KEY, request_id)
        pipe.execute()


def started(request_id: str) -> bool:
    """A delivery of the generation starts: True for the first (it removes the record), False
    for any later one."""
    with redis_client(Role.BROKER).pipeline(transaction=True) as pipe:
        pipe.delete(_record_key(request_id))
        pipe.zrem(INDEX_KEY, request_id)
        pipe.hdel(SUSPECT_KEY, request_id)
        deleted, _, _ = pipe.execute()
    return bool(deleted)


def _message_id(raw: bytes) -> str | None:
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    if isinstance(message, list):  # an unacked entry: [message, exchange, routing key]
        message = message[0] if message else {}
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers.get("id") if isinstance(headers, dict) else None


def _queued_ids(client, queues: list[str]) -> set[str]:
    """The task ids of the messages waiting in ``queues`` or taken and not acknowledged."""
    with client.pipeline(transaction=False) as pipe:
        for queue in queues:
            for name in queue_lists(queue):
                pipe.lrange(name, 0, -1)
        pipe.hvals(UNACKED_KEY)
        found = pipe.execute()
    return {message_id for raws in found for raw in raws if (message_id := _message_id(raw))}


def lost(queues: list[str]) -> list[tuple[str, str, dict]]:
    """The generations whose message was lost: ``(request id, queue, payload)`` of each (see
    the module's docstring). Each call is one look; a generation is lost at its second look."""
    client = redis_client(Role.BROKER)
    now = time.time()
    candidates = [
        member.decode() for member in client.zrangebyscore(INDEX_KEY, "-inf", now - LOST_AFTER_S, 0, SWEEP_MAX)
    ]
    if not candidates:
        return []
    queued = _queued_ids(client, queues)
    suspects = {key.decode(): float(value) for key, value in client.hgetall(SUSPECT_KEY).items()}
    found = []
    for request_id in candidates:
        if request_id in queued:
            if request_id in suspects:
                client.hdel(SUSPECT_KEY, request_id)
            continue
        record = client.get(_record_key(request_id))
        if record is None:  # started meanwhile, or past KEEP_S
            client.zrem(INDEX_KEY, request_id)
            client.hdel(SUSPECT_KEY, request_id)
            continue
        since = suspects.get(request_id)
        if since is None:
            client.hset(SUSPECT_KEY, request_id, now)
        elif now - since >= RECHECK_S:
            data = json.loads(record)
            found.append((request_id, data["queue"], data["payload"]))
    return found


def requeued(request_id: str) -> None:
    """Published again: looked at afresh ``LOST_AFTER_S`` from now."""
    with redis_client(Role.BROKER).pipeline(transaction=True) as pipe:
        pipe.zadd(INDEX_KEY, {request_id: time.time()})
        pipe.hdel(SUSPECT_KEY, request_id)
        pipe.execute()
