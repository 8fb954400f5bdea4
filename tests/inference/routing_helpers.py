"""Providers, keys and routes on the OpenAI-protocol stand-in, and one routed request run
in this process (the body of ``generate_routed``), for the key pool and routing tests.

Every helper makes unique names and API keys, so tests never share stand-in scripts or
rows; routing tests run with ``transaction=True`` (the pool's statements commit, as in a
worker, and worker processes must see the rows).
"""

from __future__ import annotations

import time
import uuid

from billing import ledger
from billing.models import UsageRecord
from inference import router
from inference.execution import run_routed
from inference.models import Provider, Route, RouteFallback, UpstreamKey
from inference.streams import stream_read

REPLY = "Lift rises with the angle of attack until the wing stalls."
WORDS = ["Lift", " rises", " with", " the", " angle", " of", " attack", " until", " the", " wing", " stalls."]
PROMPT = f"Answer from the passages.\nREPLY: {REPLY}"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def provider_make(base_url: str, **fields) -> Provider:
    values = {
        "name": unique("upstream"),
        "kind": Provider.Kind.OPENAI_COMPATIBLE,
        "base_url": base_url,
        "model": "stand-in-7b",
        "first_token_timeout_s": 10,
        "total_timeout_s": 30,
        **fields,
    }
    return Provider.objects.create(**values)


def key_make(provider: Provider, label: str = "key") -> tuple[UpstreamKey, str]:
    """A key with a fresh secret; returns the row and the plaintext (the stand-in's script id)."""
    secret = f"sk-test-{uuid.uuid4().hex}"
    key = UpstreamKey(provider=provider, label=label)
    key.set_secret(secret)
    key.save()
    return key, secret


def route_make(provider: Provider, *, fallbacks: tuple[Route, ...] = (), **fields) -> Route:
    route = Route.objects.create(name=unique("route"), provider=provider, max_tokens=64, **fields)
    for position, fallback in enumerate(fallbacks):
        RouteFallback.objects.create(route=route, fallback=fallback, position=position)
    return route


def payload(route: Route, prompt: str = PROMPT, **fields) -> dict:
    plan = router.plan(route_name=route.name, client_id="tests")
    return router.payload_for(plan, messages=[{"role": "user", "content": prompt}], **fields)


def events_of(request_id: str, block_ms: int = 30000) -> list[tuple[str, dict]]:
    return [(kind, data) for _, kind, data in stream_read(request_id, block_ms=block_ms)]


def routed(route: Route, prompt: str = PROMPT, **fields) -> tuple[dict, list[tuple[str, dict]], UsageRecord | None]:
    """One request through ``run_routed`` here, then the ledger's drain, as the task does:
    its result, its stream's events, its ledger row."""
    request_id = uuid.uuid4().hex
    result = run_routed(request_id, payload(route, prompt, **fields))
    if result["status"] == "handed_over":
        return result, [], None
    ledger.usage_records_store()
    return result, events_of(request_id), UsageRecord.objects.get(request_id=request_id)


def ledger_row(request_id: str, timeout: float = 60) -> UsageRecord:
    """The request's ledger row once a worker has queued it: this test drains the outbox as
    the ``default`` worker's drain would (the tests that call this run no ``default`` worker)."""
    deadline = time.monotonic() + timeout
    while True:
        ledger.usage_records_store(claim_idle_ms=0)
        rows = list(UsageRecord.objects.filter(request_id=request_id))
        if rows or time.monotonic() > deadline:
            assert len(rows) == 1, f"expected one ledger row for {request_id}, found {len(rows)}"
            return rows[0]
        time.sleep(0.1)


def deltas(events: list[tuple[str, dict]]) -> list[str]:
    return [data["text"] for kind, data in events if kind == "delta"]


def kinds(events: list[tuple[str, dict]]) -> list[str]:
    return [kind for kind, _ in events]


def queued_request_ids(queue: str = "remote") -> list[str]:
    """The request ids of the generations waiting on ``queue`` (its Redis lists, oldest first), as
    a worker would take them: each message's body is ``[args, kwargs, embed]``, args[0] the id."""
    import base64
    import json

    from ragsite.celery import queue_lists
    from ragsite.redis import Role, redis_client

    ids = []
    for name in queue_lists(queue):
        for raw in reversed(redis_client(Role.BROKER).lrange(name, 0, -1)):  # LPUSH: the oldest is last
            message = json.loads(raw)
            ids.append(json.loads(base64.b64decode(message["body"]))[0][0])
    return ids


def queue_purge(queue: str = "remote") -> None:
    from ragsite.celery import queue_lists
    from ragsite.redis import Role, redis_client

    redis_client(Role.BROKER).delete(*queue_lists(queue))
