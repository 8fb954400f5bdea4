"""The HTTP side of a remote call: one connection pool per process with an SDK client per
(base URL, key) on it, and the deadline watchdog that ends a call whose first-token or total
deadline passes while its read is blocked (docs/routing.md, "One attempt")."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import httpx2
import openai

from inference.remote.call import RemoteEndpoint

# One HTTP connection pool per process, shared by every endpoint and key (httpx clients
# are thread-safe), and one SDK client per (base URL, key) on top of it: creating an SDK
# client builds an SSL context and costs ~25 ms, about ten times a short completion from a
# nearby server. Timeouts are per request. Rebuilt after a fork (a pool must not cross one).
CLIENT_CACHE_SIZE = 256
_clients_lock = threading.Lock()
_clients: OrderedDict[tuple[str, str], openai.OpenAI] = OrderedDict()
_http: dict = {"client": None, "pid": None}


def client_for(endpoint: RemoteEndpoint) -> openai.OpenAI:
    key = (endpoint.base_url, endpoint.api_key)
    with _clients_lock:
        if _http["pid"] != os.getpid() or _http["client"] is None or _http["client"].is_closed:
            _clients.clear()
            transport = _WatchedTransport(limits=openai.DEFAULT_CONNECTION_LIMITS)
            _http.update(client=openai.DefaultHttpxClient(transport=transport), pid=os.getpid())
        client = _clients.get(key)
        if client is None:
            # Evicted clients need no closing: the connections belong to the shared pool.
            client = openai.OpenAI(
                base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0, http_client=_http["client"]
            )
            _clients[key] = client
            if len(_clients) > CLIENT_CACHE_SIZE:
                _clients.popitem(last=False)
        else:
            _clients.move_to_end(key)
        return client


class _Watch:
    """One call's deadline, and the socket to shut down when it passes."""

    __slots__ = ("deadline", "done", "drain", "expired", "socket")

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.socket: socket.socket | None = None
        self.expired = False
        self.done = False
        self.drain = False  # read the rest of the body on close, to keep the connection


class _Watchdog:
    """One thread per process that ends calls past their deadline.

    A call reads its stream on the caller's thread (no hand-over per chunk). When its
    deadline passes while a read is blocked, the watchdog shuts the socket down, so the
    read returns at once and the call raises its ``timeout``. A response marks its watch
    done when it is closed, before the connection can go back to the pool, and the
    watchdog touches only sockets of watches not done (under one lock): a pooled
    connection that another call reuses is never shut down.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.heap: list[tuple[float, int, _Watch]] = []
        self.sequence = itertools.count()
        self.live = 0
        self.pid: int | None = None
        # When the thread wakes next on its own (inf: only when notified). A new deadline
        # after it needs no wake-up: the thread will find it then. Calls come far more often
        # than deadlines pass, so most add no thread switch to the call.
        self.wakes_at = math.inf

    def watch(self, deadline: float) -> _Watch:
        watch = _Watch(deadline)
        with self.lock:
            if self.pid != os.getpid():  # first use, or a forked child: the thread is ours to start
                self.pid, self.heap, self.live = os.getpid(), [], 0
                threading.Thread(target=self._run, name="upstream-deadlines", daemon=True).start()
            self.live += 1
            self._push(watch)
        return watch

    def move(self, watch: _Watch, deadline: float) -> None:
        with self.lock:
            if not watch.done:
                watch.deadline = deadline
                self._push(watch)

    def attach(self, watch: _Watch, sock: socket.socket | None) -> None:
        with self.lock:
            if watch.done:
                return
            watch.socket = sock
            if watch.expired:
                self._shut(watch)

    def finish(self, watch: _Watch) -> None:
        with self.lock:
            if watch.done:
                return
            watch.done, watch.socket = True, None
            self.live -= 1
            if len(self.heap) > 2 * self.live + 64:  # drop finished entries now and then
                self.heap = [entry for entry in self.heap if not entry[2].done]
                heapq.heapify(self.heap)

    def _push(self, watch: _Watch) -> None:
        heapq.heappush(self.heap, (watch.deadline, next(self.sequence), watch))
        if watch.deadline < self.wakes_at:
            self.wakes_at = watch.deadline
            self.wake.notify()

    @staticmethod
    def _shut(watch: _Watch) -> None:
        if watch.socket is not None:
            with contextlib.suppress(OSError):
                watch.socket.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        with self.lock:
            while True:
                while self.heap and (self.heap[0][2].done or self.heap[0][0] != self.heap[0][2].deadline):
                    heapq.heappop(self.heap)  # finished, or moved to a later deadline
                if not self.heap:
                    self.wakes_at = math.inf
                    self.wake.wait()
                    continue
                deadline, _, watch = self.heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self.wakes_at = deadline
                    self.wake.wait(left)
                    continue
                heapq.heappop(self.heap)
                watch.expired = True
                self._shut(watch)


watchdog = _Watchdog()
current = threading.local()  # the watch of the call this thread is making


def _after_fork_in_child() -> None:
    # Another thread may have held these locks at the fork: the child starts afresh.
    global _clients_lock, watchdog
    _clients_lock = threading.Lock()
    watchdog = _Watchdog()


os.register_at_fork(after_in_child=_after_fork_in_child)


# At most this much of a body is read after the SDK stopped at ``[DONE]`` (see _WatchedStream).
DRAIN_BYTES = 64 * 1024


class _WatchedStream(httpx2.SyncByteStream):
    """The response body, with the call's watch.

    The ``openai`` SDK stops reading a stream at ``data: [DONE]`` and closes the response,
    before the end of the chunked body that follows it: httpx then closes the connection
    instead of keeping it, and every streamed call pays a new TCP (and, to a hosted API, TLS)
    connection. When the call ended well (``watch.drain``), the rest of the body, normally
    the 5 bytes that end it, is read first (at most ``DRAIN_BYTES``, within the call's
    deadline: the watch still guards the read), and the connection goes back to the pool."""

    def __init__(self, stream: httpx2.SyncByteStream, watch: _Watch):
        self.stream = stream
        self.watch = watch
        self.chunks: Iterator[bytes] | None = None

    def __iter__(self) -> Iterator[bytes]:
        self.chunks = iter(self.stream)
        yield from self.chunks

    def close(self) -> None:
        try:
            if self.watch.drain and self.chunks is not None and not self.watch.expired:
                read = 0
                for chunk in self.chunks:
                    read += len(chunk)
                    if read > DRAIN_BYTES:
                        break
        except Exception:  # noqa: S110 (the connection is closed below instead of kept)
            pass
        finally:
            watchdog.finish(self.watch)  # before the connection is released
            self.stream.close()


class _WatchedTransport(httpx2.HTTPTransport):
    """Hands the response's socket to the call's watch (HTTP/1.1 responses expose it)."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        watch = getattr(current, "watch", None)
        if watch is not None:
            network = response.extensions.get("network_stream")
            response.stream = _WatchedStream(response.stream, watch)
            watchdog.attach(watch, network.get_extra_info("socket") if network is not None else None)
        return response
