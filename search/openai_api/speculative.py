"""Per-request speculative decoding, asked for as clients of hosted speculative-decoding APIs do.

Two forms of top-level request fields (the OpenAI SDK sends them with ``extra_body``):

- ``enable_speculative: bool``, with ``draft_model: str`` optionally;
- ``speculative_decoding: {"enabled": bool, "draft_tokens": int, "temperature": float}``,
  every key optional, ``enabled`` true unless said otherwise (asking for draft tokens means
  asking for speculation); any other key is refused.

Both forms may come together when they agree. ``parse`` checks types and ranges;
``override_for`` turns the request into settings of the route's provider
(``Provider.speculative_settings``: ``method``, ``k``, ``draft_model``) within what the
provider's validation allows (a method needing a draft only with the provider's draft model,
``k`` up to ``SPECULATIVE_K_MAX``), and the worker merges them over the provider's settings
for this request only (``inference.execution.speculative_settings``), where each backend
validates them as it validates the provider's. A refusal is a 400 whose ``param`` names the
field.

=================================  ==========================================================
request                            settings for this request
=================================  ==========================================================
nothing said                       the provider's own (no override)
disabled                           ``method: "off"``
enabled, ``draft_model`` named     the route's draft: ``method: "draft"`` (``"both"`` kept when
                                   the provider uses it); the name must be the route's draft
                                   model: a client can neither load another model onto our GPUs
                                   nor name one the upstream was not set up with
enabled, no ``draft_model``        the provider's method when it is on; else ``"draft"`` when the
                                   provider has a draft model, else ``"ngram"`` (prompt lookup
                                   needs no model, and answers quote their sources)
``draft_tokens``                   ``k``, 1 to ``SPECULATIVE_K_MAX`` (16)
``temperature``                    the request's sampling temperature (see below)
=================================  ==========================================================

Speculative sampling verifies each proposal against the target's own distribution at the
request's temperature, which is what keeps the output the target's; the draft proposes at
that same temperature. So ``speculative_decoding.temperature`` is the request's
temperature: it applies when the request has none, and must equal it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.models import SPECULATIVE_K_MAX, Provider
from search.openai_api.errors import invalid

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
    """The speculative fields of a chat request, validated; ``ApiError`` (400) naming the field."""
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


def override_for(request: SpeculativeRequest, provider: Provider, route_name: str) -> dict | None:
    """The speculative settings of this request on ``provider`` (table in the module
    docstring); None when the request said nothing."""
    if not request.given:
        return None
    if request.enabled is False:
        return {"method": Provider.Speculative.OFF.value}
    uses_draft = (Provider.Speculative.DRAFT, Provider.Speculative.BOTH)
    if request.draft_model is not None:
        if request.draft_model != provider.draft_model:
            served = "has no draft model"
            if provider.draft_model:
                served = f"serves the draft model {provider.draft_model!r}"
            raise invalid(
                "draft_model",
                f"route {route_name!r} {served}; draft_model {request.draft_model!r} cannot be used "
                "(leave it out to use the route's)",
                code="model_not_found",
            )
        method = Provider.Speculative.DRAFT
        if provider.speculative_method in uses_draft:
            method = provider.speculative_method
    elif provider.speculative_method != Provider.Speculative.OFF:
        method = provider.speculative_method
    else:
        method = Provider.Speculative.DRAFT if provider.draft_model else Provider.Speculative.NGRAM
    k = request.draft_tokens if request.draft_tokens is not None else provider.speculative_k
    settings = {"method": str(method), "k": k}
    if method in uses_draft:
        settings["draft_model"] = provider.draft_model
    return settings
