"""Answers through the API: created (202, or 200 with ?wait=), read back, refused by the key's
limits (429 with Retry-After, 402), by routing (400, 503) or validation (400 naming the
field), and followed as Server-Sent Events (the async view, in-process: keep-alives while
nothing comes, resume from Last-Event-ID). test_live.py runs it behind uvicorn."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.db import connections
from django.test import AsyncClient
from django.utils import timezone

from billing.models import Price
from frontdoors.api import streaming
from inference.models import Provider, Route, UpstreamKey
from inference.streams import StreamWriter
from ragsite.celery import queue_depth, queue_lists
from ragsite.redis import Role, redis_client
from search.models import Answer, Document, Membership
from search.services import workspace_create
from tests.frontdoors.api.conftest import DOCUMENTS
from tests.search.files import ingest_texts as ingest

pytestmark = pytest.mark.django_db

QUESTION = "How long does charging take?"


def remote_route(*, window: int = 4096, cooling_for_s: float | None = None) -> Route:
    """A default route to an OpenAI-compatible upstream nobody serves: tests that use it stop
    before a worker would call it (refused, or sent to a queue no worker consumes here)."""
    provider = Provider.objects.create(
        name=f"upstream-{uuid.uuid4().hex[:6]}",
        kind=Provider.Kind.OPENAI_COMPATIBLE,
        base_url="http://127.0.0.1:9/v1",
        model="stand-in-7b",
        context_window=window,
    )
    key = UpstreamKey(provider=provider, label="main")
    key.set_secret(f"sk-{uuid.uuid4().hex}")
    if cooling_for_s is not None:
        key.status = UpstreamKey.Status.COOLING_DOWN
        key.cooldown_until = timezone.now() + timedelta(seconds=cooling_for_s)
    key.save()
    return Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=32)


@pytest.fixture
def submitted():
    """``submitted()``: the request ids of the generations sent, read back from the ``remote``
    queue in Redis. Submission is the real one (admission, the queue bound, the Celery
    message); no worker consumes the queue here, and the messages are removed afterwards."""
    client = redis_client(Role.BROKER)
    lists = queue_lists("remote")
    assert queue_depth("remote") == 0

    def request_ids() -> list[str]:
        messages = [json.loads(raw) for name in lists for raw in client.lrange(name, 0, -1)]
        return [json.loads(base64.b64decode(message["body"]))[0][0] for message in messages]

    yield request_ids
    client.delete(*lists)


@pytest.fixture
def corpus(handbook, theirs):
    ingest(handbook, DOCUMENTS)
    return handbook


# --------------------------------------------------------------------------- create and read


def test_an_extractive_answer_is_accepted_done_and_read_back(client_for, make_key, acme, corpus):
    token = make_key("generate")
    client = client_for(token)
    response = client.post("/api/v1/answers", {"question": QUESTION, "collections": [corpus.pk]}, format="json")
    assert response.status_code == 202
    body = response.json()
    assert (body["status"], body["mode"], body["collections"]) == ("done", "extractive", [corpus.pk])
    assert response["Location"] == body["url"] == f"http://testserver/api/v1/answers/{body['id']}"
    assert body["stream_url"] == body["url"] + "/stream"
    answer = Answer.objects.get(pk=body["id"])
    key_id = client.get("/api/v1/usage").json()["client_key"]["id"]
    assert (answer.workspace, answer.asker, answer.client_id) == (acme, None, f"key:{key_id}")

    detail = client.get(body["url"]).json()
    assert detail == body
    robot = Document.objects.get(source_name="robot.md")
    assert "Charging takes 90 minutes." in detail["text"]
    cited = {citation["document_id"]: citation for citation in detail["citations"]}
    assert cited[robot.pk]["document_url"] == f"http://testserver/api/v1/documents/{robot.pk}"
    assert [source["number"] for source in detail["sources"]] == list(range(1, len(detail["sources"]) + 1))
    assert detail["stats"]["mode"] == "extractive" and "total_ms" in detail["timings"]


def test_wait_returns_200_once_finished_and_202_with_the_state_on_timeout(admin_client, corpus, submitted):
    done = admin_client.post("/api/v1/answers?wait=5", {"question": QUESTION}, format="json")
    assert (done.status_code, done.json()["status"]) == (200, "done")

    remote_route()
    started = time.monotonic()
    pending = admin_client.post("/api/v1/answers?wait=1", {"question": QUESTION}, format="json")
    assert 1 <= time.monotonic() - started < 5
    assert (pending.status_code, pending.json()["status"], pending.json()["mode"]) == (202, "generating", "generated")
    assert submitted() == [str(pending.json()["id"])]


@pytest.mark.parametrize(
    ("query", "payload", "field"),
    [
        ("", {"question": "   "}, "question"),
        ("", {}, "question"),
        ("", {"question": "x" * 4001}, "question"),
        ("", {"question": QUESTION, "top_k": 51}, "top_k"),
        ("", {"question": QUESTION, "collections": []}, "collections"),
        ("", {"question": QUESTION, "collections": [10**12]}, "collections"),
        ("", {"question": QUESTION, "max_tokens": 0}, "max_tokens"),
        ("", {"question": QUESTION, "temperature": -1}, "temperature"),
        ("?wait=61", {"question": QUESTION}, "wait"),
        ("?wait=soon", {"question": QUESTION}, "wait"),
    ],
)
def test_a_bad_question_is_refused_naming_the_field(admin_client, handbook, query, payload, field):
    response = admin_client.post(f"/api/v1/answers{query}", payload, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["field"] == field
    assert not Answer.objects.exists()


# --------------------------------------------------------------------------- routing and limits


def test_a_question_too_long_for_the_routes_window_is_400_naming_the_question(admin_client, corpus):
    remote_route(window=300)
    response = admin_client.post(
        "/api/v1/answers", {"question": "Why does the lift of the wing rise? " * 30}, format="json"
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("invalid_request", "question")
    assert Answer.objects.get().status == Answer.Status.FAILED


def test_an_unknown_route_is_400_and_an_unavailable_one_503_with_retry_after(admin_client, corpus):
    remote_route(cooling_for_s=30)
    unknown = admin_client.post("/api/v1/answers", {"question": QUESTION, "route": "fast"}, format="json")
    assert unknown.status_code == 400
    error = unknown.json()["error"]
    assert (error["code"], error["field"]) == ("route_not_found", "route")
    assert "no enabled route named 'fast'" in error["message"]

    unavailable = admin_client.post("/api/v1/answers", {"question": QUESTION}, format="json")
    assert unavailable.status_code == 503
    assert unavailable.json()["error"]["code"] == "route_unavailable"
    assert 28 <= int(unavailable["Retry-After"]) <= 31


def test_a_key_over_its_requests_per_minute_is_429_with_retry_after(make_key, client_for, corpus, submitted):
    remote_route()
    client = client_for(make_key("generate", requests_per_minute=1))
    assert client.post("/api/v1/answers", {"question": QUESTION}, format="json").status_code == 202
    refused = client.post("/api/v1/answers", {"question": QUESTION}, format="json")
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limited" and "allows 1 requests per minute" in error["message"]
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert len(submitted()) == 1  # the refused request sent nothing
    assert list(Answer.objects.order_by("created_at").values_list("status", flat=True)) == ["generating", "failed"]
    # The DRF throttle does not count answers: the key can still read.
    assert client.get("/api/v1/usage").status_code == 200


def test_a_key_whose_budget_is_spent_is_402(make_key, client_for, corpus, submitted):
    remote_route()
    unpriced = client_for(make_key("generate", monthly_budget_usd=Decimal("5.00")))
    response = unpriced.post("/api/v1/answers", {"question": QUESTION}, format="json")
    assert (response.status_code, response.json()["error"]["code"]) == (402, "model_unpriced")

    Price.objects.create(model="stand-in-7b", input_usd_per_million=Decimal(1), output_usd_per_million=Decimal(2))
    spent = client_for(make_key("generate", monthly_budget_usd=Decimal("0.00")))
    response = spent.post("/api/v1/answers", {"question": QUESTION}, format="json")
    assert response.status_code == 402
    error = response.json()["error"]
    assert error["code"] == "budget_exhausted" and "is spent" in error["message"]
    assert "Retry-After" not in response
    assert submitted() == []


# --------------------------------------------------------------------------- the event stream, in-process


async def read_stream(client: AsyncClient, path: str, **headers) -> tuple[int, str]:
    response = await client.get(path, headers=headers)
    if not response.streaming:
        return response.status_code, response.content.decode()
    return response.status_code, "".join([chunk.decode() async for chunk in response.streaming_content])


def events_of(text: str) -> list[tuple[str, str, str]]:
    """(event, id, data) of each event of a Server-Sent Events body; comments left out."""
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "event" in fields:
            events.append((fields["event"], fields["id"], fields["data"]))
    return events


@pytest.mark.django_db(transaction=True)  # the view's queries run on another thread's connection
def test_the_event_stream_keeps_alive_while_waiting_and_resumes_from_the_last_id(monkeypatch, acme, make_key):
    monkeypatch.setattr(streaming, "KEEPALIVE_SECONDS", 0.2)
    monkeypatch.setattr(streaming, "STREAM_MAX_SECONDS", 0.7)
    token = make_key("generate")
    other_token = make_key("generate", workspace=workspace_create(name="Other", slug="other"))
    answer = Answer.objects.create(workspace=acme, question="Who?", status=Answer.Status.GENERATING)
    replayed = Answer.objects.create(workspace=acme, question="Why?", status=Answer.Status.DONE, text="Because.")
    member = get_user_model().objects.create_user("ann")
    Membership.objects.create(workspace=acme, user=member)
    path = f"/api/v1/answers/{answer.pk}/stream"
    auth = {"Authorization": f"Bearer {token}"}

    async def scenario():
        client = AsyncClient()
        waiting = await read_stream(client, path, **auth)
        writer = StreamWriter(str(answer.pk))
        first = writer.write("sentence", text="Ten ")
        writer.write("sentence", text="hours [1].")
        writer.write("stats", completion_tokens=3)
        # The stored answer, which answer_finalize writes once it has checked the citations.
        writer.write("answer", text="Ten hours [1].", grounded=1.0)
        resumed = await read_stream(client, path, **auth, **{"Last-Event-ID": first})
        whole = await read_stream(client, path + "?after=0", **auth)
        ended = [
            await read_stream(client, path, **auth, **{"Last-Event-ID": events_of(whole[1])[-1][1]}),
            await read_stream(client, f"/api/v1/answers/{replayed.pk}/stream?after=0-3", **auth),
        ]
        replay = await read_stream(client, f"/api/v1/answers/{replayed.pk}/stream", **auth)
        session = AsyncClient()
        await session.aforce_login(member)
        by_session = await read_stream(session, path)
        refusals = [
            await read_stream(client, path),
            await read_stream(client, path, Authorization=f"Bearer {other_token}"),
            await read_stream(client, path, **auth, **{"Last-Event-ID": "soon"}),
            await read_stream(client, f"/api/v1/answers/{uuid.uuid4()}/stream", **auth),
        ]
        await sync_to_async(connections.close_all)()
        return first, waiting, resumed, whole, ended, replay, by_session, refusals

    first, waiting, resumed, whole, ended, replay, by_session, refusals = asyncio.run(scenario())

    status, text = waiting
    assert status == 200 and text.startswith("retry: 1000\n\n")
    assert text.count(": keep-alive\n\n") >= 2 and events_of(text) == []  # nothing yet: the client reconnects
    status, text = resumed
    assert [(kind, data) for kind, _, data in events_of(text)] == [
        ("delta", '{"text": "hours [1]."}'),
        ("stats", '{"completion_tokens": 3}'),
        ("answer", '{"text": "Ten hours [1].", "grounded": 1.0}'),
    ]
    everything = events_of(whole[1])
    assert [kind for kind, _, _ in everything] == ["delta", "delta", "stats", "answer"]
    assert everything[0][1] == first and everything[1:] == events_of(text)
    assert by_session == whole  # a member's session reads it as a key does
    # Resuming after the last event: 204, which stops EventSource from reconnecting.
    assert ended == [(204, ""), (204, "")]
    assert [(kind, event_id) for kind, event_id, _ in events_of(replay[1])] == [
        ("delta", "0-1"),
        ("stats", "0-2"),
        ("answer", "0-3"),
    ]
    assert [status for status, _ in refusals] == [401, 404, 400, 404]
    assert '"field": "Last-Event-ID"' in refusals[2][1]
