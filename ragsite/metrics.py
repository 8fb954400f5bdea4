"""Prometheus metrics: every definition, the recorders the apps call, and the HTTP middleware.

Multiprocess mode. Web processes and Celery workers (and their pool processes) each write
their counters and histograms to files in ``PROMETHEUS_MULTIPROC_DIR``; a scrape of any web
process sums them all (``prometheus_client.multiprocess``). The variable must be set before
``prometheus_client`` is imported, in every process: ``manage.py up`` sets it for its
children (``var/prometheus``, emptied at start), docker-compose mounts one volume at the same
path in web and every worker, the tests set it in ``tests/embedded_services.py``. Unset (a
one-off ``manage.py`` command), metrics are kept in this process only, and still served.
Files are named after ``<host>-<pid>``, so containers sharing the volume never write one file.

Gauges are never kept in files: ``/metrics`` (``frontdoors.scrape``) computes them when scraped.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
from pathlib import Path

from celery.signals import worker_process_shutdown

logger = logging.getLogger(__name__)


def _multiprocess_dir() -> str | None:
    """The multiprocess folder, created if missing; None (in-process metrics) when it is
    unset or cannot be written (logged: better no shared metrics than a process that fails)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK | os.X_OK):
            return path
    except OSError:
        pass
    logger.warning("PROMETHEUS_MULTIPROC_DIR=%s is not writable: metrics are kept in this process only", path)
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    os.environ.pop("prometheus_multiproc_dir", None)
    return None


MULTIPROC_DIR = _multiprocess_dir()

