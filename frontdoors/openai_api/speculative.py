"""Per-request speculative decoding, asked for as clients of hosted speculative-decoding APIs do.

Two forms of top-level request fields (the OpenAI SDK sends them with ``extra_body``):

- ``enable_speculative: bool``, with ``draft_model: str`` optionally;
- ``speculative_decoding: {"enabled": bool, "draft_tokens": int, "temperature": float}``,
  every key optional, ``enabled`` true unless said otherwise (asking for draft tokens means
  asking for speculation); any other key is refused.

Both forms may come together when they agree. ``parse`` checks types and ranges;
``wanted`` turns the request into options (``{"enabled", "draft_model", "k"}``) that
select the endpoint: speculation is fixed when an engine server starts (vLLM has no
per-request switch), so a request does not change how a pool decodes, it chooses among
the endpoints of the route's model (say a speculative pool and a plain one, or pools of
different k). This module only reads the request's fields; which endpoint serves them is
decided once, by the domain (``inference.router.plan``): a request no endpoint can serve is
a 400 naming the field, before any retrieval, and nothing of it is sent upstream.

=================================  ==========================================================
request                            the endpoint that serves it
=================================  ==========================================================
nothing said                       the route's own
disabled                           one that does not speculate
enabled                            one that speculates (any method)
``draft_model`` named              one whose draft model (or EAGLE head) is that one: a client
                                   can neither load another model onto our GPUs nor name one
                                   an endpoint was not started with
``draft_tokens``                   one that proposes that many tokens a step (``k``), 1 to
                                   ``SPECULATIVE_K_MAX`` (16)
``temperature``                    the request's sampling temperature (see below)
=================================  ==========================================================

Speculative sampling verifies each proposal against the target's own distribution at the
request's temperature, which is what keeps the output the target's; the draft proposes at
that same temperature. So ``speculative_decoding.temperature`` is the request's
temperature: it applies when the request has none, and must equal it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from frontdoors.openai_api.errors import invalid
from inference.models import SPECULATIVE_K_MAX

DECODING_KEYS = ("enabled", "draft_tokens", "temperature")
TEMPERATURE_MAX = 2.0  # OpenAI's range for temperature


@dataclass(frozen=True)
class SpeculativeRequest:
    """What a request asked for; None where it said nothing."""

    enabled: bool | None = None
    draft_model: str | None = None
    draft_tokens: int | None = None
    temperature: float | None = None

    @property
    def given(self) -> bool:
        return any(value is not None for value in (self.enabled, self.draft_model, self.draft_tokens))


def _bool(value, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(param, f"{param} must be true or false, got {value!r}")
    return value


def parse(body: dict) -> SpeculativeRequest:
    """The speculative fields of a chat request, validated; ``OpenAIError`` (400) naming the field."""
    enabled = None
    if body.get("enable_speculative") is not None:
        enabled = _bool(body["enable_speculative"], "enable_speculative")

    draft_model = body.get("draft_model")
    if draft_model is not None and not (isinstance(draft_model, str) and draft_model.strip()):
        raise invalid("draft_model", f"draft_model must be a non-empty string, got {draft_model!r}")

    draft_tokens = temperature = None
    options = body.get("speculative_decoding")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("speculative_decoding", f"speculative_decoding must be an object, got {options!r}")
        unknown = sorted(set(options) - set(DECODING_KEYS))
        if unknown:
            raise invalid(
                f"speculative_decoding.{unknown[0]}",
                f"speculative_decoding.{unknown[0]} is not an option (options: {', '.join(DECODING_KEYS)})",
                code="unknown_parameter",
            )
        said = _bool(options["enabled"], "speculative_decoding.enabled") if "enabled" in options else True
        if enabled is not None and said != enabled:
            raise invalid(
                "speculative_decoding.enabled",
                f"speculative_decoding.enabled ({str(said).lower()}) contradicts enable_speculative "
                f"({str(enabled).lower()})",
            )
        enabled = said
        if "draft_tokens" in options:
            draft_tokens = options["draft_tokens"]
            if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int):
                raise invalid(
                    "speculative_decoding.draft_tokens",
                    f"speculative_decoding.draft_tokens must be an integer, got {draft_tokens!r}",
                )
            if not 1 <= draft_tokens <= SPECULATIVE_K_MAX:
                raise invalid(
                    "speculative_decoding.draft_tokens",
                    f"speculative_decoding.draft_tokens must be from 1 to {SPECULATIVE_K_MAX}, got {draft_tokens}",
                )
        if "temperature" in options:
            temperature = options["temperature"]
            if isinstance(temperature, bool) or not isinstance(temperature, int | float):
                raise invalid(
                    "speculative_decoding.temperature",
                    f"speculative_decoding.temperature must be a number, got {temperature!r}",
                )
            if not 0 <= temperature <= TEMPERATURE_MAX:
                raise invalid(
                    "speculative_decoding.temperature",
                    f"speculative_decoding.temperature must be from 0 to {TEMPERATURE_MAX:g}, got {temperature}",
                )
            temperature = float(temperature)
    if enabled is None and draft_model is not None:
        enabled = True  # naming a draft model asks for it
    return SpeculativeRequest(
        enabled=enabled,
        draft_model=draft_model.strip() if draft_model else None,
        draft_tokens=draft_tokens,
        temperature=temperature,
    )


def temperature_for(request: SpeculativeRequest, temperature: float | None) -> float | None:
    """The request's temperature, given its top-level ``temperature`` (see the module docstring)."""
    if request.temperature is None:
        return temperature
    if temperature is not None and float(temperature) != request.temperature:
        raise invalid(
            "speculative_decoding.temperature",
            f"speculative_decoding.temperature ({request.temperature:g}) differs from temperature "
            f"({temperature:g}): the draft proposes at the request's temperature, so give one value",
        )
    return request.temperature


def wanted(request: SpeculativeRequest) -> dict | None:
    """The request's options for ``inference.router.plan``; None when it said nothing."""
    if not request.given:
        return None
    if request.enabled is False:  # off: what the draft would have been does not matter
        return {"enabled": False, "draft_model": None, "k": None}
    return {"enabled": request.enabled, "draft_model": request.draft_model, "k": request.draft_tokens}
