"""Running one routed generation in a worker: keys, retries, failover, the stream, the ledger.

``run_routed`` is the body of ``inference.tasks.generate_routed``. Invariant: whatever happens,
the stream ``gen:<request_id>`` ends with ``stats`` or ``error``, and exactly one ledger row is
queued with that terminal event, atomically, by the process that ends the request, with the
tokens produced, so nothing is served unbilled (``billing.ledger`` stores it off the request's
path). Nothing is retried once tokens reached the stream. How attempts are chosen, capped,
handed over between queues and announced (``retry`` events): docs/routing.md, "Attempts,
retries and failover"; what the ledger row records: "The ledger row".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings
from tenacity import RetryCallState, wait_random_exponential

from billing import ledger
from billing.models import UsageRecord
from inference import keypool, observers, pool
from inference.models import Provider, Route
from inference.remote import (
    RemoteEndpoint,
    RemoteRequest,
    RemoteStats,
    UpstreamError,
    estimate_prompt_tokens,
    stream_chat,
    trim_repetition,
)
from inference.requests import GenerationError
from inference.secrets import SecretUnreadable
from inference.streams import TERMINAL, PipelinedStreamWriter, StreamWriter, stream_events
from ragsite import metrics
from ragsite.logs import current_request_id

logger = logging.getLogger(__name__)

# Failures of the endpoint rather than of the key or the request: retried after a backoff,
# on the next route first. "internal": a bug in this process during the attempt.
TRANSIENT = ("server_error", "timeout", "connection", "broken_stream", "internal")
# Not retried anywhere: the request itself is at fault.
FINAL = ("bad_request", "invalid_request")
# An attempt needs at least this much of the deadline left to start.
MIN_ATTEMPT_S = 0.05


@dataclass
class Failure:
    """One failed attempt (or why none could be made), for decisions and the error event."""

    kind: str
    message: str
    status: int | None = None
    retry_after_s: float | None = None
    tokens_sent: int = 0
    field: str | None = None

    @classmethod
    def of(cls, exc: UpstreamError) -> Failure:
        return cls(exc.kind, exc.message, exc.status, exc.retry_after_s, exc.tokens_sent)

    @property
    def retryable(self) -> bool:
        return self.kind not in FINAL and self.tokens_sent == 0

    def as_dict(self) -> dict:
        return {
            "field": self.field,
            "kind": self.kind,
            "status": self.status,
            "retry_after_s": self.retry_after_s,
            "tokens_sent": self.tokens_sent,
            "retryable": self.retryable,
            "message": self.message,
        }


class Stop(Exception):
    """The request ends with this failure."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


@dataclass
class Outcome:
    """What one routed generation did, for the stream's end, the ledger and the caller."""

    route: Route
    text: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    error: dict | None = None
    attempts: int = 0
    upstream_key_id: int | None = None
    started: float = field(default_factory=time.time)  # Unix time: it crosses processes
    first_token_at: float | None = None

    def result(self, request_id: str, payload: dict) -> dict:
        """What the generation did, for whoever waits for it (``payload["outcome_to"]``,
        ``to`` here; it travels in the ledger entry: ``billing.ledger``). ``text``: what to
        store. A generation cut for repeating itself streamed its loop (readers have seen
        it); its stored text keeps the loop's first copy only (``stats["repetition"]
        ["cut_at_char"]``; docs/routing.md, "Generations that repeat themselves")."""
        text = "".join(self.text)
        return {
            "request_id": request_id,
            "to": payload.get("outcome_to"),
            "status": "error" if self.error else "ok",
            "text": text if self.error else trim_repetition(text, self.stats),
            "stats": self.stats,
            "error": self.error,
            "route": self.route.name,
            "provider": self.route.provider.name,
            "arm": payload.get("arm") or "",
            "attempts": self.attempts,
        }


def _outbox_entry(request_id: str, payload: dict, outcome: Outcome) -> tuple[bytes, dict]:
    """The ledger row and, when someone waits for it, the outcome: one entry (``billing.ledger``)."""
    result = outcome.result(request_id, payload)
    row = ledger_row(request_id, payload, outcome)
    return ledger.outbox_command(row, result if result["to"] else None), row


