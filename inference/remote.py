"""Remote generation: one streamed chat completion from an OpenAI-compatible upstream.

The same contract as the local engine (``inference.engine.generate``): ``stream_chat``
yields text deltas, then one ``RemoteStats``. It makes exactly one attempt: the SDK's
own retries are off (``max_retries=0``) because the router that owns keys, retries,
failover and canaries sits on top of this module and needs every failure, classified.
No Django import: a script or a test can call it with nothing but the ``openai`` SDK.

Request
    ``POST {base_url}/chat/completions`` with ``stream=True``,
    ``stream_options={"include_usage": True}``, ``max_tokens``, ``temperature``, ``top_p``,
    ``stop`` and ``seed`` as given, and the endpoint's ``extra_body`` (fields the SDK does
    not know, sent as top-level JSON fields). Nothing else: how an endpoint speculates is
    fixed when its server starts (vLLM has no per-request switch), so a route's speculative
    settings describe the endpoint and are never sent (a hosted API answers 400 to fields
    it does not know).

Speculative decoding, as the engine reports it
    vLLM started with ``--per-request-spec-decode-metrics summary`` (and
    ``inference.engine.server``) put ``metrics.speculative_decoding`` on the usage chunk:
    ``num_draft_tokens``, ``num_accepted_draft_tokens``, ``num_spec_steps``,
    ``num_spec_tokens``, ``mean_acceptance_length``, ``draft_acceptance_rate``,
    ``acceptance_histogram``. Upstream marks the field experimental, so it is read
    defensively (``speculative_report``): a missing, malformed or inconsistent report is
    ``None`` (nothing reported), never zeros.

Usage
    From the upstream's usage chunk when it sends one (``usage_source="upstream"``).
    Otherwise (``"counted"``): completion tokens are the content chunks that carried
    text, since vLLM, SGLang and OpenAI stream one token per chunk (a server that
    batches tokens per chunk is under-counted); prompt tokens are estimated as
    ``ceil(characters of the messages' text / 4)``, OpenAI's rule of thumb for English.

Timeouts
    ``connect_timeout_s`` bounds the TCP/TLS connect (httpx). ``first_token_timeout_s``
    runs from the start of the call to the first delta carrying text, and
    ``total_timeout_s`` to the end of the stream; both are enforced here, on a deadline,
    because httpx's read timeout restarts on every byte (a role-only first chunk, or SSE
    keep-alive comments, would keep it from ever firing). The stream is read on the
    caller's thread; one watchdog thread per process shuts the socket of a call down when
    its deadline passes, so a blocked read returns at once and the call raises its
    ``timeout`` (the deadline is also checked at every chunk). Until the response headers
    arrive, httpx's timeouts bound the wait: ``connect_timeout_s`` for the connection, and
    a read timeout of ``first_token_timeout_s`` (capped at ``total_timeout_s``), which also
    ends a stream that stalls that long between two reads (``timeout``).

Clients
    One HTTP connection pool per process serves every endpoint and key, and one SDK client
    per (base URL, key) sits on it, created once: an SDK client costs ~25 ms to create
    (an SSL context), ten times a short completion from a nearby server.

Errors
    ``UpstreamError.kind``: ``rate_limited`` (429), ``unauthorized`` (401, 403; 402 too:
    the key's account cannot pay), ``bad_request`` (other 4xx; not retryable),
    ``server_error`` (5xx), ``timeout`` (connect, first token, total, or a stall
    mid-stream), ``connection`` (no HTTP response), ``broken_stream`` (the stream ended
    without a ``finish_reason``, broke at the transport level, or carried an error event
    after the response began). ``tokens_sent`` counts the deltas already yielded, so a
    router knows whether a retry can be transparent. A clean end of stream after the
    ``finish_reason`` chunk but before ``[DONE]`` is accepted (the SDK consumes
    ``[DONE]`` itself); the completion is whole, only usage may be missing.
    Messages name the upstream's host and say what to do; the API key never appears in
    them (upstream error text is included with the key scrubbed out).
"""

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

import httpx2
import openai

from inference.engine.speculative import GenerationError, validate_sampling

