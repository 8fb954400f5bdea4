"""A failed attempt, classified for the router: ``UpstreamError`` and its kinds (docs/routing.md,
"One attempt"), from the SDK's exceptions and the upstream's retry headers. Messages name
the upstream's host and never the API key."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import openai

from inference.remote.call import RemoteEndpoint

KINDS = ("rate_limited", "unauthorized", "bad_request", "server_error", "timeout", "connection", "broken_stream")


class UpstreamError(Exception):
    """One failed attempt at an upstream, classified for the router (docs/routing.md, "One attempt")."""

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


def classify(exc: BaseException, phase: str, endpoint: RemoteEndpoint, tokens_sent: int) -> BaseException:
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