@dataclass
class AttemptBudget:
    """Attempts and time a request may still spend; travels in a handover."""

    started: float
    deadline: float
    attempts: int = 0
    max_attempts: int = 5
    waits: int = 0

    @classmethod
    def start(cls, handover: dict | None) -> AttemptBudget:
        if handover:
            return cls(
                started=float(handover["started"]),
                deadline=float(handover["deadline"]),
                attempts=int(handover["attempts"]),
                max_attempts=int(handover["max_attempts"]),
                waits=int(handover.get("waits", 0)),
            )
        now = time.time()
        return cls(started=now, deadline=now + settings.ROUTER_DEADLINE_S, max_attempts=settings.ROUTER_MAX_ATTEMPTS)

    def left(self) -> float:
        return self.deadline - time.time()

    def backoff(self) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^(n-1))] for the n-th wait (tenacity)."""
        self.waits += 1
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})
        state.attempt_number = self.waits
        wait = wait_random_exponential(multiplier=settings.ROUTER_BACKOFF_BASE_S, max=settings.ROUTER_BACKOFF_MAX_S)
        return wait(state)


# --------------------------------------------------------------------------- attempts


class Routing:
    """One request's walk over keys and routes (see the module docstring)."""

    def __init__(
        self, request_id: str, payload: dict, writer: StreamWriter, route: Route, key: keypool.PickedKey | None = None
    ):
        self.request_id = request_id
        self.payload = payload
        self.writer = writer
        handover = payload.get("handover") or None
        self.budget = AttemptBudget.start(handover)
        self.events = int(handover["events"]) if handover else 0
        self.handover_chain = list(handover["chain"][1:]) if handover else None
        # A pool chosen for the request's speculative options (``router.provider_for_speculation``)
        # serves in place of the route's own provider; fallbacks must meet the options too.
        self.speculation = payload.get("speculative") or None
        replaced = bool(payload.get("provider_id")) and payload["provider_id"] != route.provider_id and not handover
        if replaced:
            route.provider = Provider.objects.get(id=payload["provider_id"])
        self.route = route
        self.queue = route.provider.queue
        self.outcome = Outcome(route=route, attempts=self.budget.attempts, started=self.budget.started)
        last = handover.get("last_error") if handover else None
        self.last: Failure | None = Failure(**last) if last else None
        self.pending: dict | None = None  # the retry event announcing the next attempt
        self.failed_on: set[str] = set()  # pool devices an attempt of this request could not reach or timed out on
        self._fallbacks: list[Route] | None = None
        # The route's first key, picked in the statement that loaded the route (for its own provider).
        prefetch = not route.provider.is_local and not replaced
        self._prefetched: tuple[keypool.PickedKey | None] | None = (key,) if prefetch else None
        self.attempted: Route | None = None  # the route of this process's last attempt (metrics)
        self.observing = observers.Observing(request_id, payload)

    # ------------------------------------------------------------------ the chain

    def fallbacks(self) -> list[Route]:
        if self._fallbacks is None:
            if self.handover_chain is not None:
                by_id = Route.objects.select_related("provider").in_bulk(self.handover_chain)
                routes = [by_id[i] for i in self.handover_chain if i in by_id]
            else:
                routes = self.route.fallback_routes()
            self._fallbacks = [
                r
                for r in routes
                if r.enabled
                and r.provider.enabled
                and r.id != self.route.id
                and (self.speculation is None or r.provider.speculation_mismatch(self.speculation) is None)
            ]
        return self._fallbacks

    def route_at(self, index: int) -> Route | None:
        """The chain: the route, then its fallbacks (loaded only when reached)."""
        if index == 0:
            return self.route
        fallbacks = self.fallbacks()
        return fallbacks[index - 1] if index <= len(fallbacks) else None

    def chain(self) -> list[Route]:
        return [self.route, *self.fallbacks()]

    # ------------------------------------------------------------------ the walk

    def run(self) -> dict:
        """Serve the request: raises ``Done`` or ``Stop``, or returns the handover
        ``{"queue", "payload"}`` when a route on another queue is next."""
        while True:
            transient = False
            index = 0
            while (route := self.route_at(index)) is not None:
                if route.provider.queue != self.queue:
                    return self.hand_over(self.chain()[index:])
                kinds = self.route_attempts(route)
                transient = transient or any(kind in TRANSIENT for kind in kinds)
                index += 1
            self.between_rounds(transient)

    def route_attempts(self, route: Route) -> list[str]:
        """Attempts on one route until one succeeds (``Done``), or the route has nothing more
        to try this round; returns the kinds of the failures."""
        kinds: list[str] = []
        if route.provider.is_local:
            self.attempt_ready(route)
            failure = self.attempt_pool(route)
            if failure is None:
                raise Done
            kinds.append(failure.kind)
            self.after_failure(failure)
            return kinds
        tried: set[int] = set()
        while True:
            key = self.next_key(route, tried)
            if key is None:
                return kinds
            tried.add(key.id)
            try:
                api_key = key.secret()
            except SecretUnreadable as exc:  # not a call: no attempt spent, the key set aside
                message = f"upstream key {key} of provider {route.provider.name} cannot be decrypted ({exc})"
                keypool.upstream_key_failed(
                    key.id, kind="unreadable", message=str(exc), provider_name=route.provider.name
                )
                logger.error("%s; disabled", message)
                self.last = Failure("unauthorized", message)
                continue
            self.attempt_ready(route)
            failure = self.attempt(route, base_url=route.provider.base_url, api_key=api_key, key_id=key.id)
            if failure is None:
                raise Done
            kinds.append(failure.kind)
            self.after_failure(failure)
            if failure.kind in TRANSIENT:
                return kinds  # the endpoint failed: the next route, not the next key

    def next_key(self, route: Route, tried: set[int]) -> keypool.PickedKey | None:
        if self._prefetched is not None and route is self.route and not tried:
            (key,), self._prefetched = self._prefetched, None
            return key
        return keypool.upstream_key_pick(route.provider_id, exclude=tried)

    def attempt_ready(self, route: Route) -> None:
        """Check the caps before an attempt; announce it when it is a retry."""
        if self.budget.attempts >= self.budget.max_attempts:
            raise Stop(self.final(f"gave up after {self.budget.attempts} attempts (ROUTER_MAX_ATTEMPTS)"))
        if self.budget.left() < MIN_ATTEMPT_S:
            raise Stop(self.final(self.deadline_reason()))
        self.flush_pending(route=route.name)

    def after_failure(self, failure: Failure) -> None:
        self.last = failure
        if not failure.retryable:
            reason = (
                "not retried: tokens had already reached the stream, and a restart would repeat them"
                if failure.tokens_sent
                else ""
            )
            raise Stop(self.final(reason))
        self.pending = {
            "attempt": self.budget.attempts,
            "kind": failure.kind,
            "status": failure.status,
            "retry_after_s": failure.retry_after_s,
            "message": failure.message,
        }

    def between_rounds(self, transient: bool) -> None:
        """Wait before the next round, or stop (see the module docstring)."""
        if transient:
            wait = self.budget.backoff()
        else:
            providers = [route.provider_id for route in self.chain() if not route.provider.is_local]
            available = keypool.availability(providers)
            if available.usable == 0:
                wait = available.retry_after_s
                if wait is None or wait > settings.ROUTER_BACKOFF_MAX_S or wait > self.budget.left() - MIN_ATTEMPT_S:
                    raise Stop(self.unavailable(available))
                wait += 0.01  # past the cooldown's end, not on it
                if self.pending is None:  # no failed attempt to announce: say what is awaited
                    self.pending = {
                        "attempt": self.budget.attempts,
                        "kind": "unavailable",
                        "status": None,
                        "retry_after_s": round(wait, 3),
                        "message": keypool.unavailable_message(self.route.name, available),
                    }
            else:  # a key came back between the pick and now: try again, after a short pause
                wait = self.budget.backoff()
        if self.budget.attempts >= self.budget.max_attempts:
            raise Stop(self.final(f"gave up after {self.budget.attempts} attempts (ROUTER_MAX_ATTEMPTS)"))
        if wait > self.budget.left() - MIN_ATTEMPT_S:
            raise Stop(self.final(self.deadline_reason()))
        self.flush_pending(route=self.route.name, wait_s=round(wait, 3))
        time.sleep(wait)

    def flush_pending(self, **fields) -> None:
        if self.pending is not None:
            self.write("retry", **{**self.pending, "wait_s": 0.0, **fields})
            self.pending = None

    # ------------------------------------------------------------------ endings

    def deadline_reason(self) -> str:
        return (
            f"the request's deadline (ROUTER_DEADLINE_S={settings.ROUTER_DEADLINE_S:g} s) is spent "
            f"after {self.budget.attempts} attempt{'s' if self.budget.attempts != 1 else ''}"
        )

    def final(self, reason: str) -> Failure:
        failure = self.last or Failure("timeout", "no attempt could be made")
        message = f"{failure.message} ({reason})" if reason else failure.message
        return Failure(failure.kind, message, failure.status, failure.retry_after_s, failure.tokens_sent, failure.field)

    def unavailable(self, available: keypool.Availability) -> Failure:
        message = keypool.unavailable_message(self.route.name, available)
        if self.last is not None:
            message += f"; the last attempt failed: {self.last.message}"
        retry_after = round(available.retry_after_s, 3) if available.retry_after_s is not None else None
        return Failure("unavailable", message, retry_after_s=retry_after)

    def hand_over(self, rest: list[Route]) -> dict:
        target = rest[0]
        self.flush_pending(route=target.name)
        if self.attempted is not None:  # the next attempt is the other queue's, on another route
            metrics.router_moved(self.attempted.name, failover=True)
        budget = self.budget
        handover = {
            "started": budget.started,
            "deadline": budget.deadline,
            "attempts": budget.attempts,
            "max_attempts": budget.max_attempts,
            "waits": budget.waits,
            "chain": [r.id for r in rest],
            "events": self.events,
            "last_error": None if self.last is None else vars(self.last),
        }
        return {
            "queue": target.provider.queue,
            "payload": {**self.payload, "route_id": target.id, "handover": handover},
        }

    # ------------------------------------------------------------------ one attempt

    def write(self, kind: str, /, **data) -> None:
        self.writer.write(kind, **data)
        self.events += 1

    def delta(self, text: str) -> None:
        if self.outcome.first_token_at is None:
            self.outcome.first_token_at = time.time()
        self.outcome.text.append(text)
        self.write("delta", text=text)
        for kind, data in self.observing.delta(text):
            self.write(kind, **data)

    def begin(self, route: Route, key_id: int | None) -> None:
        if self.attempted is not None:  # a retry, on another route: a failover
            metrics.router_moved(self.attempted.name, failover=self.attempted.id != route.id)
        self.attempted = route
        self.budget.attempts += 1
        self.outcome.attempts = self.budget.attempts
        self.outcome.route = route
        self.outcome.upstream_key_id = key_id

    def attempt_pool(self, route: Route) -> Failure | None:
        """One call to a device of the route's GPU pool: the one whose prefix cache most likely
        holds the prompt's beginning, within its share of the load (``pool.device_pick``); a
        device that cannot be reached is passed over by this process until its next load
        reading, and by this request's retries."""
        devices = route.provider.devices
        # One device has nothing to choose between: no key made on the way to the first token.
        affinity = pool.prefix_affinity(self.payload["messages"]) if len(devices) > 1 else ""
        with pool.device_use(devices, avoid=frozenset(self.failed_on), affinity=affinity) as device:
            failure = self.attempt(route, base_url=device, api_key=settings.GPU_POOL_API_KEY or "EMPTY", key_id=None)
        if failure is None:
            # Which of the pool's servers answered, as its place in the pool's list (the stats
            # reach API clients: not the server's internal URL).
            self.outcome.stats["device"] = devices.index(device)
        elif failure.kind == "connection":
            pool.device_failed(device, failure.message)
            self.failed_on.add(device)
        elif failure.kind == "timeout":
            # The attempt closed its connection before returning, which is how vLLM (and
            # SGLang) cancel a request: the retry never runs beside it. It also goes to
            # another device while the pool has one (docs/routing.md, "Retries").
            self.failed_on.add(device)
        return failure

    def attempt(self, route: Route, *, base_url: str, api_key: str, key_id: int | None) -> Failure | None:
        """One streamed chat completion from ``base_url``: deltas to the stream, the stats
        (with the engine's speculative figures) to the outcome; the failure, or None."""
        provider = route.provider
        self.begin(route, key_id)
        left = max(self.budget.left(), MIN_ATTEMPT_S)
        endpoint = RemoteEndpoint(
            base_url=base_url,
            api_key=api_key,
            model=provider.model,
            connect_timeout_s=min(provider.connect_timeout_s, left),
            first_token_timeout_s=min(provider.first_token_timeout_s, left),
            total_timeout_s=min(provider.total_timeout_s, left),
            extra_body=provider.extra_body or None,
            cut_repetitions=provider.cut_repetitions,
        )
        payload = self.payload
        request = RemoteRequest(
            messages=payload["messages"],
            max_tokens=int(payload["max_tokens"]),
            temperature=float(payload["temperature"]),
            top_p=float(payload["top_p"]),
            stop=tuple(payload.get("stop") or ()),
            seed=payload.get("seed"),
        )
        try:
            for piece in stream_chat(endpoint, request):
                if isinstance(piece, RemoteStats):
                    self.outcome.stats = piece.as_dict()
                    if piece.speculative is not None:
                        metrics.speculative_observed(provider.model, piece.speculative)
                    if piece.repetition is not None:  # cut, and ended as an answer: not retried
                        metrics.generation_cut(provider.model, "repetition")
                        logger.info(
                            "generation %s cut after %d tokens: it repeats itself (%s)",
                            self.request_id,
                            piece.completion_tokens,
                            piece.repetition,
                        )
                else:
                    self.delta(piece)
        except GenerationError as exc:
            return Failure("invalid_request", str(exc), field=exc.field)
        except UpstreamError as exc:
            if key_id is not None:
                keypool.upstream_key_failed(
                    key_id,
                    kind=exc.kind,
                    message=exc.message,
                    provider_name=provider.name,
                    status=exc.status,
                    retry_after_s=exc.retry_after_s,
                )
            return Failure.of(exc)
        return None


