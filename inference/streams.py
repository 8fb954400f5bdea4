"""Token streams: one Redis Stream per generation request.

The worker appends events (``delta``, then ``stats`` or ``error``); readers follow with
XREAD from any position, so a reader that arrives late or reconnects (with the last id it
saw) loses nothing. Streams expire an hour after their last event.

A routed generation (``inference.execution``) also writes ``retry`` events {attempt, kind,
status, retry_after_s, message, wait_s, route} when an attempt failed and another follows
(after ``wait_s`` seconds, on ``route``). A map-reduce answer writes ``progress`` {stage,
done, total} while its map requests run, before its generation. Readers skip kinds they do
not know; only ``stats`` and ``error`` end a stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import redis

from ragsite.redis import Role, redis_async_client, redis_client, resp_command

STREAM_TTL_SECONDS = 3600
TERMINAL = ("stats", "error")
# Events about the request rather than from its generation (readers show them as progress).
NOTICES = ("progress",)


def stream_key(request_id: str) -> str:
    return f"gen:{request_id}"


class StreamWriter:
    def __init__(self, request_id: str, client: redis.Redis | None = None):
        self.key = stream_key(request_id)
        self.client = client or redis_client(Role.STREAMS)
        self._expiry_set = False

    def history(self) -> tuple[int, str | None]:
        """How many generation events the stream holds and the type of the last one (None if
        none). ``progress`` notices (what a request does before its generation starts, e.g.
        the map requests of a map-reduce answer) are not the generation's: they do not count."""
        if not self.client.exists(self.key):  # the usual case: one round trip
            return 0, None
        kinds = [kind for _, kind, _ in stream_events(self.key, client=self.client) if kind not in NOTICES]
        return len(kinds), (kinds[-1] if kinds else None)

    def write(self, kind: str, /, **data) -> str:
        """Append one event. The expiry is (re)set by this writer's first event and by the
        terminal one, not by every delta: a generation ends long before an hour passes."""
        fields = {"type": kind, "data": json.dumps(data)}
        if self._expiry_set and kind not in TERMINAL:
            event_id = self.client.xadd(self.key, fields)
        else:
            pipe = self.client.pipeline(transaction=False)  # one round trip; XADD is atomic alone
            pipe.xadd(self.key, fields)
            pipe.expire(self.key, STREAM_TTL_SECONDS)
            event_id, _ = pipe.execute()
            self._expiry_set = True
        return event_id.decode() if isinstance(event_id, bytes) else event_id


class PipelinedStreamWriter(StreamWriter):
    """A writer that does not wait for each event's reply (Redis pipelining): each event is
    sent at once, in order, and readers see it as soon as Redis has it; the replies are
    read when a terminal event is written, on ``flush`` and on ``close``, where a failure
    surfaces. It holds one connection of the pool until ``close``; one thread at a time.
    ``write`` returns None (the event id is in a reply not read yet). What a routed
    generation streams with (``inference.execution``): a delta costs the send, not a round
    trip.

    ``end_with(command, ...)``: commands (in the Redis protocol, ``resp_command``) that go
    with the terminal event in one ``MULTI``/``EXEC``, all applied or none: the request's
    ledger row (``billing.ledger.outbox_command``)."""

    MAX_PENDING = 64

    def __init__(self, request_id: str, client: redis.Redis | None = None):
        super().__init__(request_id, client)
        self._key = self.key.encode()
        self._connection = None
        self._pending = 0
        self._with_terminal: list[bytes] = []

    def end_with(self, *commands: bytes) -> None:
        self._with_terminal.extend(commands)

    def write(self, kind: str, /, **data) -> None:
        payload = resp_command(b"XADD", self._key, b"*", b"type", kind.encode(), b"data", json.dumps(data).encode())
        commands = 1
        if not self._expiry_set or kind in TERMINAL:
            payload += resp_command(b"EXPIRE", self._key, b"%d" % STREAM_TTL_SECONDS)
            commands = 2
        if kind in TERMINAL and self._with_terminal:
            # MULTI answers OK, each command QUEUED, EXEC the list of their replies.
            payload = b"".join([resp_command(b"MULTI"), payload, *self._with_terminal, resp_command(b"EXEC")])
            commands += len(self._with_terminal) + 2
            self._with_terminal = []
        if self._connection is None:
            self._connection = self.client.connection_pool.get_connection()
        try:
            self._connection.send_packed_command([payload], check_health=False)
        except BaseException:
            self._drop()
            raise
        self._expiry_set = True
        self._pending += commands
        if kind in TERMINAL or self._pending >= self.MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        try:
            while self._pending:
                reply = self._connection.read_response()
                self._pending -= 1
                if isinstance(reply, list):  # EXEC's: an error inside is returned, not raised
                    for item in reply:
                        if isinstance(item, Exception):
                            raise item
        except BaseException:
            self._drop()
            raise

    def close(self) -> None:
        if self._connection is not None:
            try:
                self.flush()
            finally:
                if self._connection is not None:
                    self.client.connection_pool.release(self._connection)
                    self._connection = None

    def _drop(self) -> None:
        """After a failure the connection's replies are out of step: close it."""
        connection, self._connection, self._pending = self._connection, None, 0
        if connection is not None:
            connection.disconnect()
            self.client.connection_pool.release(connection)


