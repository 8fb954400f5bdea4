"""Django's cache on the process's one Redis client (ragsite/cache.py): Django keeps a cache
object per thread, and under ASGI each request runs on a thread of its own; with Django's own
backend each of them opened a Redis connection."""

from __future__ import annotations

import threading

from django.core.cache import cache

from ragsite.redis import Role, redis_client


def test_every_thread_reads_and_writes_the_cache_through_the_one_client():
    shared = redis_client(Role.CACHE)
    cache.set("cache-test:key", {"value": 1}, 60)
    pool = shared.connection_pool
    opened = pool._created_connections
    seen = []

    def request():  # what a request's thread does: a cache object of its own, the same client
        seen.append((cache.get("cache-test:key"), cache._cache.get_client(write=True) is shared))

    for _ in range(20):
        thread = threading.Thread(target=request)
        thread.start()
        thread.join()
    assert seen == [({"value": 1}, True)] * 20
    # Twenty requests one after another reuse the pool's connection: none opened for them.
    assert pool._created_connections == opened
    cache.delete("cache-test:key")
    assert cache.get("cache-test:key") is None