class Done(Exception):
    """An attempt succeeded."""


# --------------------------------------------------------------------------- the request


def run_routed(request_id: str, payload: dict) -> dict:
    """Serve one routed request: its stream, its ledger row; returns ``Outcome.result``.

    Returns ``{"request_id", "status": "handed_over", "queue", "payload"}`` instead when the
    request must go on on another queue; the caller sends it there (``generate_routed`` with
    that payload), and nothing is written to the ledger here.
    """
    writer = PipelinedStreamWriter(request_id)
    try:
        return _run(request_id, payload, writer)
    finally:
        writer.close()  # every event is in Redis before the task ends or hands over


def _run(request_id: str, payload: dict, writer: PipelinedStreamWriter) -> dict:
    route, key = keypool.route_with_key(payload["route_id"])
    routing = Routing(request_id, payload, writer, route, key)
    outcome = routing.outcome
    try:
        handover = routing.run()
        writer.flush()
        return {"request_id": request_id, "status": "handed_over", **handover}
    except Done:  # answered: the stats event below ends the stream
        pass
    except Stop as stop:
        outcome.error = {**stop.failure.as_dict(), "attempts": outcome.attempts}
    except Exception as exc:  # a bug fails this request only
        logger.exception("routed generation %s failed", request_id)
        outcome.error = {
            "field": None,
            "kind": "internal",
            "status": None,
            "retry_after_s": None,
            "tokens_sent": len(outcome.text),
            "retryable": False,
            "message": f"generation failed: {type(exc).__name__}",
            "attempts": outcome.attempts,
        }
    if not outcome.error:
        # What the observer found travels with the outcome; its last events precede the end.
        events, observed = routing.observing.end()
        for kind, data in events:
            routing.write(kind, **data)
        if observed is not None:
            outcome.stats[observers.OBSERVED] = observed
    # The ledger row and the outcome go with the terminal event, atomically (billing.ledger).
    entry, row = _outbox_entry(request_id, payload, outcome)
    writer.end_with(entry)
    if outcome.error:
        routing.write("error", **outcome.error)
    else:
        # What the observer found is for whoever stores the outcome, not for the stream's readers
        # (it names what the check withheld).
        shown = {key: value for key, value in outcome.stats.items() if key != observers.OBSERVED}
        routing.write("stats", **{**shown, "attempts": outcome.attempts})
    metrics.generation_observed(row)
    return outcome.result(request_id, payload)


