"""Token streams: one Redis Stream per generation request.

The worker appends events (``delta``, then ``stats`` or ``error``); readers follow with
XREAD from any position, so a reader that arrives late or reconnects (with the last id it
saw) loses nothing. Streams expire an hour after their last event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import redis
from django.conf import settings

STREAM_TTL_SECONDS = 3600
TERMINAL = ("stats", "error")


def stream_key(request_id: str) -> str:
    return f"gen:{request_id}"


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=30, socket_connect_timeout=5)


class StreamWriter:
    def __init__(self, request_id: str, client: redis.Redis | None = None):
        self.key = stream_key(request_id)
        self.client = client or _client()

    def history(self) -> tuple[int, str | None]:
        """How many events the stream holds and the type of the last one (None if empty)."""
        pipe = self.client.pipeline()
        pipe.xlen(self.key)
        pipe.xrevrange(self.key, count=1)
        length, last = pipe.execute()
        return length, (last[0][1][b"type"].decode() if last else None)

    def write(self, kind: str, /, **data) -> str:
        pipe = self.client.pipeline()
        pipe.xadd(self.key, {"type": kind, "data": json.dumps(data)})
        pipe.expire(self.key, STREAM_TTL_SECONDS)
        event_id, _ = pipe.execute()
        return event_id.decode() if isinstance(event_id, bytes) else event_id


def stream_read(request_id: str, *, after: str = "0", block_ms: int = 15000) -> Iterator[tuple[str, str, dict]]:
    """Yield ``(event_id, type, data)`` from ``after`` on until a ``stats`` or ``error`` event.

    Raises ``TimeoutError`` if nothing arrives for ``block_ms``.
    """
    client = _client()
    key = stream_key(request_id)
    last = after
    while True:
        response = client.xread({key: last}, count=100, block=block_ms)
        if not response:
            raise TimeoutError(f"no event on {key} for {block_ms} ms")
        for event_id, fields in response[0][1]:
            last = event_id.decode()
            kind = fields[b"type"].decode()
            yield last, kind, json.loads(fields[b"data"])
            if kind in TERMINAL:
                return
