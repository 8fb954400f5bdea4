"""Admission by queue depth and by the GPU pool's own queues: a new generation is refused
(``QueueFull``, ``PoolFull``: 503 with ``Retry-After``) rather than left to wait without bound.

``queue_slot``: at most ``GENERATION_QUEUE_MAX`` messages waiting in a generation queue, exactly,
across threads and web processes (a slot is reserved in one Lua script before the publish).
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


# KEYS[1]: the queue's reservation set (member: token, score: expiry in ms); KEYS[2..]: the
# queue's lists. ARGV: the bound, the reservation's time to live in ms, its token.
# Returns {admitted (0/1), messages in the lists, reservations in flight}.
_RESERVE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local waiting = 0
for i = 2, #KEYS do
  waiting = waiting + redis.call('LLEN', KEYS[i])
end
local reserved = redis.call('ZCARD', KEYS[1])
if waiting + reserved >= tonumber(ARGV[1]) then
  return {0, waiting, reserved}
end
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms + ttl, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, waiting, reserved}
"""


def reservations_key(queue: str) -> str:
    return f"backpressure:reserved:{queue}"


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
    limit = settings.GENERATION_QUEUE_MAX
    if limit <= 0 or _in_celery_task():
        return
    client = redis_client(Role.BROKER)
    with client.pipeline(transaction=False) as pipe:
        for name in queue_lists(queue):
            pipe.llen(name)
        # Reservations whose time is up are not counted (the script removes them on its next run).
        pipe.zcount(reservations_key(queue), f"({time.time() * 1000:.0f}", "+inf")
        counts = pipe.execute()
    waiting = sum(int(count) for count in counts)
    if waiting >= limit:
        raise QueueFull(queue, waiting, limit, float(settings.GENERATION_QUEUE_RETRY_AFTER_S))


@contextlib.contextmanager
def queue_slot(queue: str) -> Iterator[None]:
    """Hold a slot of ``queue`` while its message is published (``with queue_slot(q): publish``);
    ``QueueFull`` when the queue already holds ``GENERATION_QUEUE_MAX`` waiting messages."""
    limit = settings.GENERATION_QUEUE_MAX
    if limit <= 0 or _in_celery_task():
        yield
        return
    client = redis_client(Role.BROKER)
    token = uuid.uuid4().hex
    key = reservations_key(queue)
    admitted, waiting, reserved = _script(client)(
        keys=[key, *queue_lists(queue)], args=[limit, RESERVATION_TTL_S * 1000, token], client=client
    )
    if not admitted:
        raise QueueFull(queue, int(waiting) + int(reserved), limit, float(settings.GENERATION_QUEUE_RETRY_AFTER_S))
    try:
        yield
    finally:
        client.zrem(key, token)
