"""``/metrics``: what every process recorded (``ragsite.metrics``) and the gauges computed at
scrape time from PostgreSQL, Redis and the broker (docs/operations.md, "Metrics").

Each gauge family is one query (or one Redis round trip, or a broadcast ``inspect`` cached
``WORKERS_CACHE_S``); one that fails (database or Redis down) is left out of that scrape with a
warning, and the scrape still answers 200. ``/metrics`` needs ``Authorization: Bearer
<METRICS_TOKEN>`` whenever the token is set; with it unset it is open in development and a 404
in production, so it is never public by accident.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.http import Http404, HttpResponse
from kombu.exceptions import OperationalError as BrokerError

from inference import backpressure
from inference.models import CanaryRelease
from ragsite import metrics
from ragsite.celery import Queue, app, queue_lists

# Through ragsite.metrics, which imports prometheus_client only once the multiprocess folder is settled.
from ragsite.metrics import CounterMetricFamily, GaugeMetricFamily
from ragsite.redis import Role, redis_probe_client
from search.models import Document

logger = logging.getLogger(__name__)

# How long the workers per queue (a broadcast inspect) are reused between scrapes, and how
# long the broadcast waits for replies.
WORKERS_CACHE_S = 15.0
WORKERS_INSPECT_TIMEOUT_S = 0.5
_workers_cache: dict = {"at": None, "value": None}
_workers_lock = threading.Lock()


class ScrapeCollector:
    """The gauges computed at scrape time; each family is one query (or one Redis round trip)."""

    def describe(self):
        return []  # registering must not run the queries

    def collect(self):
        down: set[str] = set()
        for source, family in (
            ("db", self.documents),
            ("db", self.upstream_keys),
            ("db", self.canary),
            ("db", self.costs),
            ("db", self.budgets),
            ("redis", self.queue_lengths),
            ("broker", self.workers),
        ):
            if source in down:
                continue
            try:
                yield from list(family())
            except Exception as exc:
                logger.warning("metrics: %s skipped in this scrape (%s: %s)", family.__name__, type(exc).__name__, exc)
                if _is_outage(exc):
                    down.add(source)

    # ------------------------------------------------------------------ PostgreSQL

    @staticmethod
    def _rows(sql: str, params=None) -> list[tuple]:
        with connection.cursor() as cursor:
            cursor.execute(sql, params or [])
            return cursor.fetchall()

    def documents(self):
        family = GaugeMetricFamily("ragsite_documents", "Documents by status.", labels=["status"])
        counts = dict.fromkeys(Document.Status.values, 0)
        for status, count in self._rows("SELECT status, count(*) FROM search_document GROUP BY status"):
            counts[status] = count
        for status, count in sorted(counts.items()):
            family.add_metric([status], count)
        yield family

    def upstream_keys(self):
        family = GaugeMetricFamily(
            "ragsite_upstream_keys",
            "Upstream keys by provider and state (cooling_down only while its cooldown lasts).",
            labels=["provider", "state"],
        )
        rows = self._rows(
            """
            SELECT p.name,
                   CASE WHEN k.status = 'cooling_down' AND (k.cooldown_until IS NULL OR k.cooldown_until <= now())
                        THEN 'active' ELSE k.status END,
                   count(*)
            FROM inference_upstreamkey k JOIN inference_provider p ON p.id = k.provider_id
            GROUP BY 1, 2
            """
        )
        counts: dict[tuple[str, str], int] = {}
        for provider in {row[0] for row in rows}:
            for state in ("active", "cooling_down", "disabled"):
                counts[(provider, state)] = 0
        for provider, state, count in rows:
            counts[(provider, state)] = count
        for labels, count in sorted(counts.items()):
            family.add_metric(list(labels), count)
        yield family

    # Ended releases stay in the canary families this long after their last change.
    CANARY_ENDED_KEPT_DAYS = 30

    def canary(self):
        percent = GaugeMetricFamily(
            "ragsite_canary_percent", "Share of clients on the canary (live releases).", labels=["release", "route"]
        )
        state = GaugeMetricFamily(
            "ragsite_canary_state", "1 for a release's current state, 0 for the others.", labels=["release", "state"]
        )
        rollbacks = CounterMetricFamily(
            "ragsite_canary_rollbacks", "Rollbacks of each release (its canary events).", labels=["release"]
        )
        rows = self._rows(
            """
            SELECT r.id, r.name, r.state, r.percent, c.name,
                   (SELECT count(*) FROM inference_canaryevent e WHERE e.release_id = r.id AND e.action = 'rolled_back')
            FROM inference_canaryrelease r JOIN inference_route c ON c.id = r.canary_route_id
            WHERE r.state IN ('running', 'paused') OR r.updated_at > now() - make_interval(days => %s)
            ORDER BY r.id
            """,
            [self.CANARY_ENDED_KEPT_DAYS],
        )
        names = [row[1] for row in rows]
        for release_id, name, current, share, canary_route, rolled_back in rows:
            release = name if names.count(name) == 1 else f"{name}#{release_id}"
            if current in CanaryRelease.LIVE_STATES:
                percent.add_metric([release, canary_route], float(share))
            for value in CanaryRelease.State.values:
                state.add_metric([release, value], 1.0 if value == current else 0.0)
            rollbacks.add_metric([release], rolled_back)
        yield from (percent, state, rollbacks)

    def costs(self):
        family = GaugeMetricFamily(
            "ragsite_cost_usd", "Cost in USD by model, this month and the last (UTC).", labels=["model", "month"]
        )
        rows = self._rows(
            """
            SELECT model, to_char(day, 'YYYY-MM'), sum(cost_usd) FROM billing_usagedaily
            WHERE day >= (date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month')::date
            GROUP BY 1, 2 ORDER BY 1, 2
            """
        )
        for model, month, cost in rows:
            family.add_metric([model, month], float(cost))
        yield family

    def budgets(self):
        family = GaugeMetricFamily(
            "ragsite_client_key_budget_used_ratio",
            "This month's spend over the monthly budget of client keys that have one (key: its prefix).",
            labels=["key"],
        )
        rows = self._rows(
            """
            SELECT k.prefix, k.monthly_budget_usd, coalesce(sum(d.cost_usd), 0)
            FROM billing_clientkey k
            LEFT JOIN billing_usagedaily d ON d.client_key_id = k.id
                 AND d.day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
            WHERE k.monthly_budget_usd IS NOT NULL AND k.revoked_at IS NULL
            GROUP BY k.id ORDER BY k.prefix
            """
        )
        for prefix, budget, spent in rows:
            family.add_metric([prefix], float(spent) / float(budget) if budget else 0.0)
        yield family

    # ------------------------------------------------------------------ Redis and the workers

    def queue_lengths(self):
        # A setting, so it needs no Redis: the alert on queues near their bound divides by it.
        yield GaugeMetricFamily(
            "ragsite_generation_queue_max",
            "GENERATION_QUEUE_MAX: generations a gpu or remote queue may hold before new ones get 503 (0: no bound).",
            value=settings.GENERATION_QUEUE_MAX,
        )
        family = GaugeMetricFamily(
            "ragsite_celery_queue_length", "Messages waiting in each Celery queue (all priorities).", labels=["queue"]
        )
        pipe = redis_probe_client(Role.BROKER).pipeline(transaction=False)
        queues = [queue.value for queue in Queue]
        for queue in queues:
            for name in queue_lists(queue):
                pipe.llen(name)
        lengths = pipe.execute()
        steps = len(lengths) // len(queues)
        for index, queue in enumerate(queues):
            family.add_metric([queue], sum(lengths[index * steps : (index + 1) * steps]))
        yield family
        bound = GaugeMetricFamily(
            "ragsite_generation_queue_bound",
            "Generations a gpu or remote queue may hold now before new ones get 503: GENERATION_QUEUE_MAX, or "
            "what its workers start within GENERATION_QUEUE_MAX_WAIT_S at their rate (0: no bound).",
            labels=["queue"],
        )
        rate = GaugeMetricFamily(
            "ragsite_generation_queue_drain_rate",
            "Generations a second the workers of a gpu or remote queue took, over the last 10 s.",
            labels=["queue"],
        )
        generation = [Queue.GPU.value, Queue.REMOTE.value]
        for queue, (limit, taken) in backpressure.queue_bounds(generation, redis_probe_client(Role.BROKER)).items():
            bound.add_metric([queue], limit)
            rate.add_metric([queue], taken)
        yield bound
        yield rate

    def workers(self):
        family = GaugeMetricFamily(
            "ragsite_celery_workers", "Live workers consuming each queue (cached briefly).", labels=["queue"]
        )
        for queue, count in sorted(workers_per_queue().items()):
            family.add_metric([queue], count)
        yield family


def workers_per_queue() -> dict[str, int]:
    """Workers per queue from a broadcast ``active_queues``, reused for ``WORKERS_CACHE_S``
    (a failure too, so that scrapes during a broker outage stay cheap)."""
    with _workers_lock:
        at = _workers_cache["at"]
        if at is not None and time.monotonic() - at < WORKERS_CACHE_S:
            value = _workers_cache["value"]
            if isinstance(value, Exception):
                raise value
            return value
        try:
            replies = app.control.inspect(timeout=WORKERS_INSPECT_TIMEOUT_S).active_queues() or {}
            value = dict.fromkeys((queue.value for queue in Queue), 0)
            for queues in replies.values():
                for name in {queue.get("name") for queue in queues or []}:
                    if name in value:
                        value[name] += 1
        except Exception as exc:
            value = exc
        _workers_cache.update(at=time.monotonic(), value=value)
    if isinstance(value, Exception):
        raise value
    return value


def _is_outage(exc: Exception) -> bool:
    return isinstance(exc, OperationalError | InterfaceError | redis.ConnectionError | redis.TimeoutError | BrokerError)


def authorized(request) -> bool | None:
    """True: serve; False: 401 (a token is set and the request lacks it); None: 404."""
    token = settings.METRICS_TOKEN
    if not token:
        return None if settings.PRODUCTION else True
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def metrics_view(request):
    allowed = authorized(request)
    if allowed is None:
        raise Http404
    if not allowed:
        response = HttpResponse("a bearer token (METRICS_TOKEN) is required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405, headers={"Allow": "GET, HEAD"})
    response = HttpResponse(metrics.exposition(ScrapeCollector()), content_type=metrics.CONTENT_TYPE_LATEST)
    response["Cache-Control"] = "no-store"
    return response
