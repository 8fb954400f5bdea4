"""A backing service that is down (PostgreSQL, Redis) is an outage, not a bug: 503 with
``Retry-After``, in the shape of the door the request came through, and one warning line
instead of a traceback per request.

Django and the Redis client raise their own errors when a service cannot be reached
mid-request (``OperationalError``/``InterfaceError`` from the database, ``ConnectionError``/
``TimeoutError`` from Redis, kombu's ``OperationalError`` when a task cannot be published).
``outage_of`` names the service; the REST API (frontdoors/api/errors.py) and the OpenAI-compatible
API (frontdoors/openai_api/views.py) answer in their error shapes, and ``OutageMiddleware``
answers for every other view (the UI, the admin): a short page saying what is down. Once the
service is back, the next request reconnects (``CONN_HEALTH_CHECKS`` for the database, the
Redis client's own reconnect), with no process restarted.
"""

from __future__ import annotations

import logging

from django.db import InterfaceError as DatabaseInterfaceError
from django.db import OperationalError as DatabaseOperationalError
from django.http import HttpResponse
from django.utils.deprecation import MiddlewareMixin
from kombu.exceptions import OperationalError as BrokerOperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

# How long clients are asked to wait: a restart of either service takes seconds.
RETRY_AFTER_S = 5


def outage_of(exc: BaseException) -> str | None:
    """The service ``exc`` says is unreachable ("the database", "Redis"), else None."""
    if isinstance(exc, DatabaseOperationalError | DatabaseInterfaceError):
        return "the database"
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | BrokerOperationalError):
        return "Redis"
    return None


def outage_message(service: str) -> str:
    return f"{service[0].upper()}{service[1:]} is unavailable at the moment; try again in a few seconds."


def log_outage(service: str, request, exc: BaseException) -> None:
    logger.warning("%s %s: %s is unavailable (%s: %s)", request.method, request.path, service, type(exc).__name__, exc)


class OutageMiddleware(MiddlewareMixin):
    """503 for a view (outside the two APIs, which answer in their own shapes) that failed
    because the database or Redis is down.

    Sync and async capable (``MiddlewareMixin``): under ASGI a synchronous-only middleware
    makes Django run every request's inner chain through two thread hops."""

    def process_exception(self, request, exc):
        service = outage_of(exc)
        if service is None:
            return None
        log_outage(service, request, exc)
        response = HttpResponse(
            f"<!doctype html><title>Temporarily unavailable</title><h1>Temporarily unavailable</h1>"
            f"<p>{outage_message(service)}</p>",
            status=503,
            content_type="text/html; charset=utf-8",
        )
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
