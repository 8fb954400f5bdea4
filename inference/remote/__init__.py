"""One attempt at an OpenAI-compatible server: a streamed chat completion that yields text
deltas, then one ``RemoteStats``, or raises a classified ``UpstreamError``. Exactly one call
(the SDK's retries are off: the router above owns retries). A generation that repeats
itself is cut, and ends as a success (``repetition.py``). No Django import.

The request, usage, timeouts, clients and error kinds: docs/routing.md, "One attempt".
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
from inference.remote.repetition import THRESHOLDS, Repetition, RepetitionGuard, trim_repetition

__all__ = [
    "CHARS_PER_TOKEN",
    "KINDS",
    "THRESHOLDS",
    "RemoteEndpoint",
    "RemoteRequest",
    "RemoteStats",
    "Repetition",
    "RepetitionGuard",
    "UpstreamError",
    "estimate_prompt_tokens",
    "retry_after_seconds",
    "speculative_report",
    "stream_chat",
    "trim_repetition",
    "validate",
]
