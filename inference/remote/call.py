"""What one remote call is: the endpoint, the request, the figures it ends with, and their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from inference.requests import GenerationError, validate_sampling

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
    cut_repetitions: bool = True  # end a generation that repeats itself (inference.remote.repetition)

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
    # Repetition.as_dict() when the stream was cut because it repeats itself (finish_reason
    # "repetition"): where the loop is, and text[:cut_at_char] is what to store.
    repetition: dict | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / (self.total_ms / 1000) if self.total_ms else 0.0

    def as_dict(self) -> dict:
        """The keys of ``GenerationStats.as_dict()`` that mean the same here, plus ``usage_source``,
        ``model`` and ``speculative`` (the engine's report, or None). The draft counters are
        there only when the engine reported them: 0 would claim that nothing was accepted;
        ``repetition`` only when the stream was cut for repeating itself."""
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
            **({"repetition": self.repetition} if self.repetition is not None else {}),
        }


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


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: count the text ones
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def estimate_prompt_tokens(messages: list[dict]) -> int:
    return math.ceil(sum(len(_message_text(message)) for message in messages) / CHARS_PER_TOKEN)
