"""The OpenAI protocol of a remote call: one streamed chat completion read chunk by chunk
into text deltas and a ``RemoteStats``, with the engine's speculative figures when it reports
them (docs/routing.md, "One attempt"). A generation that repeats itself
(``inference.remote.repetition``) is cut: the stream is closed, which makes the upstream abort
the request, and the call ends normally with finish_reason ``repetition`` and the tokens
received (docs/routing.md, "Generations that repeat themselves")."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai

from inference.remote import transport
from inference.remote.call import RemoteEndpoint, RemoteRequest, RemoteStats, estimate_prompt_tokens, validate
from inference.remote.errors import UpstreamError, classify
from inference.remote.repetition import Repetition, RepetitionGuard


def stream_chat(endpoint: RemoteEndpoint, request: RemoteRequest) -> Iterator[str | RemoteStats]:
    """Yield text deltas, then a ``RemoteStats``; raise ``UpstreamError`` on any failure. A
    generation found repeating itself ends early, as a success: ``finish_reason``
    "repetition", ``repetition`` where to cut the text, usage counted.

    Validation happens here, before the first ``next()``: a ``GenerationError`` is raised
    by this call itself and no request is made.
    """
    validate(endpoint, request)
    return _stream(endpoint, request)


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


def _body(endpoint: RemoteEndpoint, request: RemoteRequest) -> dict:
    """The request's JSON, the endpoint's ``extra_body`` merged in last (as the SDK's ``extra_body``)."""
    body = {
        "model": endpoint.model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.stop:
        body["stop"] = list(request.stop)
    if request.seed is not None:
        body["seed"] = request.seed
    return {**body, **(endpoint.extra_body or {})}


def _stream(endpoint: RemoteEndpoint, request: RemoteRequest) -> Iterator[str | RemoteStats]:
    host = endpoint.host
    started = time.monotonic()
    first_deadline = started + min(endpoint.first_token_timeout_s, endpoint.total_timeout_s)
    total_deadline = started + endpoint.total_timeout_s
    watch = transport.watchdog.watch(first_deadline)
    stream = None
    phase = "request"
    tokens_sent = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    usage = None
    model: str | None = None
    reported_metrics = None
    guard = RepetitionGuard() if endpoint.cut_repetitions else None
    repetition: Repetition | None = None

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
            client = transport.client_for(endpoint)
            transport.current.watch = watch
            try:
                stream = client.post(
                    "/chat/completions",
                    body=_body(endpoint, request),
                    # The chunks as parsed JSON: the SDK's SSE decoding, status and mid-stream
                    # errors, but no model object per chunk (most of the per-token cost).
                    cast_to=object,
                    stream=True,
                    stream_cls=openai.Stream[object],
                    options={
                        "timeout": openai.Timeout(
                            connect=endpoint.connect_timeout_s,
                            read=min(endpoint.first_token_timeout_s, endpoint.total_timeout_s),
                            write=endpoint.first_token_timeout_s,
                            pool=endpoint.connect_timeout_s,
                        )
                    },
                )
            finally:
                transport.current.watch = None
            phase = "stream"
            for chunk in stream:
                if watch.expired or time.monotonic() > watch.deadline:
                    raise deadline_error()
                if not isinstance(chunk, dict):
                    raise ValueError(f"a stream chunk is {type(chunk).__name__}, not a JSON object")
                model = chunk.get("model") or model
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                    # vLLM's per-request figures ride on the usage chunk, outside OpenAI's schema.
                    reported_metrics = chunk.get("metrics")
                choices = chunk.get("choices")
                for choice in choices if isinstance(choices, list) else ():
                    if not isinstance(choice, dict):
                        continue
                    delta = choice.get("delta")
                    text = delta.get("content") if isinstance(delta, dict) else None
                    if text and isinstance(text, str):
                        if first_token_at is None:
                            first_token_at = time.monotonic()
                            transport.watchdog.move(watch, total_deadline)
                        tokens_sent += 1
                        yield text
                        repetition = guard.feed(text) if guard is not None else None
                        if repetition is not None:
                            break
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
                        watch.drain = True  # a complete answer: keep the connection (transport._WatchedStream)
                if repetition is not None:
                    # The generation repeats itself: stop reading. Closing the response (below)
                    # closes the connection, not kept for reuse, and a server that sees its
                    # client go (vLLM, SGLang, hosted APIs) aborts the request: no more tokens
                    # are generated, nor billed.
                    watch.drain = False
                    break
        except UpstreamError:
            raise
        except Exception as exc:
            if watch.expired or (phase == "stream" and time.monotonic() > watch.deadline):
                raise deadline_error() from None
            raise classify(exc, phase, endpoint, tokens_sent) from None
    finally:
        if stream is not None:
            stream.close()  # after a failure, or a stream left early, the connection is closed, not reused
        transport.watchdog.finish(watch)

    finished = time.monotonic()
    if repetition is not None:
        # Cut here: the usage chunk will not come. Completion tokens are the deltas received
        # (what the upstream generated before it saw the close, less what was on the way).
        finish_reason, completion_tokens, source = "repetition", tokens_sent, "counted"
        prompt_tokens = _count((usage or {}).get("prompt_tokens")) or estimate_prompt_tokens(request.messages)
    elif finish_reason is None:
        raise UpstreamError(
            "broken_stream",
            f"the stream from {host} ended after {tokens_sent} tokens without a finish_reason; "
            "the completion is incomplete: retry it",
            tokens_sent=tokens_sent,
        )
    elif usage is not None and _count(usage.get("completion_tokens")) is not None:
        prompt_tokens, completion_tokens, source = (
            _count(usage.get("prompt_tokens")) or 0,
            usage["completion_tokens"],
            "upstream",
        )
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
        repetition=repetition.as_dict() if repetition is not None else None,
    )
