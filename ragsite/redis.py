"""The Redis clients of every app: one factory, so that timeouts and pooling are decided once.

``redis_client``: the process's shared client (its connection pool is thread-safe; redis-py
resets it after a fork). ``redis_probe_client``: short timeouts, for readiness checks that must
answer quickly when Redis does not. ``redis_async_client``: one per event loop, for the ASGI
web tier's Server-Sent Events (redis.asyncio pools are bound to the loop that made them).
Pools open at most ``REDIS_MAX_CONNECTIONS`` each (redis-py's own default, 100, was the
ceiling of streams one process could hold).

Each client is for one ``Role``, whose Redis may be its own (``REDIS_<ROLE>_URL``, else
``REDIS_URL``): a deployment splits them by what each needs of its server (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import weakref
from enum import StrEnum
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from django.conf import settings


class Role(StrEnum):
    """What a Redis holds, and so what it needs of its server."""

    # Celery's queues and results, and what goes with them: the generation queues'
    # reservations (scripts over the queues' own lists), ingest bookkeeping, beat's heartbeat.
    # Persistent (AOF), one node or Sentinel: Celery cannot use Redis Cluster as a broker.
    BROKER = "broker"
    # Answers' token streams, read by the web tier as they are written (each expires an hour
    # after its last event), and the usage ledger's outbox, written in one MULTI with each
    # stream's last event so that no answer ends unbilled: persistent (AOF), one node.
    STREAMS = "streams"
    # Django's cache (query and sentence embeddings): an LRU server without persistence.
    CACHE = "cache"
    # Client keys' request rates and budgets (billing/limits.py): each script's keys share one
    # hash slot, so a Cluster serves them.
    LIMITS = "limits"


def redis_url(role: Role) -> str:
    return getattr(settings, f"REDIS_{role.upper()}_URL") or settings.REDIS_URL


def _connect(url: str, sentinel_type, plain_type, **options):
    """A client of ``url``; for ``sentinel://h1:p1;sentinel://h2:p2/db`` (kombu's form), one of
    the master the sentinels name (REDIS_SENTINEL_MASTER), found again after a failover."""
    if not url.startswith("sentinel:"):
        return plain_type.from_url(url, **options)
    parts = [urlsplit(part) for part in url.split(";")]
    database = int(parts[-1].path.strip("/") or 0)
    sentinels = sentinel_type([(part.hostname, part.port or 26379) for part in parts], socket_timeout=2)
    return sentinels.master_for(settings.REDIS_SENTINEL_MASTER, db=database, **options)


_clients: dict[str, redis.Redis] = {}


def redis_client(role: Role) -> redis.Redis:
    """One client (and connection pool) per process and URL: reconnecting per request would
    cost more than the writes."""
    url = redis_url(role)
    client = _clients.get(url)
    if client is None:
        client = _connect(
            url,
            redis.sentinel.Sentinel,
            redis.Redis,
            socket_timeout=30,
            socket_connect_timeout=5,
            max_connections=settings.REDIS_MAX_CONNECTIONS,
        )
        client = _clients.setdefault(url, client)
    return client


def redis_probe_client(role: Role) -> redis.Redis:
    """A new client with 2-second timeouts: a probe that reports an outage instead of waiting on it."""
    return _connect(redis_url(role), redis.sentinel.Sentinel, redis.Redis, socket_timeout=2, socket_connect_timeout=2)


def resp_command(*parts: bytes) -> bytes:
    """One command in the Redis protocol (RESP): an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out += (b"$%d\r\n" % len(part), part, b"\r\n")
    return b"".join(out)


# Held weakly by the loop itself: a closed loop's client goes with it, and a new loop never
# inherits one (the id() of a dead loop can be reused).
_async_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def redis_async_client(role: Role) -> redis.asyncio.Redis:
    url = redis_url(role)
    loop = asyncio.get_running_loop()
    clients = _async_clients.setdefault(loop, {})
    client = clients.get(url)
    if client is None:
        client = _connect(
            url,
            redis.asyncio.sentinel.Sentinel,
            redis.asyncio.Redis,
            socket_timeout=30,
            socket_connect_timeout=5,
            max_connections=settings.REDIS_MAX_CONNECTIONS,
        )
        clients[url] = client
    return client