def ledger_row(request_id: str, payload: dict, outcome: Outcome) -> dict:
    """The request's ledger row (``UsageRecord`` columns, JSON values), as it ends now.

    ``upstream_key`` is the key of the last attempt; with status ``ok`` that key served the
    answer, and storing the row counts the success on it (``billing.ledger``)."""
    route, stats = outcome.route, outcome.stats
    completion_tokens = len(outcome.text) if outcome.error else stats.get("completion_tokens", len(outcome.text))
    now = time.time()
    ttft = (outcome.first_token_at - outcome.started) * 1000 if outcome.first_token_at is not None else None
    prompt_tokens = stats.get("prompt_tokens", 0)
    if outcome.error and not stats and completion_tokens:
        # Failed mid-stream: the upstream read the prompt; estimated as remote.py does.
        prompt_tokens = estimate_prompt_tokens(payload.get("messages") or [])
    return {
        "request_id": request_id,
        # The web request's X-Request-ID (ragsite/logs.py): from the payload (a dead worker's parent
        # runs no task of this request), else current in the task that runs this.
        "trace_id": payload.get("trace_id") or current_request_id() or "",
        "created_at": datetime.fromtimestamp(now, tz=UTC).isoformat(),
        "kind": UsageRecord.Kind.GENERATION.value,
        "workspace_id": payload.get("workspace_id"),
        "user_id": payload.get("user_id"),
        "client_key_id": payload.get("client_key_id"),
        "route_id": route.id,
        "route_name": route.name,
        "release_id": payload.get("release_id"),
        "arm": payload.get("arm") or "",
        "provider_id": route.provider.id,
        "provider_name": route.provider.name,
        "model": route.provider.model,
        "upstream_key_id": outcome.upstream_key_id,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "draft_tokens_proposed": stats.get("draft_tokens_proposed", 0),
        "draft_tokens_accepted": stats.get("draft_tokens_accepted", 0),
        "usage_source": stats.get("usage_source", "counted" if outcome.error else ""),
        "attempts": outcome.attempts,
        "latency_ms": max(0.0, (now - outcome.started) * 1000),
        "ttft_ms": max(0.0, ttft) if ttft is not None else None,
        "status": (UsageRecord.Status.ERROR if outcome.error else UsageRecord.Status.OK).value,
        "error_class": (outcome.error or {}).get("kind") or "",
        "cost_usd": None,  # priced when stored (billing.ledger)
        "price_id": None,
        # Not a column: the client key's admission, settled when the row is stored (billing.limits).
        "admission": payload.get("admission"),
    }