# Imported only now: prometheus_client reads PROMETHEUS_MULTIPROC_DIR when it is imported.
# CONTENT_TYPE_LATEST and the metric families are re-exported for frontdoors.scrape, so that
# no module imports prometheus_client before this one.
from prometheus_client import (  # noqa: E402, F401
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402, F401

# No ``*_created`` series: multiprocess mode has none, and one process alone should look alike.
disable_created_metrics()

_HOST = socket.gethostname().replace("_", "-").replace("/", "-") or "host"


def process_identifier() -> str:
    """``<host>-<pid>``: processes of different containers on one volume may share a pid."""
    return f"{_HOST}-{os.getpid()}"


if MULTIPROC_DIR:
    values.ValueClass = values.MultiProcessValue(process_identifier=process_identifier)


# --------------------------------------------------------------------------- definitions

HTTP_REQUESTS = Counter(
    "ragsite_http_requests_total", "HTTP requests by URL pattern, method and status.", ["route", "method", "status"]
)
HTTP_DURATION = Histogram(
    "ragsite_http_request_duration_seconds",
    "Time until the response (its first byte for a stream), by URL pattern and method.",
    ["route", "method"],
)
SEARCH_DURATION = Histogram(
    "ragsite_search_duration_seconds",
    "search.selectors.chunk_search, by mode.",
    ["mode"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
QUERY_EMBEDDING_CACHE = Counter(
    "ragsite_query_embedding_cache", "Query embeddings from the Redis cache (hit) or the model (miss).", ["result"]
)
INGEST_DOCUMENTS = Counter(
    "ragsite_ingest_documents", "Documents whose ingestion ended, by outcome (indexed, failed).", ["status"]
)
INGEST_CHUNKS = Counter("ragsite_ingest_chunks", "Chunks written by ingestion.")
GENERATION_TTFT = Histogram(
    "ragsite_generation_time_to_first_token_seconds",
    "From a generation's first attempt to its first token (retries included), by route and arm.",
    ["route", "arm"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0),
)
GENERATION_DURATION = Histogram(
    "ragsite_generation_duration_seconds",
    "From a generation's first attempt to its end, by route and arm.",
    ["route", "arm"],
    buckets=(0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0),
)
GENERATION_TOKENS = Counter(
    "ragsite_generation_tokens", "Tokens of generations, by route, arm and kind (prompt, completion).",
    ["route", "arm", "kind"],
)  # fmt: skip
GENERATIONS = Counter(
    "ragsite_generations", "Generations ended, by route, arm and status (ok, error).", ["route", "arm", "status"]
)
GENERATIONS_CUT = Counter(
    "ragsite_generations_cut",
    "Generations the router ended early (their upstream request aborted), by model and reason (repetition).",
    ["model", "reason"],
)
ANSWERS_CHECKED = Counter(
    "ragsite_answers_checked",
    "Answers stored, by mode (generated, extractive) and outcome (grounded: every sentence supported; partly; "
    "ungrounded; abstained).",
    ["mode", "outcome"],
)
ANSWER_GROUNDED = Histogram(
    "ragsite_answer_grounded_share",
    "The share of an answer's sentences that a cited passage supports (search/answering/verification.py).",
    ["mode"],
    buckets=(0.0, 0.25, 0.5, 0.75, 0.99, 1.0),
)
# Speculative decoding, named as vLLM v1 names them so that its dashboards carry over.
SPEC_DRAFTS = Counter(
    "vllm:spec_decode_num_drafts",
    "Verification steps with a draft, as the engines reported them per request.",
    ["model_name"],
)
SPEC_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", ["model_name"])
SPEC_ACCEPTED_TOKENS = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", ["model_name"])
SPEC_ACCEPTED_PER_POS = Counter(
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Draft tokens accepted, by position in the proposal (0 first).",
    ["model_name", "position"],
)
ROUTER_RETRIES = Counter(
    "ragsite_router_retries", "Attempts after a failed one, by the route of the failed attempt.", ["route"]
)
ROUTER_FAILOVERS = Counter(
    "ragsite_router_failovers", "Moves to another route after a failed attempt, by the route left.", ["route"]
)

# Series that exist from the start, at 0, so that rates and dashboards see them before the first event.
for _status in ("indexed", "failed"):
    INGEST_DOCUMENTS.labels(_status)
for _result in ("hit", "miss"):
    QUERY_EMBEDDING_CACHE.labels(_result)

# --------------------------------------------------------------------------- recording


def _safely(record):
    """Recording a metric must never fail the work it measures."""

    def wrapper(*args, **kwargs):
        try:
            record(*args, **kwargs)
        except Exception:
            logger.warning("metric %s not recorded", record.__name__, exc_info=True)

    wrapper.__name__ = record.__name__
    wrapper.__doc__ = record.__doc__
    return wrapper


@_safely
def generation_observed(row: dict) -> None:
    """A generation ended, as its ledger row says (``inference.execution.ledger_row``)."""
    route, arm = row.get("route_name") or "", row.get("arm") or "none"
    GENERATIONS.labels(route, arm, row.get("status") or "error").inc()
    GENERATION_DURATION.labels(route, arm).observe(max(0.0, float(row.get("latency_ms") or 0.0)) / 1000)
    if row.get("ttft_ms") is not None:
        GENERATION_TTFT.labels(route, arm).observe(max(0.0, float(row["ttft_ms"])) / 1000)
    GENERATION_TOKENS.labels(route, arm, "prompt").inc(int(row.get("prompt_tokens") or 0))
    GENERATION_TOKENS.labels(route, arm, "completion").inc(int(row.get("completion_tokens") or 0))


@_safely
def generation_cut(model: str, reason: str) -> None:
    """A generation was ended early by the router: ``repetition``, it repeated itself
    (``inference.remote.repetition``)."""
    GENERATIONS_CUT.labels(model or "", reason).inc()


@_safely
def answer_checked(mode: str, grounded: float | None, abstained: bool) -> None:
    """An answer was stored with its citations checked: its grounded share, or that it abstained."""
    if abstained:
        outcome = "abstained"
    elif grounded is None:
        return  # nothing in it was a claim to check
    else:
        outcome = "grounded" if grounded >= 1.0 else "partly" if grounded > 0 else "ungrounded"
        ANSWER_GROUNDED.labels(mode).observe(grounded)
    ANSWERS_CHECKED.labels(mode, outcome).inc()


@_safely
def speculative_observed(model_name: str, report: dict) -> None:
    """One generation's speculative figures as its engine reported them
    (``inference.remote.speculative_report``). Accepted tokens by position come from the
    acceptance histogram: position p was accepted in every step that accepted more than p."""
    SPEC_DRAFT_TOKENS.labels(model_name).inc(report["draft_tokens_proposed"])
    SPEC_ACCEPTED_TOKENS.labels(model_name).inc(report["draft_tokens_accepted"])
    if report.get("spec_steps") is not None:
        SPEC_DRAFTS.labels(model_name).inc(report["spec_steps"])
    histogram = report.get("acceptance_histogram") or []
    for position in range(len(histogram) - 1):
        SPEC_ACCEPTED_PER_POS.labels(model_name, str(position)).inc(sum(histogram[position + 1 :]))


@_safely
def router_moved(from_route: str, *, failover: bool) -> None:
    """A new attempt after a failed one on ``from_route``; ``failover`` when on another route."""
    ROUTER_RETRIES.labels(from_route).inc()
    if failover:
        ROUTER_FAILOVERS.labels(from_route).inc()


@_safely
def ingest_ended(*, indexed: int = 0, failed: int = 0, chunks: int = 0) -> None:
    if indexed:
        INGEST_DOCUMENTS.labels("indexed").inc(indexed)
    if failed:
        INGEST_DOCUMENTS.labels("failed").inc(failed)
    if chunks:
        INGEST_CHUNKS.inc(chunks)


@_safely
def query_embedding_cache(hit: bool) -> None:
    QUERY_EMBEDDING_CACHE.labels("hit" if hit else "miss").inc()


def search_timed(search):
    """Decorator of ``search.selectors.chunk_search``: its duration by mode (searches that ran)."""
    import functools

    @functools.wraps(search)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = search(*args, **kwargs)
        try:
            SEARCH_DURATION.labels(result.mode).observe(time.perf_counter() - started)
        except Exception:
            logger.warning("search duration not recorded", exc_info=True)
        return result

    return timed


# --------------------------------------------------------------------------- HTTP middleware


class HttpMetricsMiddleware:
    """Counts and times every request by URL pattern (``resolver_match.route``, or
    ``unmatched``), never by raw path: one series per pattern whatever the ids in URLs.
    First in ``MIDDLEWARE``, so that refusals of the in-flight limit are counted too."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        from asgiref.sync import iscoroutinefunction, markcoroutinefunction

        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        started = time.perf_counter()
        response = self.get_response(request)
        self.observe(request, response, started)
        return response

    async def _acall(self, request):
        started = time.perf_counter()
        response = await self.get_response(request)
        self.observe(request, response, started)
        return response

    @staticmethod
    def observe(request, response, started: float) -> None:
        try:
            match = getattr(request, "resolver_match", None)
            route = (match.route or match.view_name or "unmatched") if match is not None else "unmatched"
            method = request.method if request.method in _METHODS else "other"
            HTTP_REQUESTS.labels(route, method, str(response.status_code)).inc()
            HTTP_DURATION.labels(route, method).observe(time.perf_counter() - started)
        except Exception:
            logger.warning("HTTP metrics not recorded", exc_info=True)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


# --------------------------------------------------------------------------- exposition


_DEFINED = (
    HTTP_REQUESTS, HTTP_DURATION, SEARCH_DURATION, QUERY_EMBEDDING_CACHE, INGEST_DOCUMENTS, INGEST_CHUNKS,
    GENERATION_TTFT, GENERATION_DURATION, GENERATION_TOKENS, GENERATIONS, GENERATIONS_CUT, SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_ACCEPTED_PER_POS, ROUTER_RETRIES, ROUTER_FAILOVERS,
)  # fmt: skip


class _AllProcesses:
    """Every process's counters and histograms from the multiprocess folder, and the HELP and
    TYPE of each family defined here that no process has recorded yet: the folder holds only
    what was recorded, and dashboards and alerts should find every name from the first scrape."""

    def __init__(self):
        self.files = multiprocess.MultiProcessCollector(None, MULTIPROC_DIR)

    def describe(self):
        return []

    def collect(self):
        seen = set()
        for family in self.files.collect():
            seen.add(family.name)
            yield family
        for metric in _DEFINED:
            for family in metric.describe():
                if family.name not in seen:
                    yield family


class _ThisProcess:
    """The metrics of this process alone (no multiprocess folder)."""

    def describe(self):
        return []

    def collect(self):
        yield from REGISTRY.collect()


def exposition(*collectors) -> bytes:
    """One scrape in Prometheus' text format: what the processes recorded (every process's in
    multiprocess mode, else this one's), then ``collectors``' families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_AllProcesses() if MULTIPROC_DIR else _ThisProcess())
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry)


# --------------------------------------------------------------------------- dead processes


def process_exited(pid: str | None = None) -> None:
    """Drop this process's live gauges from the folder (counters and histograms stay, so
    that totals never go down). Celery pool processes call it on exit (worker_process_shutdown);
    every other process at interpreter exit."""
    if MULTIPROC_DIR:
        try:
            multiprocess.mark_process_dead(pid or process_identifier(), MULTIPROC_DIR)
        except Exception:
            logger.warning("metrics: could not mark process %s dead", pid, exc_info=True)


if MULTIPROC_DIR:
    atexit.register(process_exited)


@worker_process_shutdown.connect
def _pool_process_exited(**_):
    """Celery pool processes skip interpreter exit handlers: their live gauges leave here."""
    process_exited()
