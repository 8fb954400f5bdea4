"""The Redis clients of every app: one factory, so that timeouts and pooling are decided once.

``redis_client``: the process's shared client (its connection pool is thread-safe; redis-py
resets it after a fork). ``redis_probe_client``: short timeouts, for readiness checks that must
answer quickly when Redis does not. ``redis_async_client``: one per event loop, for the ASGI
web tier's Server-Sent Events (redis.asyncio pools are bound to the loop that made them).
Pools open at most ``REDIS_MAX_CONNECTIONS`` each (redis-py's own default, 100, was the
ceiling of streams one process could hold).
"""

from __future__ import annotations

import asyncio
import weakref

import redis
import redis.asyncio
from django.conf import settings

_clients: dict[str, redis.Redis] = {}


def redis_client() -> redis.Redis:
    """One client (and connection pool) per process and URL: reconnecting per request would
    cost more than the writes."""
    client = _clients.get(settings.REDIS_URL)
    if client is None:
        client = redis.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=30,
            socket_connect_timeout=5,
            max_connections=settings.REDIS_MAX_CONNECTIONS,
        )
        client = _clients.setdefault(settings.REDIS_URL, client)
    return client


def redis_probe_client() -> redis.Redis:
    """A new client with 2-second timeouts: a probe that reports an outage instead of waiting on it."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def resp_command(*parts: bytes) -> bytes:
    """One command in the Redis protocol (RESP): an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out += (b"$%d\r\n" % len(part), part, b"\r\n")
    return b"".join(out)


# Held weakly by the loop itself: a closed loop's client goes with it, and a new loop never
# inherits one (the id() of a dead loop can be reused).
_async_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def redis_async_client() -> redis.asyncio.Redis:
    loop = asyncio.get_running_loop()
    clients = _async_clients.setdefault(loop, {})
    client = clients.get(settings.REDIS_URL)
    if client is None:
        client = redis.asyncio.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=30,
            socket_connect_timeout=5,
            max_connections=settings.REDIS_MAX_CONNECTIONS,
        )
        clients[settings.REDIS_URL] = client
    return client
