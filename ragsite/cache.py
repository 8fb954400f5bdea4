"""Django's Redis cache on the process's one client of the cache role (``ragsite.redis``).

Django keeps a cache object per thread, and its Redis backend a connection pool per object;
under ASGI each request's synchronous code runs on a thread of its own, so every request that
read the cache (a search's query embedding, the citation check's sentence vectors) built a
pool and opened a Redis connection: 7 % of the web process's samples were in ``connect`` at 128
concurrent answers (py-spy, docs/benchmarks.md "Load"). Here every thread shares one client and
its pool, as the other roles' clients are shared; a ``sentinel://`` URL works here too.
"""

from __future__ import annotations

from django.core.cache.backends.redis import RedisCache, RedisCacheClient

from ragsite.redis import Role, redis_client


class _SharedClient(RedisCacheClient):
    def get_client(self, key=None, *, write=False):
        return redis_client(Role.CACHE)


class SharedRedisCache(RedisCache):
    def __init__(self, server, params):
        super().__init__(server, params)
        self._class = _SharedClient
