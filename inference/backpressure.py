"""Admission by queue depth and by the GPU pool's own queues: a new generation is refused
(``QueueFull``, ``PoolFull``: 503 with ``Retry-After``) rather than left to wait without bound.

``queue_slot``: a bound on the messages waiting in a generation queue, exactly, across threads
and web processes (a slot is reserved in one Lua script before the publish): ``GENERATION_QUEUE_MAX``,
or more while the queue's workers, at the rate they took generations over the last
``DRAIN_WINDOW_S`` (``generation_taken``), drain them within ``GENERATION_QUEUE_MAX_WAIT_S``; a
refusal asks the client to come back once half of what waits has drained. ``queue_room``: the same
bound read before a request's retrieval.
``pool_admit``: a pool's reachable devices hold fewer than ``GPU_POOL_MAX_WAITING`` waiting
requests each. Both let submissions from inside a Celery task through (continuations of admitted
work). What is counted and why: docs/reliability.md, "How the queue bound is kept".
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Iterator

from django.conf import settings

from inference.errors import RouteUnavailable
from inference.pool import devices_load
from ragsite.celery import queue_lists
from ragsite.redis import Role, redis_client

# A reservation not released within this long (its process died before publishing) stops counting.
RESERVATION_TTL_S = 30
# A queue's drain rate: the generations its workers took in the last this many whole seconds.
DRAIN_WINDOW_S = 10
# The shortest wait a refusal asks for, whatever the queue's rate (a storm of retries costs too).
RETRY_AFTER_MIN_S = 0.5


class PoolFull(RouteUnavailable):
    """The pool's engines already hold their bound of waiting requests: 503 with ``Retry-After``."""

    def __init__(self, pool: str, waiting: int, limit: int, retry_after_s: float):
        super().__init__(
            f"the service is at capacity: {waiting} generations are waiting in pool {pool!r}'s engines (the limit "
            f"is {limit}); try again in {retry_after_s:g} s",
            retry_after_s=retry_after_s,
        )
        self.pool = pool
        self.waiting = waiting
        self.limit = limit


class QueueFull(RouteUnavailable):
    """The generation's queue already holds its bound of waiting messages: 503 with ``Retry-After``."""

    def __init__(self, queue: str, waiting: int, limit: int, retry_after_s: float):
        super().__init__(
            f"the service is at capacity: {waiting} generations are waiting on queue {queue!r} (the limit is "
            f"{limit}); try again in {retry_after_s:g} s",
            retry_after_s=retry_after_s,
        )
        self.queue = queue
        self.waiting = waiting
        self.limit = limit


# KEYS[1]: the queue's reservation set (member: token, score: expiry in ms); KEYS[2 .. 1 + ARGV[4]]:
# the queue's lists; the rest: its drain counters (``_taken_key``), one a second over the window.
# ARGV: GENERATION_QUEUE_MAX, the reservation's time to live in ms, its token, the number of lists,
# GENERATION_QUEUE_MAX_WAIT_S, the window in seconds.
# Returns {admitted (0/1), messages in the lists, reservations in flight, the bound, generations taken}.
_RESERVE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local lists = tonumber(ARGV[4])
local waiting = 0
for i = 2, 1 + lists do
  waiting = waiting + redis.call('LLEN', KEYS[i])
end
local taken = 0
for i = 2 + lists, #KEYS do
  taken = taken + (tonumber(redis.call('GET', KEYS[i])) or 0)
end
local limit = math.max(tonumber(ARGV[1]), math.floor(taken / tonumber(ARGV[6]) * tonumber(ARGV[5])))
local reserved = redis.call('ZCARD', KEYS[1])
if waiting + reserved >= limit then
  return {0, waiting, reserved, limit, taken}
end
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms + ttl, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, waiting, reserved, limit, taken}
"""


def reservations_key(queue: str) -> str:
    return f"backpressure:reserved:{queue}"


def _taken_key(queue: str, second: int) -> str:
    return f"backpressure:taken:{queue}:{second}"


def _window(queue: str) -> list[str]:
    """The drain counters of ``queue``'s last ``DRAIN_WINDOW_S`` whole seconds."""
    now = int(time.time())
    return [_taken_key(queue, second) for second in range(now - DRAIN_WINDOW_S, now)]


def generation_taken(queue: str) -> None:
    """Count a generation its worker has taken from ``queue``: how fast the queue drains (its
    bound in time, and the wait a refusal asks for). One counter a second, each kept briefly."""
    key = _taken_key(queue, int(time.time()))
    with redis_client(Role.BROKER).pipeline(transaction=False) as pipe:
        pipe.incr(key)
        pipe.expire(key, 2 * DRAIN_WINDOW_S + 1)
        pipe.execute()


