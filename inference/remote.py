"""Remote generation: one streamed chat completion from an OpenAI-compatible upstream.

The same contract as the local engine (``inference.engine.generate``): ``stream_chat``
yields text deltas, then one ``RemoteStats``. It makes exactly one attempt: the SDK's
own retries are off (``max_retries=0``) because the router that owns keys, retries,
failover and canaries sits on top of this module and needs every failure, classified.
No Django import: a script or a test can call it with nothing but the ``openai`` SDK.

Request
    ``POST {base_url}/chat/completions`` with ``stream=True``,
    ``stream_options={"include_usage": True}``, ``max_tokens``, ``temperature``, ``top_p``,
    ``stop`` and ``seed`` as given, and ``extra_body`` (fields the SDK does not know,
    sent as top-level JSON fields): the endpoint's ``extra_body``, then the route's
    speculative settings under ``speculative_config``, in vLLM's names:

    ==========================  ===========================================================
    ``speculative`` (local)     ``speculative_config`` sent
    ==========================  ===========================================================
    absent / ``None``           nothing added (an endpoint's own ``speculative_config``
                                in ``extra_body`` is sent as is)
    ``method: "off"``           nothing, and an endpoint's ``speculative_config`` is
                                removed: off means off
    ``method: "ngram"``         ``{"method": "ngram", "num_speculative_tokens": k,
                                "prompt_lookup_max": ngram_max, "prompt_lookup_min":
                                ngram_min}``
    ``method: "draft"``         ``{"method": "draft_model", "num_speculative_tokens": k,
                                "model": draft_model}`` (``draft_model`` required)
    ``method: "both"``          refused (``speculative.method``): vLLM has no
                                n-gram-then-draft proposer
    ==========================  ===========================================================

    ``k`` defaults to 4, ``ngram_max``/``ngram_min`` to 4/2 (the local engine's
    defaults); ``adaptive_k`` is accepted and not sent (no vLLM equivalent). Where keys
    collide, the route's settings override the endpoint's ``speculative_config``.
    Stock vLLM configures speculation per server (``--speculative-config``) and ignores
    unknown request fields, logging them; so the field is a declaration of what the route
    expects, honoured by servers or gateways that read it. A hosted API such as OpenAI's
    rejects unknown fields (400, ``bad_request``): routes to one must say ``off``.

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
    keep-alive comments, would keep it from ever firing). The SDK call runs on a helper
    thread that hands chunks over a queue, so the caller gives up on time even while a
    socket read is blocked. httpx's read timeout is set to ``first_token_timeout_s`` too:
    it ends a stream that stalls that long between two reads (``timeout``), and bounds
    how long an abandoned helper thread lives.

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

import math
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

import openai

from inference.engine.speculative import GenerationError

KINDS = ("rate_limited", "unauthorized", "bad_request", "server_error", "timeout", "connection", "broken_stream")
SPECULATIVE_METHODS = ("off", "draft", "ngram", "both")
SPECULATIVE_KEYS = {"method", "k", "draft_model", "ngram_max", "ngram_min", "adaptive_k"}
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
    speculative: dict | None = None


@dataclass
class RemoteStats:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    total_ms: float
    finish_reason: str
    usage_source: str  # "upstream" or "counted"
    model: str | None  # as the upstream reported it

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / (self.total_ms / 1000) if self.total_ms else 0.0

    def as_dict(self) -> dict:
        """The keys of ``GenerationStats.as_dict()`` that mean the same here, plus ``usage_source``
        and ``model``. The draft and pass counters are absent, not 0: the upstream does not
        report them per request, and 0 would claim that nothing was accepted."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "time_to_first_token_ms": round(self.time_to_first_token_ms, 2),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "total_ms": round(self.total_ms, 2),
            "finish_reason": self.finish_reason,
            "usage_source": self.usage_source,
            "model": self.model,
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

    spec = request.speculative or {}
    if not isinstance(spec, dict):
        raise GenerationError("speculative", f"must be an object, got {spec!r}")
    unknown = sorted(set(spec) - SPECULATIVE_KEYS)
    if unknown:
        raise GenerationError(f"speculative.{unknown[0]}", f"is not a setting ({', '.join(sorted(SPECULATIVE_KEYS))})")
    method = spec.get("method", "off")
    if method not in SPECULATIVE_METHODS:
        raise GenerationError("speculative.method", f"must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    if method == "both":
        raise GenerationError(
            "speculative.method", "'both' has no equivalent on a vLLM-style upstream; use 'ngram' or 'draft'"
        )
    k = _number(spec.get("k", 4), "speculative.k", int)
    if not 1 <= k <= 16:
        raise GenerationError("speculative.k", f"must be between 1 and 16, got {k}")
    if method == "draft" and not (isinstance(spec.get("draft_model"), str) and spec["draft_model"]):
        raise GenerationError("speculative.draft_model", "names the draft model the upstream serves; it is required")
    ngram_max = _number(spec.get("ngram_max", 4), "speculative.ngram_max", int)
    ngram_min = _number(spec.get("ngram_min", 2), "speculative.ngram_min", int)
    if not 1 <= ngram_min <= ngram_max:
        raise GenerationError(
            "speculative.ngram_min", f"must be between 1 and ngram_max ({ngram_max}), got {ngram_min}"
        )

    if _number(request.temperature, "temperature", float) < 0:
        raise GenerationError("temperature", f"must be >= 0, got {request.temperature}")
    if not 0 < _number(request.top_p, "top_p", float) <= 1:
        raise GenerationError("top_p", f"must be in (0, 1], got {request.top_p}")
    if _number(request.max_tokens, "max_tokens", int) < 1:
        raise GenerationError("max_tokens", f"must be at least 1, got {request.max_tokens}")
    if request.seed is not None:
        _number(request.seed, "seed", int)
    if isinstance(request.stop, str) or not all(isinstance(stop, str) and stop for stop in request.stop):
        raise GenerationError("stop", "must be a list of non-empty strings")
    if not isinstance(request.messages, list) or not request.messages:
        raise GenerationError("messages", "must be a non-empty list of {role, content} objects")
    for index, message in enumerate(request.messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise GenerationError(f"messages[{index}]", "must be an object with a role and a content")


def speculative_config(spec: dict | None) -> dict | None:
    """vLLM's ``speculative_config`` for the route's settings (table in the module docstring)."""
    spec = spec or {}
    method = spec.get("method", "off")
    k = spec.get("k", 4)
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": spec.get("ngram_max", 4),
            "prompt_lookup_min": spec.get("ngram_min", 2),
        }
    if method == "draft":
        return {"method": "draft_model", "num_speculative_tokens": k, "model": spec["draft_model"]}
    return None


def extra_body(endpoint: RemoteEndpoint, request: RemoteRequest) -> dict:
    body = dict(endpoint.extra_body or {})
    if request.speculative is None:
        return body
    config = speculative_config(request.speculative)
    if config is None:
        body.pop("speculative_config", None)
    else:
        body["speculative_config"] = {**(body.get("speculative_config") or {}), **config}
    return body


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


def _pump(endpoint: RemoteEndpoint, request: RemoteRequest, channel: queue.Queue, cancel: threading.Event) -> None:
    """Helper thread: run the SDK call and hand over ``("chunk"|"error"|"end", item, phase)``."""
    phase = "request"
    client = None
    try:
        client = openai.OpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key,
            max_retries=0,
            timeout=openai.Timeout(
                connect=endpoint.connect_timeout_s,
                read=endpoint.first_token_timeout_s,
                write=endpoint.first_token_timeout_s,
                pool=endpoint.connect_timeout_s,
            ),
        )
        optional = {}
        if request.stop:
            optional["stop"] = list(request.stop)
        if request.seed is not None:
            optional["seed"] = request.seed
        stream = client.chat.completions.create(
            model=endpoint.model,
            messages=request.messages,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body(endpoint, request) or None,
            **optional,
        )
        phase = "stream"
        with stream:
            for chunk in stream:
                if cancel.is_set():
                    return
                channel.put(("chunk", chunk, phase))
        channel.put(("end", None, phase))
    except Exception as exc:  # handed to the caller's thread, which classifies it
        channel.put(("error", exc, phase))
    finally:
        if client is not None:
            client.close()