def stream_events(request_id_or_key: str, *, client: redis.Redis | None = None) -> list[tuple[str, str, dict]]:
    """Every event the stream holds now, ``(event_id, type, data)``, without waiting."""
    key = request_id_or_key if request_id_or_key.startswith("gen:") else stream_key(request_id_or_key)
    return [
        (event_id.decode(), fields[b"type"].decode(), _data(fields[b"data"]))
        for event_id, fields in (client or redis_client(Role.STREAMS)).xrange(key)
    ]


def _data(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# One XREAD blocks at most this long: well under the client's 30 s socket timeout, so a
# long wait is several reads rather than a socket error.
_READ_SLICE_MS = 10_000


def stream_read(
    request_id: str, *, after: str = "0", block_ms: int = 15000, until: tuple[str, ...] = TERMINAL
) -> Iterator[tuple[str, str, dict]]:
    """Yield ``(event_id, type, data)`` from ``after`` on until an event of a type in ``until``
    (the generation's end: ``stats`` or ``error``; an answer's readers wait for more).

    Raises ``TimeoutError`` if nothing arrives for ``block_ms``.
    """
    client = redis_client(Role.STREAMS)
    key = stream_key(request_id)
    last = after
    while True:
        waited_ms = 0
        while True:
            slice_ms = max(1, min(_READ_SLICE_MS, block_ms - waited_ms))
            response = client.xread({key: last}, count=100, block=slice_ms)
            if response:
                break
            waited_ms += slice_ms
            if waited_ms >= block_ms:
                raise TimeoutError(f"no event on {key} for {block_ms} ms")
        for event_id, fields in response[0][1]:
            last = event_id.decode()
            kind = fields[b"type"].decode()
            yield last, kind, json.loads(fields[b"data"])
            if kind in until:
                return


# --------------------------------------------------------------------------- async readers
#
# For the web tier under ASGI (uvicorn): Django buffers a StreamingHttpResponse whose
# iterator is synchronous before sending any of it, so Server-Sent Events must come from
# an async iterator.


async def stream_aread(request_id: str, *, after: str = "0", block_ms: int = 15000, until: tuple[str, ...] = TERMINAL):
    """``stream_read`` for async code: ``(event_id, type, data)`` from ``after`` on until an
    event of a type in ``until``; ``TimeoutError`` if nothing arrives for ``block_ms``."""
    client = redis_async_client(Role.STREAMS)
    key = stream_key(request_id)
    last = after
    while True:
        waited_ms = 0
        while True:
            slice_ms = max(1, min(_READ_SLICE_MS, block_ms - waited_ms))
            response = await client.xread({key: last}, count=100, block=slice_ms)
            if response:
                break
            waited_ms += slice_ms
            if waited_ms >= block_ms:
                raise TimeoutError(f"no event on {key} for {block_ms} ms")
        for event_id, fields in response[0][1]:
            last = event_id.decode()
            kind = fields[b"type"].decode()
            yield last, kind, _data(fields[b"data"])
            if kind in until:
                return