def lost_generation_end(request_id: str, payload: dict, reason: str) -> bool:
    """End the stream and queue the ledger row and outcome of a request whose pool process
    died (run by the worker's parent): a terminal ``error`` of kind ``worker_lost``, a row with
    status error and the tokens the stream holds, and the outcome (that text, that error) for
    whoever waits, in one ``MULTI``/``EXEC``. False when the stream had already ended: the
    process died after its terminal event, whose row and outcome went with it."""
    writer = PipelinedStreamWriter(request_id)
    try:
        if writer.history()[1] in TERMINAL:
            return False
        route = Route.objects.select_related("provider").get(id=payload["route_id"])
        texts = [data.get("text", "") for _, kind, data in stream_events(request_id) if kind == "delta"]
        handover = payload.get("handover") or {}
        error = {"field": None, "kind": "worker_lost", "message": f"{reason}; the request was not retried"}
        outcome = Outcome(
            route=route,
            text=texts,
            error=error,
            attempts=max(1, int(handover.get("attempts") or 0)),
            started=float(handover.get("started") or time.time()),
        )
        entry, row = _outbox_entry(request_id, payload, outcome)
        writer.end_with(entry)
        writer.write("error", **error)
        metrics.generation_observed(row)
        return True
    finally:
        writer.close()