def _stream(endpoint: RemoteEndpoint, request: RemoteRequest) -> Iterator[str | RemoteStats]:
    host = endpoint.host
    started = time.monotonic()
    first_deadline = started + min(endpoint.first_token_timeout_s, endpoint.total_timeout_s)
    total_deadline = started + endpoint.total_timeout_s
    channel: queue.Queue = queue.Queue()
    cancel = threading.Event()
    threading.Thread(
        target=_pump, args=(endpoint, request, channel, cancel), name=f"upstream-{host}", daemon=True
    ).start()

    tokens_sent = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    usage = None
    model: str | None = None
    try:
        while True:
            deadline = total_deadline if first_token_at is not None else first_deadline
            try:
                kind, item, phase = channel.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if first_token_at is None and deadline < total_deadline:
                    raise UpstreamError(
                        "timeout",
                        f"{host} sent no token within first_token_timeout_s={endpoint.first_token_timeout_s:g} s; "
                        "the upstream is overloaded or the prompt is too long for it: try another endpoint "
                        "or raise the timeout",
                        tokens_sent=tokens_sent,
                    ) from None
                raise UpstreamError(
                    "timeout",
                    f"{host} did not finish within total_timeout_s={endpoint.total_timeout_s:g} s "
                    f"({tokens_sent} tokens received); lower max_tokens or raise the timeout",
                    tokens_sent=tokens_sent,
                ) from None
            if kind == "error":
                raise _classify(item, phase, endpoint, tokens_sent)
            if kind == "end":
                break
            chunk = item
            model = chunk.model or model
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices or ():
                text = choice.delta.content if choice.delta is not None else None
                if text:
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                    tokens_sent += 1
                    yield text
                if choice.finish_reason:
                    finish_reason = choice.finish_reason
    finally:
        cancel.set()  # the helper thread stops at its next chunk and closes the connection

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