KINDS = ("rate_limited", "unauthorized", "bad_request", "server_error", "timeout", "connection", "broken_stream")
# Characters per token for the prompt estimate when the upstream reports no usage.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class RemoteEndpoint:
    base_url: str  # e.g. https://api.example.com/v1
    api_key: str = field(repr=False)
    model: str
    connect_timeout_s: float = 5
    first_token_timeout_s: float = 30
    total_timeout_s: float = 300
    extra_body: dict | None = None

    @property
    def host(self) -> str:
        parts = urlsplit(self.base_url)
        return parts.netloc.rpartition("@")[2] or self.base_url


@dataclass(frozen=True)
class RemoteRequest:
    messages: list[dict]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class RemoteStats:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    total_ms: float
    finish_reason: str
    usage_source: str  # "upstream" or "counted"
    model: str | None  # as the upstream reported it
    speculative: dict | None = None  # speculative_report() of the engine's figures; None: none reported

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / (self.total_ms / 1000) if self.total_ms else 0.0

    def as_dict(self) -> dict:
        """The keys of ``GenerationStats.as_dict()`` that mean the same here, plus ``usage_source``,
        ``model`` and ``speculative`` (the engine's report, or None). The draft counters are
        there only when the engine reported them: 0 would claim that nothing was accepted."""
        drafts = {}
        if self.speculative is not None:
            drafts = {
                "draft_tokens_proposed": self.speculative["draft_tokens_proposed"],
                "draft_tokens_accepted": self.speculative["draft_tokens_accepted"],
            }
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "time_to_first_token_ms": round(self.time_to_first_token_ms, 2),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "total_ms": round(self.total_ms, 2),
            "finish_reason": self.finish_reason,
            "usage_source": self.usage_source,
            "model": self.model,
            **drafts,
            "speculative": self.speculative,
        }