def _bound(taken: int) -> int:
    """The queue's bound: ``GENERATION_QUEUE_MAX`` messages, or more while the workers' rate
    (``taken`` over the window) drains them within ``GENERATION_QUEUE_MAX_WAIT_S``."""
    return max(settings.GENERATION_QUEUE_MAX, int(taken / DRAIN_WINDOW_S * settings.GENERATION_QUEUE_MAX_WAIT_S))


def queue_bounds(queues: list[str], client) -> dict[str, tuple[int, float]]:
    """Each queue's bound now and its workers' rate (generations a second over the window), read
    in one round trip on ``client`` (the metrics' scrape: the alert on a queue near its bound)."""
    with client.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.mget(_window(queue))
        windows = pipe.execute()
    bounds = {}
    for queue, counts in zip(queues, windows, strict=True):
        taken = sum(int(count) for count in counts if count)
        bounds[queue] = (_bound(taken) if settings.GENERATION_QUEUE_MAX > 0 else 0, taken / DRAIN_WINDOW_S)
    return bounds


def _refusal(queue: str, waiting: int, limit: int, taken: int) -> QueueFull:
    """``QueueFull``, asking for the time the workers take to drain half of what waits at their
    measured rate, so that the queue still holds work when the refused clients come back (a fixed
    wait longer than the queue's work let it run dry while they waited: docs/scaling.md, "Past
    saturation"); ``GENERATION_QUEUE_RETRY_AFTER_S`` while no rate is known."""
    if taken:
        retry_after_s = round(min(60.0, max(RETRY_AFTER_MIN_S, waiting / (taken / DRAIN_WINDOW_S) / 2)), 3)
    else:
        retry_after_s = float(settings.GENERATION_QUEUE_RETRY_AFTER_S)
    return QueueFull(queue, waiting, limit, retry_after_s)


@functools.cache
def _script(client):
    return client.register_script(_RESERVE)


def _in_celery_task() -> bool:
    from celery import current_task

    return bool(current_task and current_task.request.id and not current_task.request.is_eager)


def pool_admit(provider) -> None:
    """Raise ``PoolFull`` when the GPU pool ``provider``'s reachable devices hold
    ``GPU_POOL_MAX_WAITING`` waiting requests each or more (see the module docstring)."""
    per_device = settings.GPU_POOL_MAX_WAITING
    if per_device <= 0 or _in_celery_task():
        return
    up = [load for load in devices_load(provider.devices) if load.up]
    waiting, limit = sum(load.waiting for load in up), per_device * len(up)
    if up and waiting >= limit:
        raise PoolFull(provider.name, waiting, limit, float(settings.GENERATION_QUEUE_RETRY_AFTER_S))


def queue_room(queue: str) -> None:
    """Raise ``QueueFull`` when ``queue`` already holds its bound of waiting messages and
    reservations: the check before a request's retrieval, so that a request the queue cannot
    take is refused before it costs a search (``queue_slot`` still decides, exactly, at the
    publish; a request this lets through may be refused there)."""
    if settings.GENERATION_QUEUE_MAX <= 0 or _in_celery_task():
        return
    client = redis_client(Role.BROKER)
    with client.pipeline(transaction=False) as pipe:
        for name in queue_lists(queue):
            pipe.llen(name)
        # Reservations whose time is up are not counted (the script removes them on its next run).
        pipe.zcount(reservations_key(queue), f"({time.time() * 1000:.0f}", "+inf")
        pipe.mget(_window(queue))
        *counts, taken = pipe.execute()
    waiting, taken = sum(int(count) for count in counts), sum(int(count) for count in taken if count)
    limit = _bound(taken)
    if waiting >= limit:
        raise _refusal(queue, waiting, limit, taken)


@contextlib.contextmanager
def queue_slot(queue: str) -> Iterator[None]:
    """Hold a slot of ``queue`` while its message is published (``with queue_slot(q): publish``);
    ``QueueFull`` when the queue already holds its bound of waiting messages (``_bound``)."""
    if settings.GENERATION_QUEUE_MAX <= 0 or _in_celery_task():
        yield
        return
    client = redis_client(Role.BROKER)
    token = uuid.uuid4().hex
    key = reservations_key(queue)
    lists = queue_lists(queue)
    admitted, waiting, reserved, limit, taken = _script(client)(
        keys=[key, *lists, *_window(queue)],
        args=[
            settings.GENERATION_QUEUE_MAX,
            RESERVATION_TTL_S * 1000,
            token,
            len(lists),
            settings.GENERATION_QUEUE_MAX_WAIT_S,
            DRAIN_WINDOW_S,
        ],
        client=client,
    )
    if not admitted:
        raise _refusal(queue, int(waiting) + int(reserved), int(limit), int(taken))
    try:
        yield
    finally:
        client.zrem(key, token)
