"""Running one routed generation in a worker: the attempt, the stream, the ledger row.

``run_routed`` is the body of ``inference.tasks.generate_routed``. Whatever happens, the
stream ``gen:<request_id>`` ends with ``stats`` or ``error`` and exactly one ledger row
is written with the tokens produced, so nothing is served unbilled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from django.db import connection
from django.utils import timezone

from billing.models import UsageRecord
from inference.engine import GenerationRequest, GenerationStats, SpeculativeConfig, generate
from inference.engine.models import models_load
from inference.engine.speculative import GenerationError
from inference.models import Route, UpstreamKey
from inference.remote import RemoteEndpoint, RemoteRequest, RemoteStats, UpstreamError, stream_chat
from inference.streams import StreamWriter

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What one routed generation did, for the stream's end, the ledger and the caller."""

    route: Route
    text: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    error: dict | None = None
    attempts: int = 0
    upstream_key: UpstreamKey | None = None
    started: float = field(default_factory=time.monotonic)

    def result(self, request_id: str, payload: dict) -> dict:
        return {
            "request_id": request_id,
            "status": "error" if self.error else "ok",
            "text": "".join(self.text),
            "stats": self.stats,
            "error": self.error,
            "route": self.route.name,
            "provider": self.route.provider.name,
            "arm": payload.get("arm") or "",
            "attempts": self.attempts,
        }


def local_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template when the model has one; else the messages' contents, blank-line joined."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode("\n\n".join(str(message.get("content", "")) for message in messages))


def attempt_local(route: Route, payload: dict, writer: StreamWriter, outcome: Outcome) -> None:
    provider = route.provider
    outcome.attempts += 1
    models = models_load(provider.model, provider.draft_model or None)
    spec = provider.speculative_settings()
    request = GenerationRequest(
        prompt_ids=local_prompt_ids(models.tokenizer, payload["messages"]),
        max_tokens=int(payload["max_tokens"]),
        temperature=float(payload["temperature"]),
        top_p=float(payload["top_p"]),
        stop=tuple(payload.get("stop") or ()),
        seed=payload.get("seed"),
        speculative=SpeculativeConfig(
            method=spec["method"] if models.draft is not None or spec["method"] == "ngram" else "off",
            k=spec["k"],
            adaptive_k=bool(spec.get("adaptive_k")),
        ),
    )
    for piece in generate(
        request,
        target=models.target,
        tokenizer=models.tokenizer,
        draft=models.draft,
        context_window=min(models.context_window, provider.context_window),
    ):
        if isinstance(piece, GenerationStats):
            outcome.stats = {**piece.as_dict(), "usage_source": "engine"}
        else:
            outcome.text.append(piece)
            writer.write("delta", text=piece)


def attempt_remote(route: Route, payload: dict, writer: StreamWriter, outcome: Outcome, key: UpstreamKey) -> None:
    provider = route.provider
    outcome.attempts += 1
    outcome.upstream_key = key
    endpoint = RemoteEndpoint(
        base_url=provider.base_url,
        api_key=key.secret(),
        model=provider.model,
        connect_timeout_s=provider.connect_timeout_s,
        first_token_timeout_s=provider.first_token_timeout_s,
        total_timeout_s=provider.total_timeout_s,
        extra_body=provider.extra_body or None,
    )
    request = RemoteRequest(
        messages=payload["messages"],
        max_tokens=int(payload["max_tokens"]),
        temperature=float(payload["temperature"]),
        top_p=float(payload["top_p"]),
        stop=tuple(payload.get("stop") or ()),
        seed=payload.get("seed"),
        speculative=provider.speculative_settings(),
    )
    for piece in stream_chat(endpoint, request):
        if isinstance(piece, RemoteStats):
            outcome.stats = piece.as_dict()
        else:
            outcome.text.append(piece)
            writer.write("delta", text=piece)


def next_key(route: Route) -> UpstreamKey | None:
    """The least recently used usable key of the route's provider, marked used (one statement)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE inference_upstreamkey SET last_used_at = now()
            WHERE id = (
                SELECT id FROM inference_upstreamkey
                WHERE provider_id = %s
                  AND (status = 'active' OR (status = 'cooling_down' AND cooldown_until <= now()))
                ORDER BY last_used_at ASC NULLS FIRST, id
                LIMIT 1 FOR UPDATE SKIP LOCKED
            )
            RETURNING id
            """,
            [route.provider_id],
        )
        row = cursor.fetchone()
    return UpstreamKey.objects.get(id=row[0]) if row else None


def run_routed(request_id: str, payload: dict) -> dict:
    writer = StreamWriter(request_id)
    route = Route.objects.select_related("provider").get(id=payload["route_id"])
    outcome = Outcome(route=route)
    try:
        if route.provider.is_local:
            attempt_local(route, payload, writer, outcome)
        else:
            key = next_key(route)
            if key is None:
                raise UpstreamError(
                    "unauthorized",
                    f"provider {route.provider.name} has no usable upstream key; add or re-enable one in the admin",
                )
            attempt_remote(route, payload, writer, outcome, key)
        writer.write("stats", **outcome.stats)
    except GenerationError as exc:
        outcome.error = {"field": exc.field, "kind": "invalid_request", "message": str(exc)}
    except UpstreamError as exc:
        outcome.error = {"field": None, **exc.as_dict()}
    except Exception as exc:  # a bug or a model crash fails this request only
        logger.exception("routed generation %s failed", request_id)
        outcome.error = {"field": None, "kind": "internal", "message": f"generation failed: {type(exc).__name__}"}
    if outcome.error:
        writer.write("error", **outcome.error)
    ledger_write(request_id, payload, outcome)
    return outcome.result(request_id, payload)


def ledger_write(request_id: str, payload: dict, outcome: Outcome) -> UsageRecord:
    route, stats = outcome.route, outcome.stats
    completion_tokens = stats.get("completion_tokens", len(outcome.text) if outcome.error else 0)
    return UsageRecord.objects.create(
        request_id=request_id,
        created_at=timezone.now(),
        kind=UsageRecord.Kind.GENERATION,
        workspace_id=payload.get("workspace_id"),
        user_id=payload.get("user_id"),
        route=route,
        route_name=route.name,
        release_id=payload.get("release_id"),
        arm=payload.get("arm") or "",
        provider=route.provider,
        provider_name=route.provider.name,
        model=route.provider.model,
        upstream_key=outcome.upstream_key,
        prompt_tokens=stats.get("prompt_tokens", 0),
        completion_tokens=completion_tokens,
        draft_tokens_proposed=stats.get("draft_tokens_proposed", 0),
        draft_tokens_accepted=stats.get("draft_tokens_accepted", 0),
        usage_source=stats.get("usage_source", "counted" if outcome.error else ""),
        attempts=max(outcome.attempts, 1),
        latency_ms=(time.monotonic() - outcome.started) * 1000,
        ttft_ms=stats.get("time_to_first_token_ms"),
        status=UsageRecord.Status.ERROR if outcome.error else UsageRecord.Status.OK,
        error_class=(outcome.error or {}).get("kind") or "",
    )