class UpstreamError(Exception):
    """One failed attempt at an upstream, classified for the router (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        message: str,
        status: int | None = None,
        retry_after_s: float | None = None,
        tokens_sent: int = 0,
    ):
        if kind not in KINDS:
            raise ValueError(f"unknown upstream error kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s
        self.tokens_sent = tokens_sent

    @property
    def retryable(self) -> bool:
        """Whether another attempt at this request can succeed: with another key after
        ``unauthorized`` or ``rate_limited``, after a pause or elsewhere for the rest.
        ``bad_request`` fails the same way everywhere. After ``tokens_sent`` > 0 a retry
        restarts the completion: the caller must not show those tokens twice."""
        return self.kind != "bad_request"

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "status": self.status,
            "retry_after_s": self.retry_after_s,
            "tokens_sent": self.tokens_sent,
            "retryable": self.retryable,
            "message": self.message,
        }

    def __repr__(self) -> str:
        return f"UpstreamError({self.kind!r}, {self.message!r}, status={self.status!r})"


# --------------------------------------------------------------------------- validation


def _number(value, name: str, kind: type) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise GenerationError(name, f"must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    return value


def validate(endpoint: RemoteEndpoint, request: RemoteRequest) -> None:
    """Raise ``GenerationError`` naming the first field at fault; makes no network call."""
    parts = urlsplit(endpoint.base_url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GenerationError("base_url", "must be an http:// or https:// URL such as https://api.example.com/v1")
    if not isinstance(endpoint.api_key, str) or not endpoint.api_key:
        raise GenerationError("api_key", "is empty (a server without keys accepts any value, e.g. 'EMPTY')")
    if not isinstance(endpoint.model, str) or not endpoint.model:
        raise GenerationError("model", "is empty")
    for name in ("connect_timeout_s", "first_token_timeout_s", "total_timeout_s"):
        if _number(getattr(endpoint, name), name, float) <= 0:
            raise GenerationError(name, f"must be > 0, got {getattr(endpoint, name)}")
    if endpoint.extra_body is not None and not isinstance(endpoint.extra_body, dict):
        raise GenerationError("extra_body", "must be a JSON object")

    validate_sampling(
        temperature=_number(request.temperature, "temperature", float),
        top_p=_number(request.top_p, "top_p", float),
        max_tokens=_number(request.max_tokens, "max_tokens", int),
    )
    if request.seed is not None:
        _number(request.seed, "seed", int)
    if isinstance(request.stop, str) or not all(isinstance(stop, str) and stop for stop in request.stop):
        raise GenerationError("stop", "must be a list of non-empty strings")
    if not isinstance(request.messages, list) or not request.messages:
        raise GenerationError("messages", "must be a non-empty list of {role, content} objects")
    for index, message in enumerate(request.messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise GenerationError(f"messages[{index}]", "must be an object with a role and a content")


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def speculative_report(metrics) -> dict | None:
    """The engine's per-request speculative figures (``metrics.speculative_decoding`` of the
    usage chunk, vLLM's shape), or None when it reported none or nothing consistent:
    ``{draft_tokens_proposed, draft_tokens_accepted, draft_accepted (the rate, None with
    nothing proposed), spec_steps, spec_tokens (k), mean_acceptance_length,
    acceptance_histogram (index j: steps that accepted exactly j draft tokens)}``."""
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(spec, dict):
        return None
    proposed, accepted = _count(spec.get("num_draft_tokens")), _count(spec.get("num_accepted_draft_tokens"))
    steps, k = _count(spec.get("num_spec_steps")), _count(spec.get("num_spec_tokens"))
    if proposed is None or accepted is None or accepted > proposed:
        return None
    histogram = spec.get("acceptance_histogram")
    if not (isinstance(histogram, list) and histogram and all(_count(n) is not None for n in histogram)):
        histogram = None
    elif steps is not None and sum(histogram) != steps:
        histogram = None  # not the histogram of these steps
    mean = spec.get("mean_acceptance_length")
    mean = float(mean) if isinstance(mean, (int, float)) and not isinstance(mean, bool) and mean >= 0 else None
    return {
        "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": accepted,
        "draft_accepted": round(accepted / proposed, 4) if proposed else None,
        "spec_steps": steps,
        "spec_tokens": k,
        "mean_acceptance_length": round(mean, 4) if mean is not None else None,
        "acceptance_histogram": histogram,
    }


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: count the text ones
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def estimate_prompt_tokens(messages: list[dict]) -> int:
    return math.ceil(sum(len(_message_text(message)) for message in messages) / CHARS_PER_TOKEN)


# --------------------------------------------------------------------------- streaming


def stream_chat(endpoint: RemoteEndpoint, request: RemoteRequest) -> Iterator[str | RemoteStats]:
    """Yield text deltas, then a ``RemoteStats``; raise ``UpstreamError`` on any failure.

    Validation happens here, before the first ``next()``: a ``GenerationError`` is raised
    by this call itself and no request is made.
    """
    validate(endpoint, request)
    return _stream(endpoint, request)


# One HTTP connection pool per process, shared by every endpoint and key (httpx clients
# are thread-safe), and one SDK client per (base URL, key) on top of it: creating an SDK
# client builds an SSL context and costs ~25 ms, about ten times a short completion from a
# nearby server. Timeouts are per request. Rebuilt after a fork (a pool must not cross one).
CLIENT_CACHE_SIZE = 256
_clients_lock = threading.Lock()
_clients: OrderedDict[tuple[str, str], openai.OpenAI] = OrderedDict()
_http: dict = {"client": None, "pid": None}


def _client_for(endpoint: RemoteEndpoint) -> openai.OpenAI:
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


# --------------------------------------------------------------------------- deadlines


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


_watchdog = _Watchdog()
_current = threading.local()  # the watch of the call this thread is making


def _after_fork_in_child() -> None:
    # Another thread may have held these locks at the fork: the child starts afresh.
    global _clients_lock, _watchdog
    _clients_lock = threading.Lock()
    _watchdog = _Watchdog()


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
            _watchdog.finish(self.watch)  # before the connection is released
            self.stream.close()


class _WatchedTransport(httpx2.HTTPTransport):
    """Hands the response's socket to the call's watch (HTTP/1.1 responses expose it)."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        watch = getattr(_current, "watch", None)
        if watch is not None:
            network = response.extensions.get("network_stream")
            response.stream = _WatchedStream(response.stream, watch)
            _watchdog.attach(watch, network.get_extra_info("socket") if network is not None else None)
        return response


