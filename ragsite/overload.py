"""A bound on the requests one web process serves at once: beyond it, 503 at once.

Under ASGI, Django runs each synchronous view (the REST API's DRF views, the UI) in a thread
of its own, with its own database connection, and nothing bounds how many: offered more than
it can serve, a web process takes every request, the threads share two cores, every
request slows down, clients time out and retry, and PostgreSQL runs out of connections.
``InFlightLimitMiddleware`` counts the requests inside the view stack and, while
``WEB_MAX_IN_FLIGHT`` are, answers the next one with 503 and ``Retry-After``
(``WEB_OVERLOAD_RETRY_AFTER_S``) before any other middleware runs: a refusal costs
microseconds and no thread, so the process keeps serving what it has taken at full speed
and clients learn at once that they should come back. 0 turns the bound off.

Not counted (always served):

- ``/healthz``, ``/readyz`` (and ``/metrics``): a saturated process is alive and, as far as its load
  balancer should know, ready; it must not be restarted for being busy;
- static files (``STATIC_URL``);
- streaming reads of an answer's events (``GET /api/v1/answers/<id>/stream``, the UI's
  ``GET /answers/<id>/events/``): they hold a connection for the length of a generation,
  but no thread (async views awaiting Redis), and refusing them would cut readers off
  answers already being paid for.

A chat completion is counted while it holds a thread: once its answer is started, the view
gives back its database connection (``connection_give_back``, in that thread) and its slot
(``slot_release``), and waits for the first token and streams holding neither (an async
view awaiting Redis). A model's first token can take seconds: counted until then, a few
dozen streams held open would refuse every new request.

The body is in Django's shape for the API: the OpenAI-compatible paths (``/v1/``) get
OpenAI's error shape with ``retry-after-ms`` too, the others ``{"error": {"code":
"overloaded", "message"}}``.

The count is per process (one event loop under ASGI; a lock makes it exact under WSGI's
threads too). Limit: when a client disconnects, Django cancels the request's task and the
slot is released, while a synchronous view's thread may still be finishing its work.
"""

from __future__ import annotations

import logging
import re
import threading
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import MiddlewareNotUsed
from django.db import connection
from django.http import JsonResponse

logger = logging.getLogger(__name__)

EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Streaming reads (GET only): an answer's Server-Sent Events, REST API and UI.
STREAMING_READS = re.compile(r"^/(?:api/v1/answers/[0-9a-fA-F-]+/stream|answers/[0-9a-fA-F-]+/events/)$")
# At most one warning per this many seconds while requests are being refused.
WARN_EVERY_S = 10.0


class _Slot:
    """A request's place in the count, given back once."""

    def __init__(self, leave):
        self._leave = leave
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._leave()


def slot_release(request) -> None:
    """The request holds no thread from here on (an async view awaiting Redis): it stops
    counting against ``WEB_MAX_IN_FLIGHT``. Safe to call twice, or without the middleware."""
    slot = getattr(request, "in_flight_slot", None)
    if slot is not None:
        slot.release()


def connection_give_back() -> None:
    """Return this thread's pooled database connection to the pool now rather than when the
    response ends (Django's ``request_finished``): a request that goes on streaming for
    seconds would hold it, and a few dozen streams would empty the pool. Nothing outside a
    pool (its persistent connection is this thread's to keep) or inside a transaction (a
    test's) is touched; the next query of the thread takes a connection again."""
    if connection.connection is not None and connection.pool is not None and not connection.in_atomic_block:
        connection.close()


class InFlightLimitMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.limit = settings.WEB_MAX_IN_FLIGHT
        if self.limit <= 0:
            raise MiddlewareNotUsed
        self.get_response = get_response
        self.retry_after_s = settings.WEB_OVERLOAD_RETRY_AFTER_S
        self.static_prefix = "/" + settings.STATIC_URL.lstrip("/") if settings.STATIC_URL else None
        self.in_flight = 0
        self.refused = 0
        self.warned_at = 0.0
        self.lock = threading.Lock()
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def exempt(self, request) -> bool:
        path = request.path_info
        if path in EXEMPT_PATHS or (self.static_prefix and path.startswith(self.static_prefix)):
            return True
        return request.method == "GET" and STREAMING_READS.match(path) is not None

    def _enter(self) -> bool:
        with self.lock:
            if self.in_flight >= self.limit:
                self.refused += 1
                return False
            self.in_flight += 1
            return True

    def _leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def _slot(self, request) -> _Slot:
        slot = _Slot(self._leave)
        request.in_flight_slot = slot
        return slot

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        if self.exempt(request):
            return self.get_response(request)
        if not self._enter():
            return self.refusal(request)
        slot = self._slot(request)
        try:
            return self.get_response(request)
        finally:
            slot.release()

    async def __acall__(self, request):
        if self.exempt(request):
            return await self.get_response(request)
        if not self._enter():
            return self.refusal(request)
        slot = self._slot(request)
        try:
            return await self.get_response(request)
        finally:
            slot.release()

    def refusal(self, request) -> JsonResponse:
        message = f"the server is at capacity ({self.limit} requests in progress); try again in {self.retry_after_s} s"
        if request.path_info.startswith("/v1/"):
            body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": "overloaded"}}
            headers = {"Retry-After": str(self.retry_after_s), "retry-after-ms": str(self.retry_after_s * 1000)}
        else:
            body = {"error": {"code": "overloaded", "message": message}}
            headers = {"Retry-After": str(self.retry_after_s)}
        response = JsonResponse(body, status=503, headers=headers)
        # An expected answer under load, not a server error: keep each one out of the error
        # log (Django logs every 5xx); one warning at most every WARN_EVERY_S says how many.
        response._has_been_logged = True
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY_S:
            self.warned_at = now
            logger.warning(
                "at capacity: %d requests in progress (WEB_MAX_IN_FLIGHT); %d refused with 503 so far",
                self.limit,
                self.refused,
            )
        return response
