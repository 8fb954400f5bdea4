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

from inference.remote.call import (
    CHARS_PER_TOKEN,
    RemoteEndpoint,
    RemoteRequest,
    RemoteStats,
    estimate_prompt_tokens,
    validate,
)
from inference.remote.errors import KINDS, UpstreamError, retry_after_seconds
from inference.remote.protocol import speculative_report, stream_chat

__all__ = [
    "CHARS_PER_TOKEN",
    "KINDS",
    "RemoteEndpoint",
    "RemoteRequest",
    "RemoteStats",
    "UpstreamError",
    "estimate_prompt_tokens",
    "retry_after_seconds",
    "speculative_report",
    "stream_chat",
    "validate",
]