def _stream(endpoint: RemoteEndpoint, request: RemoteRequest) -> Iterator[str | RemoteStats]:
    host = endpoint.host
    started = time.monotonic()
    first_deadline = started + min(endpoint.first_token_timeout_s, endpoint.total_timeout_s)
    total_deadline = started + endpoint.total_timeout_s
    watch = _watchdog.watch(first_deadline)
    stream = None
    phase = "request"
    tokens_sent = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    usage = None
    model: str | None = None
    reported_metrics = None

    def deadline_error() -> UpstreamError:
        if first_token_at is None and first_deadline < total_deadline:
            return UpstreamError(
                "timeout",
                f"{host} sent no token within first_token_timeout_s={endpoint.first_token_timeout_s:g} s; "
                "the upstream is overloaded or the prompt is too long for it: try another endpoint "
                "or raise the timeout",
                tokens_sent=tokens_sent,
            )
        return UpstreamError(
            "timeout",
            f"{host} did not finish within total_timeout_s={endpoint.total_timeout_s:g} s "
            f"({tokens_sent} tokens received); lower max_tokens or raise the timeout",
            tokens_sent=tokens_sent,
        )

    try:
        try:
            client = _client_for(endpoint)
            optional = {}
            if request.stop:
                optional["stop"] = list(request.stop)
            if request.seed is not None:
                optional["seed"] = request.seed
            _current.watch = watch
            try:
                stream = client.chat.completions.create(
                    model=endpoint.model,
                    messages=request.messages,
                    max_tokens=request.max_tokens,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=endpoint.extra_body or None,
                    timeout=openai.Timeout(
                        connect=endpoint.connect_timeout_s,
                        read=min(endpoint.first_token_timeout_s, endpoint.total_timeout_s),
                        write=endpoint.first_token_timeout_s,
                        pool=endpoint.connect_timeout_s,
                    ),
                    **optional,
                )
            finally:
                _current.watch = None
            phase = "stream"
            for chunk in stream:
                if watch.expired or time.monotonic() > watch.deadline:
                    raise deadline_error()
                model = chunk.model or model
                if chunk.usage is not None:
                    usage = chunk.usage
                    # vLLM's per-request figures ride on the usage chunk, outside OpenAI's schema.
                    reported_metrics = (chunk.model_extra or {}).get("metrics")
                for choice in chunk.choices or ():
                    text = choice.delta.content if choice.delta is not None else None
                    if text:
                        if first_token_at is None:
                            first_token_at = time.monotonic()
                            _watchdog.move(watch, total_deadline)
                        tokens_sent += 1
                        yield text
                    if choice.finish_reason:
                        finish_reason = choice.finish_reason
                        watch.drain = True  # a complete answer: keep the connection (_WatchedStream)
        except UpstreamError:
            raise
        except Exception as exc:
            if watch.expired or (phase == "stream" and time.monotonic() > watch.deadline):
                raise deadline_error() from None
            raise _classify(exc, phase, endpoint, tokens_sent) from None
    finally:
        if stream is not None:
            stream.close()  # after a failure, or a stream left early, the connection is closed, not reused
        _watchdog.finish(watch)

    if finish_reason is None:
        raise UpstreamError(
            "broken_stream",
            f"the stream from {host} ended after {tokens_sent} tokens without a finish_reason; "
            "the completion is incomplete: retry it",
            tokens_sent=tokens_sent,
        )
    finished = time.monotonic()
    if usage is not None and usage.completion_tokens is not None:
        prompt_tokens, completion_tokens, source = usage.prompt_tokens or 0, usage.completion_tokens, "upstream"
    else:
        prompt_tokens, completion_tokens, source = estimate_prompt_tokens(request.messages), tokens_sent, "counted"
    yield RemoteStats(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        time_to_first_token_ms=(first_token_at - started) * 1000 if first_token_at is not None else 0.0,
        total_ms=(finished - started) * 1000,
        finish_reason=finish_reason,
        usage_source=source,
        model=model,
        speculative=speculative_report(reported_metrics),
    )


# --------------------------------------------------------------------------- errors


def retry_after_seconds(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """``retry-after-ms`` (OpenAI's, milliseconds), else ``Retry-After`` (seconds or an HTTP date)."""
    value = headers.get("retry-after-ms")
    if value:
        try:
            milliseconds = float(value)
        except ValueError:
            milliseconds = -1
        if milliseconds >= 0 and math.isfinite(milliseconds):
            return milliseconds / 1000
    value = headers.get("retry-after")
    if value:
        try:
            seconds = float(value)
            return seconds if seconds >= 0 and math.isfinite(seconds) else None
        except ValueError:
            pass
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return round(max(0.0, (when - (now or datetime.now(UTC))).total_seconds()), 3)
    return None


def _scrub(text: str, api_key: str) -> str:
    # Keys shorter than 6 characters ("EMPTY", "none") are placeholders, not secrets.
    if api_key and len(api_key) >= 6:
        text = text.replace(api_key, "***")
    return text


def _upstream_message(exc: openai.APIError, api_key: str) -> str:
    body = exc.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str) or not message:
        return ""
    message = " ".join(message.split())
    return ': "' + _scrub(message[:300], api_key) + '"'


def _classify(exc: BaseException, phase: str, endpoint: RemoteEndpoint, tokens_sent: int) -> BaseException:
    host = endpoint.host
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        said = _upstream_message(exc, endpoint.api_key)
        retry_after = retry_after_seconds(exc.response.headers)
        if status == 429:
            wait = f"retry after {retry_after:g} s" if retry_after is not None else "back off"
            message = f"{host} rate-limited this key (HTTP 429){said}; {wait} or use another key"
            return UpstreamError("rate_limited", message, status, retry_after, tokens_sent)
        if status in (401, 402, 403):
            reason = {401: "rejected the API key", 402: "refused payment for this key", 403: "denied this key access"}
            message = f"{host} {reason[status]} (HTTP {status}){said}; check or replace the key for this endpoint"
            return UpstreamError("unauthorized", message, status, retry_after, tokens_sent)
        if status == 408:
            message = f"{host} timed out reading the request (HTTP 408){said}; retry"
            return UpstreamError("timeout", message, status, retry_after, tokens_sent)
        if 400 <= status < 500:
            message = (
                f"{host} refused the request (HTTP {status}){said}; fix the request or the route's model "
                "and settings: retrying will not help"
            )
            return UpstreamError("bad_request", message, status, retry_after, tokens_sent)
        message = f"{host} failed (HTTP {status}){said}; retry later or on another endpoint"
        return UpstreamError("server_error", message, status, retry_after, tokens_sent)
    if isinstance(exc, openai.APITimeoutError):
        cause = type(exc.__cause__).__name__ if exc.__cause__ else "timeout"
        if cause == "ConnectTimeout":
            message = (
                f"could not connect to {host} within connect_timeout_s={endpoint.connect_timeout_s:g} s; "
                "check that the endpoint is up and reachable"
            )
        elif phase == "stream":
            message = (
                f"the stream from {host} stalled for {endpoint.first_token_timeout_s:g} s after {tokens_sent} "
                "tokens; retry, or try another endpoint"
            )
        else:
            message = (
                f"{host} did not answer within first_token_timeout_s={endpoint.first_token_timeout_s:g} s; "
                "the upstream is overloaded or down: try another endpoint or raise the timeout"
            )
        return UpstreamError("timeout", message, tokens_sent=tokens_sent)
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        detail = _scrub(f"{type(cause).__name__}: {cause}" if cause else str(exc), endpoint.api_key)
        if phase == "stream":
            message = (
                f"the connection to {host} broke mid-stream after {tokens_sent} tokens ({detail}); "
                "the completion is incomplete: retry it"
            )
            return UpstreamError("broken_stream", message, tokens_sent=tokens_sent)
        message = f"could not reach {host} ({detail}); check the base URL and that the server is up"
        return UpstreamError("connection", message, tokens_sent=tokens_sent)
    if isinstance(exc, openai.APIError):  # an error event inside a stream that had begun
        said = _upstream_message(exc, endpoint.api_key)
        message = f"{host} reported an error mid-stream after {tokens_sent} tokens{said}; retry the request"
        return UpstreamError("broken_stream", message, tokens_sent=tokens_sent)
    if isinstance(exc, ValueError) and phase == "stream":  # undecodable SSE data
        message = f"{host} sent malformed stream data after {tokens_sent} tokens ({type(exc).__name__}); retry"
        return UpstreamError("broken_stream", message, tokens_sent=tokens_sent)
    return exc  # a bug, not an upstream failure: let it surface as is
