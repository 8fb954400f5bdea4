"""Answers end to end: retrieval, the prompt, a real generation worker, the stream, the stored answer.

Real PostgreSQL + pgvector, Redis and Celery worker processes (``gpu`` for a GPU pool: a
vLLM server with a tiny model, ``remote`` against the OpenAI-protocol stand-in, ``default`` for the
finalize task). The stand-in replies exactly the text of a ``REPLY:`` line in the last user
message; the question is the last thing in it, so a question can carry the reply.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model

from billing import client_keys, limits
from billing.models import Price, UsageRecord
from billing.pricing import cost_of
from inference.errors import RouteNotFound, RouteUnavailable
from inference.models import Provider, Route, UpstreamKey
from inference.streams import StreamWriter, stream_events
from ragsite.logs import request_received_var
from search.answering import answers
from search.answering.answers import AnswerError, answer_create, answer_fail, answer_stream_read
from search.answering.extractive import LEAD
from search.answering.prompting import RemoteEstimate, Source, answer_messages, prompt_budget_for
from search.models import Answer, Chunk, Collection, Document, Membership
from search.scoping import CollectionNotFound
from search.selectors import chunk_search
from search.services import collection_create, workspace_create
from tests.conftest import celery_worker
from tests.inference.routing_helpers import ledger_row
from tests.search.files import ingest_texts as ingest
from tests.upstream_server import upstream_log, upstream_script

DOCUMENTS = {
    "wing.md": "# Wing aerodynamics\n\nLift rises with the angle of attack until the wing stalls. "
    "The propeller slipstream increases the lift of the wing.",
    "heat.md": "# Heat transfer\n\nHeat flux at the nose of a blunt body is given by the stagnation point formula. "
    "The boundary layer thickens downstream of the nose.",
    "robot.md": "# Atlas-7 robot\n\nThe Atlas-7 warehouse robot runs for 10 hours on one battery charge. "
    "Charging takes 90 minutes.",
}
CITED = "Lift rises with angle of attack [1]. Heat flux is given in [2][9]."
VERIFIED = "Lift rises with angle of attack [1]. Heat flux is given in [2]."


@pytest.fixture
def corpus(db):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    # Another tenant's collection, created before any chunk is written in this transaction
    # (a vector index cannot be created while the chunk table has pending trigger events).
    collection_create(workspace=workspace_create(name="Other", slug="other"), name="Theirs")
    ingest(collection, DOCUMENTS)
    return workspace, collection


@pytest.fixture
def asker(db):
    return get_user_model().objects.create_user("ann")


def wait_for_answer(answer_id, timeout: float = 60) -> Answer:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = Answer.objects.get(pk=answer_id)
        if answer.status in (Answer.Status.DONE, Answer.Status.FAILED):
            return answer
        time.sleep(0.1)
    raise AssertionError(f"answer {answer_id} not finalized: {Answer.objects.get(pk=answer_id).status}")


def read_stream(answer: Answer, timeout: float = 120) -> list[tuple[str, str, dict]]:
    """The answer's events to the end, reconnecting from the last id seen as a browser would
    (each wait is kept under the Redis client's 30 s socket timeout)."""
    events: list[tuple[str, str, dict]] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            for event in answer_stream_read(answer, after=events[-1][0] if events else "0", block_ms=10000):
                events.append(event)
            return events
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def deltas(events) -> str:
    """The model's text as it generated it (the stream's ``delta`` events)."""
    return "".join(data["text"] for _, kind, data in events if kind == "delta")


def shown(events) -> str:
    """The verified text the stream carried (its ``sentence`` events): what a reader is shown."""
    return "".join(data["text"] for _, kind, data in events if kind == "sentence")


def hits_for(workspace, question: str, top_k: int = 8):
    return chunk_search(query=question, workspace=workspace, top_k=top_k, snippets=False).hits


def remote_provider(upstream_server, *, window: int = 4096, max_tokens: int = 64) -> tuple[Route, str]:
    api_key = f"sk-answers-{uuid.uuid4().hex}"
    provider = Provider.objects.create(
        name=f"stand-in-{uuid.uuid4().hex[:6]}",
        kind=Provider.Kind.OPENAI_COMPATIBLE,
        base_url=upstream_server,
        model="stand-in-7b",
        context_window=window,
        first_token_timeout_s=20,
        total_timeout_s=60,
    )
    key = UpstreamKey(provider=provider, label="main")
    key.set_secret(api_key)
    key.save()
    route = Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=max_tokens)
    return route, api_key


# --------------------------------------------------------------------------- validation and errors


def test_a_bad_request_is_refused_naming_the_field_and_stores_nothing(corpus):
    workspace, collection = corpus
    other = Collection.objects.get(workspace__slug="other")
    cases = [
        ({"question": "   "}, AnswerError, "question", "the question is empty"),
        ({"question": "x" * 4001}, AnswerError, "question", "4001 characters long, over the limit of 4000"),
        # Another workspace's collection and one nobody has: the same words (search.scoping).
        (
            {"question": "lift?", "collections": [other]},
            CollectionNotFound,
            "collections",
            f"No collection {other.pk} in this workspace.",
        ),
        (
            {"question": "lift?", "collections": [collection.pk, 10**9]},
            CollectionNotFound,
            "collections",
            f"No collection {10**9} in this workspace.",
        ),
        ({"question": "lift?", "collections": ["3"]}, CollectionNotFound, "collections", "'3' is not a collection id"),
        (
            {"question": "lift?", "collections": []},
            CollectionNotFound,
            "collections",
            "choose at least one collection, or leave collections out to search all",
        ),
        ({"question": "lift?", "top_k": 0}, AnswerError, "top_k", "from 1 to 50"),
        ({"question": "lift?", "max_tokens": 0}, AnswerError, "max_tokens", "positive integer"),
    ]
    for kwargs, error, field, message in cases:
        with pytest.raises(error) as caught:
            answer_create(workspace=workspace, **kwargs)
        assert caught.value.field == field
        assert message in str(caught.value)
    assert Answer.objects.count() == 0


def test_an_unknown_route_fails_the_answer_with_the_reason(corpus, upstream_server):
    workspace, _ = corpus
    remote_provider(upstream_server)
    with pytest.raises(RouteNotFound) as caught:
        answer_create(workspace=workspace, question="How does lift change?", route_name="fast")
    assert caught.value.field == "route"
    answer = Answer.objects.get()
    assert answer.status == Answer.Status.FAILED
    assert answer.error == str(caught.value) == "no enabled route named 'fast' (enabled routes: default)"
    assert answer.finished_at is not None
    # A reader of the stream gets the failure from the stored answer.
    assert read_stream(answer) == [("0-2", "error", {"field": None, "kind": "answer_failed", "message": answer.error})]


def test_a_route_without_usable_keys_fails_the_answer_as_unavailable(corpus, upstream_server):
    workspace, _ = corpus
    route, _ = remote_provider(upstream_server)
    UpstreamKey.objects.filter(provider=route.provider).update(status="disabled", disabled_reason="revoked")
    with pytest.raises(RouteUnavailable) as caught:
        answer_create(workspace=workspace, question="How does lift change?")
    answer = Answer.objects.get()
    assert answer.status == Answer.Status.FAILED
    assert answer.error == str(caught.value)
    assert answer.route == route  # how far it got


def test_a_key_whose_budget_is_spent_is_refused_before_anything_is_sent(corpus, upstream_server):
    workspace, _ = corpus
    _, api_key = remote_provider(upstream_server)
    Price.objects.create(model="stand-in-7b", input_usd_per_million=Decimal("1"), output_usd_per_million=Decimal("2"))
    client_key, _ = client_keys.client_key_create(
        workspace, "spent", scopes=["generate"], monthly_budget_usd=Decimal("0.00")
    )

    with pytest.raises(limits.LimitExceeded) as caught:
        answer_create(workspace=workspace, question="How does lift change?", client_key=client_key)

    assert (caught.value.code, caught.value.status) == ("budget_exhausted", 402)
    answer = Answer.objects.get()
    assert answer.status == Answer.Status.FAILED
    assert answer.error == str(caught.value)
    assert upstream_log(upstream_server, api_key) == []
    assert limits.budget_state(client_key).reserved_usd == 0


def test_a_question_that_cannot_fit_the_window_fails_naming_the_question(corpus, upstream_server):
    workspace, _ = corpus
    remote_provider(upstream_server, window=300, max_tokens=32)
    with pytest.raises(AnswerError) as caught:
        answer_create(workspace=workspace, question="Why does the lift of the wing rise? " * 30)
    assert caught.value.field == "question"
    assert "ask a shorter question" in str(caught.value)
    assert Answer.objects.get().status == Answer.Status.FAILED


def test_an_answer_is_written_once_with_its_collections_before_its_generation_is_sent(corpus, upstream_server):
    """The first question's conversation, the answer and its links in one statement, and no
    UPDATE of the answer before the message goes: a row and then its update were two commits
    (two WAL flushes) on the way to the first token, and a transaction of three INSERTs four
    round trips."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.inference.routing_helpers import queue_purge, queued_request_ids

    workspace, collection = corpus
    remote_provider(upstream_server)
    queue_purge()  # no worker takes queue remote here: the message waits there, and is removed after
    try:
        with CaptureQueriesContext(connection) as queries:
            answer = answer_create(workspace=workspace, question="How does lift change?")
        submitted = queued_request_ids()
    finally:
        queue_purge()

    writes = [
        re.findall(r'(INSERT INTO|UPDATE|DELETE FROM) "(search_\w+)"', q["sql"])
        for q in queries.captured_queries
        if (q["sql"] or "").startswith(("INSERT", "UPDATE", "DELETE", "WITH")) and '"search_' in q["sql"]
    ]
    tables = ("search_conversation", "search_answer", "search_answer_collections")
    inserted = [("INSERT INTO", table) for table in tables]
    assert writes == [inserted]
    assert submitted == [str(answer.pk)]
    stored = Answer.objects.get(pk=answer.pk)
    assert (stored.status, list(stored.collections.all())) == (Answer.Status.GENERATING, [collection])
    assert stored.created_at == answer.created_at  # when it was asked, not when it was written


def test_a_workspace_without_collections_sends_no_retrieval_statement(db, upstream_server):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.inference.routing_helpers import queue_purge, queued_request_ids

    workspace = workspace_create(name="Empty", slug="empty")
    route, _ = remote_provider(upstream_server)
    Route.objects.filter(pk=route.pk).update(abstains=False)
    queue_purge()
    try:
        with CaptureQueriesContext(connection) as queries:
            answer = answer_create(workspace=workspace, question="How does lift change?")
        assert queued_request_ids() == [str(answer.pk)]
    finally:
        queue_purge()

    assert [q["sql"] for q in queries.captured_queries if "search_chunk" in (q["sql"] or "")] == []
    assert (answer.status, answer.sources, answer.timings["retrieve_ms"] >= 0) == (Answer.Status.GENERATING, [], True)


def test_a_keys_extractive_answers_count_against_its_requests_per_minute(corpus):
    """No route: the answer is extractive, admitted against the key's limits like a
    generation (and free); the second in a minute of a key allowing one is refused, stored
    failed with the reason."""
    workspace, _ = corpus
    key, _ = client_keys.client_key_create(workspace, "one-a-minute", scopes=["generate"], requests_per_minute=1)
    first = answer_create(workspace=workspace, question="How does lift change?", client_key=key)
    assert (first.mode, first.status) == (Answer.Mode.EXTRACTIVE, Answer.Status.DONE)
    with pytest.raises(limits.LimitExceeded) as caught:
        answer_create(workspace=workspace, question="How does lift change?", client_key=key)
    assert caught.value.code == "rate_limited"
    refused = Answer.objects.exclude(pk=first.pk).get()
    assert (refused.status, refused.error) == (Answer.Status.FAILED, str(caught.value))
    assert limits.budget_state(key).reserved_usd == 0


def test_the_outcome_consumer_runs_on_the_default_queue_and_ingestion_stays_on_ingest():
    from billing import ledger
    from ragsite.celery import app

    def queue(name: str) -> str:
        return app.amqp.router.route({}, name)["queue"].name

    # The ledger's drain hands answers their outcomes (registered when the app starts).
    assert queue("billing.tasks.ledger_drain") == queue("search.tasks.answers_reap") == "default"
    assert queue("search.tasks.document_ingest") == "ingest"
    assert ledger._OUTCOME_CONSUMERS[answers.OUTCOME_KIND] is answers.generation_outcome_take


# --------------------------------------------------------------------------- finalize


def pending_answer(workspace) -> Answer:
    source = {"number": 1, "chunk_id": 5, "document_id": 6, "title": "T", "start_offset": 0, "end_offset": 9}
    return Answer.objects.create(
        workspace=workspace,
        question="q",
        status=Answer.Status.GENERATING,
        sources=[{**source, "score": 1.0}],
        stats={"context": {"strategy": "single"}},
        timings={"retrieve_ms": 1.0, "submit_ms": 2.0},
    )


def outcome_of(answer, *, status="ok", text="", stats=None, error=None, **more) -> dict:
    """An outcome as ``inference.execution.Outcome.result`` makes it, addressed to ``answer``."""
    return {
        "request_id": str(answer.pk),
        "to": {"kind": answers.OUTCOME_KIND, "answer_id": str(answer.pk)},
        "status": status,
        "text": text,
        "stats": stats or {},
        "error": error,
        **more,
    }


def test_finalize_stores_the_outcome_once(corpus):
    workspace, _ = corpus
    answer = pending_answer(workspace)
    writer = StreamWriter(str(answer.id))
    writer.write("delta", text="Yes [1]")
    writer.write("delta", text=" and [3].")
    writer.write("stats", completion_tokens=3, time_to_first_token_ms=1.5)
    stats = {"completion_tokens": 3, "time_to_first_token_ms": 1.5}

    answers.generation_outcome_take(outcome_of(answer, text="Yes [1] and [3].", stats=stats, route="default"))
    stored = Answer.objects.get(pk=answer.pk)
    assert (stored.status, stored.text, stored.error) == ("done", "Yes [1] and [3].", "")
    assert stored.citations == [
        {"number": 1, "chunk_id": 5, "document_id": 6, "title": "T", "start_offset": 0, "end_offset": 9}
    ]
    assert stored.dropped_citations == 1
    assert stored.stats == {**stats, "route": "default", "context": {"strategy": "single"}}
    assert {"retrieve_ms", "submit_ms", "ttft_ms", "queue_ms", "total_ms"} == set(stored.timings)
    assert stored.finished_at is not None
    # The stream ends with the stored answer, once.
    assert [kind for _, kind, _ in stream_events(str(answer.id))][-1] == "answer"
    # The same outcome again (an entry taken twice: its drainer died before the XACK), or
    # another one, changes nothing.
    answers.generation_outcome_take(outcome_of(answer, text="Yes [1] and [3].", stats=stats))
    answers.generation_outcome_take(outcome_of(answer, status="error", error={"message": "late"}))
    again = Answer.objects.get(pk=answer.pk)
    assert (again.status, again.text, again.finished_at) == ("done", "Yes [1] and [3].", stored.finished_at)
    assert [kind for _, kind, _ in stream_events(str(answer.id))].count("answer") == 1


def test_finalize_fails_the_answer_with_the_generations_error_and_keeps_the_partial_text(corpus):
    workspace, _ = corpus
    answer = pending_answer(workspace)
    error = {"field": None, "kind": "broken_stream", "message": "the stream from host broke after 2 tokens"}
    stored = answers.answer_finalize(
        answer_id=answer.pk,
        outcome=outcome_of(answer, status="error", text="Half [1]", error=error, route="default", attempts=1),
    )
    assert stored.status == Answer.Status.FAILED
    assert stored.error == "the stream from host broke after 2 tokens (broken_stream)"
    assert stored.text == "Half [1]" and [c["number"] for c in stored.citations] == [1]
    assert stored.stats["error"] == error and stored.stats["route"] == "default"
    assert answers.answer_finalize(answer_id=uuid.uuid4(), outcome=outcome_of(answer)) is None


def test_an_outcome_that_cannot_be_stored_fails_the_answer_and_a_transient_error_is_raised(corpus, monkeypatch):
    from django.db import OperationalError

    workspace, _ = corpus
    broken, later = pending_answer(workspace), pending_answer(workspace)

    def verify_fails(answer):
        raise KeyError("a bug")

    monkeypatch.setattr(answers, "_verify", verify_fails)
    answers.generation_outcome_take(outcome_of(broken, text="Yes [1]."))
    assert Answer.objects.filter(pk=broken.pk).values_list("status", "error").get() == (
        "failed",
        "the answer could not be stored: KeyError",
    )
    assert [kind for _, kind, _ in stream_events(str(broken.id))] == ["error"]

    def database_down(answer):
        raise OperationalError("the server closed the connection")

    monkeypatch.setattr(answers, "_verify", database_down)
    with pytest.raises(OperationalError):  # the ledger leaves the entry pending, to be claimed again
        answers.generation_outcome_take(outcome_of(later, text="Yes [1]."))
    assert Answer.objects.get(pk=later.pk).status == Answer.Status.GENERATING


def test_the_reaper_fails_answers_whose_message_was_lost_and_leaves_younger_ones(corpus):
    from datetime import timedelta

    from django.utils import timezone

    from ragsite.beat import BEAT_SCHEDULE
    from search.tasks import answers_reap

    workspace, _ = corpus
    old = timezone.now() - timedelta(seconds=answers.ANSWER_LOST_AFTER_S + 60)
    lost, young = pending_answer(workspace), pending_answer(workspace)
    Answer.objects.filter(pk=lost.pk).update(created_at=old)

    assert answers_reap.apply().get() == 1  # the beat task, run here
    statuses = {a.pk: (a.status, a.error) for a in Answer.objects.filter(pk__in=[lost.pk, young.pk])}
    assert statuses == {
        lost.pk: (
            "failed",
            "the generation never ended: no outcome came in 60 minutes (its message was lost before a worker ran it)",
        ),
        young.pk: ("generating", ""),
    }
    assert [kind for _, kind, _ in stream_events(str(lost.id))] == ["error"]
    # An outcome that comes after all leaves the failed answer as it is.
    answers.generation_outcome_take(outcome_of(lost, text="Late [1]."))
    assert Answer.objects.get(pk=lost.pk).text == ""
    assert BEAT_SCHEDULE["answers-reap"]["task"] == "search.tasks.answers_reap"


# --------------------------------------------------------------------------- extractive


def test_without_a_route_the_answer_is_extractive_streamed_and_done_at_once(corpus, asker):
    workspace, collection = corpus
    question = "How long does charging take?"
    answer = answer_create(workspace=workspace, question=question, asker=asker)

    assert answer.mode == Answer.Mode.EXTRACTIVE
    assert answer.status == Answer.Status.DONE
    assert answer.finished_at is not None and answer.error == ""
    assert answer.client_id == f"user:{asker.pk}"
    assert list(answer.collections.all()) == [collection]
    hits = hits_for(workspace, question)
    assert [(s["number"], s["chunk_id"], s["document_id"]) for s in answer.sources] == [
        (number, hit.chunk_id, hit.document_id) for number, hit in enumerate(hits, start=1)
    ]
    lines = answer.text.split("\n")
    assert lines[:2] == [LEAD, ""]
    robot_id = Document.objects.get(source_name="robot.md").pk
    robot = next(s["number"] for s in answer.sources if s["document_id"] == robot_id)
    assert lines[2] == f"- Charging takes 90 minutes. [{robot}]"
    texts = {s["number"]: Chunk.objects.get(pk=s["chunk_id"]).text for s in answer.sources}
    for line in lines[2:]:
        sentence, _, marker = line.removeprefix("- ").rpartition(" [")
        number = int(marker.rstrip("]"))
        assert sentence in texts[number]  # quoted verbatim from the source it cites
    assert [c["number"] for c in answer.citations] == list(
        dict.fromkeys(int(line.rpartition("[")[2].rstrip("]")) for line in lines[2:])
    )
    for citation in answer.citations:
        source = answer.sources[citation["number"] - 1]
        assert (citation["chunk_id"], citation["document_id"]) == (source["chunk_id"], source["document_id"])
    assert answer.dropped_citations == 0
    assert set(answer.timings) == {"retrieve_ms", "prompt_ms", "total_ms"}

    events = read_stream(answer)
    # The generation protocol (nothing here is unverified: sentences only), then the stored answer.
    assert [kind for _, kind, _ in events] == ["sentence"] * len(lines) + ["stats", "answer"]
    assert shown(events) == answer.text
    assert events[-2][2] == answer.stats
    assert events[-1][2] == answers.answer_record(answer)
    assert (answer.abstained, answer.grounded) == (False, 1.0)
    assert answer.stats["mode"] == "extractive" and answer.stats["sentences"] == len(lines) - 2


def test_an_extractive_answer_over_no_documents_says_so(db):
    workspace = workspace_create(name="Empty", slug="empty")
    answer = answer_create(workspace=workspace, question="Anything?")
    assert (answer.mode, answer.status, answer.sources, answer.citations) == ("extractive", "done", [], [])
    assert answer.text == "The searched collections hold no passage that matches the question."


def test_an_answer_a_request_started_records_the_time_from_the_request_to_its_row(db, client):
    workspace = workspace_create(name="Empty", slug="empty")
    token = request_received_var.set(time.time() - 0.25)  # as the middleware sets it
    try:
        started = time.time()
        during = answer_create(workspace=workspace, question="Anything?")
        took_ms = (time.time() - started) * 1000
    finally:
        request_received_var.reset(token)
    assert 250 <= during.timings["request_ms"] <= 250 + took_ms
    assert Answer.objects.get(pk=during.pk).timings["request_ms"] == during.timings["request_ms"]
    assert "request_ms" not in answer_create(workspace=workspace, question="Anything?").timings  # no request

    # Through the middleware: the stamp is the request's own, and it is gone after it.
    user = get_user_model().objects.create_user("ann")
    Membership.objects.create(workspace=workspace, user=user)
    client.force_login(user)
    started = time.time()
    assert client.post("/ask/", {"q": "Anything at all?"}).status_code == 302
    took_ms = (time.time() - started) * 1000
    asked = Answer.objects.get(question="Anything at all?")
    assert 0 <= asked.timings["request_ms"] <= took_ms
    assert request_received_var.get() is None


# --------------------------------------------------------------------------- with workers


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory):
    """One worker per queue an answer uses, shared by the module's end-to-end tests:
    ``remote`` (threads), ``gpu`` and ``default`` (finalize)."""
    path = tmp_path_factory.mktemp("answer-workers")
    with django_db_blocker.unblock():
        with (
            celery_worker(["remote"], path, pool="threads", concurrency=4) as remote,
            celery_worker(["gpu"], path, pool="threads", concurrency=4) as gpu,
            celery_worker(["default"], path) as default,
        ):
            yield {"remote": remote, "gpu": gpu, "default": default}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_answer_end_to_end_on_a_gpu_pool(workers, corpus, asker, ngram_pool):
    workspace, _ = corpus
    provider = Provider.objects.create(name="pool", **{**ngram_pool.provider_fields(), "context_window": 512})
    # An untrained model: its text is supported by no passage, and this test follows the
    # generation, so the route generates and stores it whatever the check finds.
    route = Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=16, abstains=False)
    question = "the wing lift and the heat flux"

    answer = answer_create(workspace=workspace, question=question, asker=asker)
    assert (answer.status, answer.mode, answer.route, answer.arm) == ("generating", "generated", route, "")
    events = read_stream(answer)
    stored = wait_for_answer(answer.pk)

    assert [kind for _, kind, _ in events][-2:] == ["stats", "answer"], events[-2:]
    assert stored.status == Answer.Status.DONE, stored.error
    # The stream has the text as generated; the stored answer is that text with its citations
    # checked (markers naming no source removed, citations moved or added where a passage supports a sentence).
    assert stored.verification["original_text"] == deltas(events) != ""
    assert shown(events) == stored.text  # what a reader was shown, sentence by sentence, is what is stored
    assert events[-1][2] == answers.answer_record(stored)
    assert not stored.abstained
    hits = hits_for(workspace, question)
    assert [(s["number"], s["chunk_id"], s["document_id"]) for s in stored.sources] == [
        (number, hit.chunk_id, hit.document_id) for number, hit in enumerate(hits, start=1)
    ]
    given = {s["chunk_id"] for s in stored.sources}
    assert all(c["chunk_id"] in given for c in stored.citations)
    # The prompt was counted with the model's own tokenizer: exactly what the engine prefilled.
    context = stored.stats["context"]
    assert context["counter"] == f"tokenizer:{ngram_pool.model}"
    assert stored.stats["prompt_tokens"] == context["prompt_tokens"][0]
    assert stored.stats["completion_tokens"] == 16
    assert stored.stats["draft_tokens_proposed"] >= stored.stats["draft_tokens_accepted"] >= 0
    assert stored.stats["speculative"]["spec_tokens"] == 4
    assert {"retrieve_ms", "prompt_ms", "submit_ms", "ttft_ms", "total_ms"} <= set(stored.timings)
    assert 0 < stored.timings["ttft_ms"] <= stored.timings["total_ms"]
    record = ledger_row(answer.pk)
    assert (record.status, record.workspace_id, record.user_id) == ("ok", workspace.pk, asker.pk)
    assert record.route_id == route.pk


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_answer_end_to_end_on_an_openai_compatible_upstream_with_citations(workers, corpus, asker, upstream_server):
    workspace, _ = corpus
    route, api_key = remote_provider(upstream_server, max_tokens=64)
    question = f"How do lift and heat flux behave at the wing and the nose?\nREPLY: {CITED}"
    price = Price.objects.create(
        model="stand-in-7b", input_usd_per_million=Decimal("0.5"), output_usd_per_million=Decimal("1.5")
    )
    client_key, _ = client_keys.client_key_create(
        workspace, "integration", scopes=["generate"], monthly_budget_usd=Decimal(1)
    )

    answer = answer_create(
        workspace=workspace, question=question, asker=asker, client_id="key-7", client_key=client_key
    )
    events = read_stream(answer)
    stored = wait_for_answer(answer.pk)

    assert stored.status == Answer.Status.DONE, stored.error
    assert deltas(events) == stored.verification["original_text"] == CITED
    assert shown(events) == stored.text
    # [9] names no source (the prompt gave three): the check took it out of the stored text,
    # and each sentence is supported by the passage it cites.
    assert stored.text == VERIFIED
    assert [(c["start"], c["end"], c["citations"], c["action"]) for c in stored.verification["sentences"]] == [
        (0, 36, [1], "kept"),
        (37, 63, [2], "kept"),
    ]
    assert (stored.verification["removed_markers"], stored.grounded, stored.abstained) == (1, 1.0, False)
    assert events[-1] == (events[-1][0], "answer", answers.answer_record(stored))
    assert stored.client_id == "key-7"
    hits = hits_for(workspace, question)
    assert len(hits) == 3
    assert [(s["number"], s["chunk_id"]) for s in stored.sources] == [(n, h.chunk_id) for n, h in enumerate(hits, 1)]
    by_number = {s["number"]: s for s in stored.sources}
    assert stored.citations == [
        {
            "number": n,
            "chunk_id": by_number[n]["chunk_id"],
            "document_id": by_number[n]["document_id"],
            "title": by_number[n]["title"],
            "start_offset": by_number[n]["start_offset"],
            "end_offset": by_number[n]["end_offset"],
        }
        for n in (1, 2)
    ]
    assert stored.dropped_citations == 1  # [9]: the prompt gave three sources
    # What the upstream received is the prompt built from those sources, under the budget.
    [seen] = upstream_log(upstream_server, api_key)
    sources = [Source.from_record(s, Chunk.objects.get(pk=s["chunk_id"]).text) for s in stored.sources]
    messages = answer_messages(stored.question, sources)
    assert seen["prompt_tokens"] == sum(len(m["content"].split()) for m in messages)
    assert seen["max_tokens"] == 64 and seen["outcome"] == "ok"
    assert stored.stats["context"]["prompt_tokens"] == [RemoteEstimate().messages(messages)]
    assert stored.stats["completion_tokens"] == len(CITED.split())
    assert stored.stats["provider"] == route.provider.name and stored.stats["attempts"] == 1
    record = ledger_row(answer.pk)
    assert (record.status, record.completion_tokens) == ("ok", len(CITED.split()))
    # Billed to the API key, and its budget's reservation settled to the real cost.
    assert (record.client_key_id, record.price_id) == (client_key.pk, price.pk)
    assert record.cost_usd == cost_of(record.prompt_tokens, record.completion_tokens, price)
    state = limits.budget_state(client_key)
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (record.cost_usd, 0, 0)


def _files_by_number(answer: Answer) -> dict[int, str]:
    names = dict(Document.objects.values_list("pk", "source_name"))
    return {source["number"]: names[source["document_id"]] for source in answer.sources}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_misattributed_sentence_is_reattributed_and_an_unsupported_one_withheld(workers, corpus, upstream_server):
    workspace, _ = corpus
    remote_provider(upstream_server, max_tokens=64)
    reply = (
        "Heat flux at the nose of a blunt body is given by the stagnation point formula [2]. "
        "The wing is painted blue and weighs two tons [1]."
    )
    question = f"How do lift and heat flux behave at the wing and the nose?\nREPLY: {reply}"

    answer = answer_create(workspace=workspace, question=question)
    events = read_stream(answer)
    stored = wait_for_answer(answer.pk)

    assert stored.status == Answer.Status.DONE, stored.error
    files = _files_by_number(stored)
    assert (files[1], files[2]) == ("heat.md", "wing.md")
    assert deltas(events) == stored.verification["original_text"] == reply
    assert shown(events) == stored.text
    # What the check withheld reaches no reader: not in the text, nor in the stream's stats.
    assert all("painted blue" not in json.dumps(data) for _, kind, data in events if kind != "delta")
    # The first sentence is the heat passage's, not the wing's: its marker moves there. Nothing
    # supports the second: it is withheld from the answer, and kept, with why, in its verification.
    assert stored.text == "Heat flux at the nose of a blunt body is given by the stagnation point formula [1]."
    assert [(c["citations"], c["action"], c["supported"]) for c in stored.verification["sentences"]] == [
        ([1], "reattributed", True),
    ]
    assert [(w["text"], w["action"], w["position"]) for w in stored.verification["withheld"]] == [
        ("The wing is painted blue and weighs two tons [1].", "unsupported", 1)
    ]
    assert (stored.mode, stored.grounded, stored.abstained) == ("generated", 0.5, False)
    assert events[-1][2] == answers.answer_record(stored)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_route_cited_by_verification_gets_plain_sources_and_its_sentences_their_markers(
    workers, corpus, upstream_server
):
    workspace, _ = corpus
    route, api_key = remote_provider(upstream_server, max_tokens=64)
    Route.objects.filter(pk=route.pk).update(citing=Route.Citing.VERIFIER, system_prompt="Answer in one sentence:")
    reply = "Lift rises with the angle of attack until the wing stalls."
    question = f"When does the wing stall?\nREPLY: {reply}"

    answer = answer_create(workspace=workspace, question=question)
    stored = wait_for_answer(answer.pk)

    assert stored.status == Answer.Status.DONE, stored.error
    wing = {file: number for number, file in _files_by_number(stored).items()}["wing.md"]
    assert stored.text == f"{reply.removesuffix('.')} [{wing}]."
    assert [(c["citations"], c["action"]) for c in stored.verification["sentences"]] == [([wing], "added")]
    # The upstream got the instructions with the sources as plain text, and the question alone.
    sources = [Source.from_record(s, Chunk.objects.get(pk=s["chunk_id"]).text) for s in stored.sources]
    messages = answer_messages(question, sources, "Answer in one sentence:", citing="verifier")
    context = "\n\n".join(f"{source.title}\n{source.text}" for source in sources)
    assert messages == [
        {"role": "system", "content": f"Answer in one sentence:\n\n{context}"},
        {"role": "user", "content": question},
    ]
    [seen] = upstream_log(upstream_server, api_key)
    assert seen["prompt_tokens"] == sum(len(m["content"].split()) for m in messages)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_generated_answer_that_nothing_supports_is_answered_with_the_sources_own_sentences(
    workers, corpus, upstream_server
):
    workspace, _ = corpus
    remote_provider(upstream_server, max_tokens=64)
    reply = "The moon is made of green cheese [1]."
    question = f"When does the wing stall?\nREPLY: {reply}"

    answer = answer_create(workspace=workspace, question=question)
    events = read_stream(answer)
    stored = wait_for_answer(answer.pk)

    assert stored.status == Answer.Status.DONE, stored.error
    wing = {file: number for number, file in _files_by_number(stored).items()}["wing.md"]
    # Retrieval found the answer; the model did not say it. The answer quotes the sources (and
    # says so) rather than claim they do not answer.
    assert stored.text.split("\n")[0] == answers.QUOTED_LEAD
    assert f"- Lift rises with the angle of attack until the wing stalls. [{wing}]" in stored.text.split("\n")
    assert (stored.mode, stored.abstained, stored.grounded) == ("extractive", False, 1.0)
    assert [c["number"] for c in stored.citations][:1] == [wing]
    assert stored.verification["original_text"] == deltas(events) == reply
    assert (stored.verification["replaced_by"], stored.verification["sentences"]) == ("extractive", [])
    # Nothing the model said was shown: the quoted sentences came whole, with the stored answer.
    assert shown(events) == stored.text and stored.verification["streamed_chars"] == 0
    assert stored.stats["quoted_instead"]["why"] == "nothing in the model's answer was supported by its sources"
    assert events[-1][2] == answers.answer_record(stored)
    # What the model generated is billed all the same.
    record = ledger_row(answer.pk)
    assert (record.status, record.completion_tokens) == ("ok", len(reply.split()))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_follow_up_is_generated_with_the_turns_before_it_each_turn_billed_once(workers, db, upstream_server):
    # At the defaults (FOLLOWUP_REWRITE off) a follow-up is read by its terms, even with a route.
    from search.answering.conversations import text_without_markers
    from tests.search.answering.test_conversations import FIRST, FOLLOW_UP, TRAVEL

    workspace = workspace_create(name="Travel", slug="travel")
    ingest(collection_create(workspace=workspace, name="Handbook"), TRAVEL)
    _, api_key = remote_provider(upstream_server, max_tokens=64)
    first = answer_create(workspace=workspace, question=f"{FIRST}\nREPLY: It is a daily amount for trips [1].")
    read_stream(first)
    first = wait_for_answer(first.pk)
    assert first.status == Answer.Status.DONE, first.error
    follow = answer_create(
        workspace=workspace,
        question=f"{FOLLOW_UP}\nREPLY: It is EUR 90 a day in Berlin [1].",
        conversation=first.conversation,
    )
    read_stream(follow)
    follow = wait_for_answer(follow.pk)
    assert follow.status == Answer.Status.DONE, follow.error

    # Retrieved for with the earlier question's words, and answered from the per-diem passage.
    assert follow.stats["followup"] == {"method": "terms", "query": f"{first.question} {follow.question}"}
    assert _files_by_number(follow)[1] == "per_diem.md"
    assert follow.text == "It is EUR 90 a day in Berlin [1]."
    # The prompt: the instructions, the earlier turn (its answer without its markers), then
    # the sources and the follow-up.
    seen_first, seen_follow = upstream_log(upstream_server, api_key)
    assert [m["role"] for m in seen_first["messages"]] == ["system", "user"]
    assert seen_follow["messages"][1:3] == [
        {"role": "user", "content": first.question},
        {"role": "assistant", "content": text_without_markers(first.text)},
    ]
    assert [m["role"] for m in seen_follow["messages"]] == ["system", "user", "assistant", "user"]
    assert seen_follow["messages"][3]["content"].endswith(f"Question: {follow.question}")
    assert follow.stats["context"]["history_turns"] == 1 and follow.stats["context"]["history_left_out"] == 0
    # One ledger row per generation, one generation per turn.
    assert [ledger_row(answer.pk).status for answer in (first, follow)] == ["ok", "ok"]
    assert UsageRecord.objects.filter(request_id__in=[first.pk, follow.pk]).count() == 2
    assert UsageRecord.objects.filter(workspace=workspace, kind=UsageRecord.Kind.GENERATION).count() == 2


def _travel_conversation(upstream_server, client_key=None):
    """A Travel workspace behind the stand-in, and its first question answered."""
    from tests.search.answering.test_conversations import FIRST, TRAVEL

    workspace = workspace_create(name="Travel", slug="travel")
    ingest(collection_create(workspace=workspace, name="Handbook"), TRAVEL)
    _, api_key = remote_provider(upstream_server, max_tokens=64)
    first = answer_create(
        workspace=workspace, question=f"{FIRST}\nREPLY: It is a daily amount for trips [1].", client_key=client_key
    )
    read_stream(first)
    return workspace, api_key, wait_for_answer(first.pk)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_with_a_route_a_follow_up_is_rewritten_by_its_model_and_the_rewrite_billed_as_its_own_row(
    workers, db, upstream_server, settings
):
    settings.FOLLOWUP_REWRITE = True
    from search.answering.conversations import Turn, text_without_markers
    from search.answering.rewriting import REWRITE_MAX_TOKENS, rewrite_messages
    from tests.search.answering.test_conversations import FOLLOW_UP

    standalone = "What is the per-diem allowance in Berlin?"
    price = Price.objects.create(
        model="stand-in-7b", input_usd_per_million=Decimal("0.5"), output_usd_per_million=Decimal("1.5")
    )
    workspace = workspace_create(name="Keys", slug="keys")
    client_key, _ = client_keys.client_key_create(workspace, "chat", scopes=["generate"], monthly_budget_usd=Decimal(1))
    travel, api_key, first = _travel_conversation(upstream_server, client_key=None)
    client_key.workspace = travel  # billed to a key of the travel workspace
    client_key.save()
    upstream_script(upstream_server, api_key, [{"reply": f" {standalone}\n"}])  # the next request: the rewrite
    follow = answer_create(
        workspace=travel,
        question=f"{FOLLOW_UP}\nREPLY: It is EUR 90 a day in Berlin [1].",
        conversation=first.conversation,
        client_key=client_key,
    )
    read_stream(follow)
    follow = wait_for_answer(follow.pk)

    assert follow.status == Answer.Status.DONE, follow.error
    assert follow.retrieval_query == standalone
    assert follow.stats["followup"] == {
        "method": "model",
        "query": standalone,
        "rewrite_ms": follow.timings["rewrite_ms"],
    }
    assert _files_by_number(follow)[1] == "per_diem.md"
    _, rewrite, answered = upstream_log(upstream_server, api_key)
    history = [Turn(question=first.question, answer=text_without_markers(first.text))]
    assert rewrite["messages"] == rewrite_messages(follow.question, history)
    assert (rewrite["max_tokens"], rewrite["temperature"], rewrite["outcome"]) == (REWRITE_MAX_TOKENS, 0, "ok")
    assert answered["messages"][-1]["content"].endswith(f"Question: {follow.question}")
    # Two generations for the key, each its own ledger row, and the budget holds their sum.
    ledger_row(follow.pk)
    rows = list(UsageRecord.objects.filter(client_key=client_key).order_by("created_at"))
    assert [(row.status, row.completion_tokens) for row in rows] == [
        ("ok", len(standalone.split())),
        ("ok", len("It is EUR 90 a day in Berlin [1].".split())),
    ]
    assert rows[1].request_id == follow.pk and rows[0].request_id != follow.pk
    assert all(row.price_id == price.pk for row in rows)
    state = limits.budget_state(client_key)
    assert (state.spent_usd, state.reserved_usd) == (sum(row.cost_usd for row in rows), 0)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("step", "reason"),
    [
        ({"status": 400}, "the rewrite failed: "),
        ({"first_byte_delay_ms": 3000}, "the rewrite took longer than 0.5 s"),
        ({"reply": "Line one.\nLine two."}, "the rewrite was 2 lines, not one question"),
        ({"reply": "The answer to this question is yes."}, "the rewrite keeps none of the follow-up's words"),
    ],
    ids=["fails", "late", "not-a-question", "an-answer"],
)
def test_a_rewrite_that_fails_falls_back_to_the_terms_and_says_why(
    workers, db, upstream_server, settings, step, reason
):
    from tests.search.answering.test_conversations import FIRST, FOLLOW_UP

    settings.FOLLOWUP_REWRITE, settings.FOLLOWUP_REWRITE_TIMEOUT_S = True, 0.5
    _, api_key, first = _travel_conversation(upstream_server)
    upstream_script(upstream_server, api_key, [step])
    follow = answer_create(
        workspace=first.workspace,
        question=f"{FOLLOW_UP}\nREPLY: It is EUR 90 a day in Berlin [1].",
        conversation=first.conversation,
    )
    read_stream(follow)
    follow = wait_for_answer(follow.pk)
    assert follow.status == Answer.Status.DONE, follow.error
    followup = follow.stats["followup"]
    assert (followup["method"], followup["query"]) == ("terms", f"{first.question} {follow.question}")
    assert followup["fallback"].startswith(reason) and followup["rewrite_ms"] == follow.timings["rewrite_ms"]
    assert _files_by_number(follow)[1] == "per_diem.md"
    assert FIRST in follow.retrieval_query
    # The rewrite was sent all the same: it has its ledger row (a late one once it ends).
    deadline = time.monotonic() + 30
    while len(upstream_log(upstream_server, api_key)) < 3 or not all(
        entry["finished"] for entry in upstream_log(upstream_server, api_key)
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ledger_row(follow.pk)
    generations = UsageRecord.objects.filter(workspace=first.workspace, kind=UsageRecord.Kind.GENERATION)
    assert generations.count() == 3


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_failed_generation_fails_the_answer_with_the_reason(workers, corpus, upstream_server):
    from tests.upstream_server import upstream_script

    workspace, _ = corpus
    _, api_key = remote_provider(upstream_server)
    upstream_script(upstream_server, api_key, [{"status": 400, "repeat": True}])
    answer = answer_create(workspace=workspace, question="How does lift change?")
    events = read_stream(answer)
    stored = wait_for_answer(answer.pk)
    assert events[-1][1] == "error"
    assert stored.status == Answer.Status.FAILED
    assert stored.error.startswith(events[-1][2]["message"])
    assert stored.stats["error"]["kind"] == "bad_request"
    assert stored.text == "" and stored.citations == []
    assert ledger_row(answer.pk).status == "error"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_only_the_chunks_that_fit_a_small_window_are_sent(workers, db, upstream_server):
    workspace = workspace_create(name="Small", slug="small")
    collection = collection_create(workspace=workspace, name="Notes")
    sentence = "The wing lift rises with the angle of attack at low speed. "
    ingest(collection, {f"note{i}.md": f"# Note {i}\n\n" + sentence * (4 + 2 * i) for i in range(4)})
    route, api_key = remote_provider(upstream_server, window=700, max_tokens=64)
    question = "How does the wing lift rise?"

    answer = answer_create(workspace=workspace, question=question)
    read_stream(answer)
    stored = wait_for_answer(answer.pk)

    assert stored.status == Answer.Status.DONE, stored.error
    context = stored.stats["context"]
    hits = hits_for(workspace, question)
    given = [s["chunk_id"] for s in stored.sources]
    left_out = [item["chunk_id"] for item in context["left_out"]]
    assert given and left_out
    assert sorted(given + left_out) == sorted(h.chunk_id for h in hits)  # each retrieved chunk: given or left out
    assert given == [h.chunk_id for h in hits if h.chunk_id in given]  # in rank order
    budget = prompt_budget_for(route)
    texts = {h.chunk_id: h for h in hits}

    def as_source(number, chunk_id):
        hit = texts[chunk_id]
        return Source(number, chunk_id, hit.document_id, hit.document_title, hit.text, 0, 0, hit.score)

    sent = [as_source(n, chunk_id) for n, chunk_id in enumerate(given, 1)]
    counted = RemoteEstimate().messages(answer_messages(question, sent))
    assert context["prompt_tokens"] == [counted]
    assert counted <= budget.prompt_limit and counted + budget.max_tokens <= 700
    for chunk_id in left_out:  # none of those left out would have fit beside the ones sent
        with_it = answer_messages(question, [*sent, as_source(len(sent) + 1, chunk_id)])
        assert RemoteEstimate().messages(with_it) > budget.prompt_limit
    [seen] = upstream_log(upstream_server, api_key)
    assert seen["prompt_tokens"] == sum(len(m["content"].split()) for m in answer_messages(question, sent))
    assert seen["prompt_tokens"] + seen["max_tokens"] <= 700


BIG = (
    "Wing lift depends on the angle of attack and on the airspeed over the upper surface. "
    "At small angles the lift coefficient grows almost linearly with the angle. "
    "Near the critical angle the boundary layer separates from the upper surface and the wing stalls. "
    "Flaps and slats raise the maximum lift coefficient for take-off and landing. "
    "Vortex generators delay separation by mixing energetic air into the boundary layer. "
    "Swept wings stall first at the tips unless washout or fences are used. "
    "Ground effect reduces induced drag when the wing flies within one span of the ground. "
    "Ice on the leading edge lowers the stall angle by several degrees. "
    "The lift curve slope of a thin airfoil is two pi per radian in theory. "
    "Real wings of finite span have a lower slope because of the downwash from the tip vortices. "
)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_source_larger_than_the_window_is_answered_by_map_reduce(workers, db, upstream_server):
    workspace = workspace_create(name="Big", slug="big")
    collection = collection_create(workspace=workspace, name="Reports")
    ingest(collection, {"lift.md": "# Lift report\n\n" + BIG, "robot.md": DOCUMENTS["robot.md"]})
    route, api_key = remote_provider(upstream_server, window=512, max_tokens=64)
    reply = "The wing stalls when the boundary layer separates near the critical angle [1]."
    question = f"When does the wing stall and lose lift?\nREPLY: {reply}"

    answer = answer_create(workspace=workspace, question=question)
    context = answer.stats["context"]
    assert context["strategy"] == "map_reduce"
    maps = answer.stats["map_reduce"]["maps"]
    assert len(maps) >= 2
    events = read_stream(answer)
    stored = wait_for_answer(answer.pk)

    assert stored.status == Answer.Status.DONE, stored.error
    assert stored.text == deltas(events) == reply == shown(events)
    # Progress while the maps ran (the collects may finish in any order: the counts still
    # rise one by one), then the reduce's own generation.
    progress = [(data["stage"], data["done"], data["total"]) for _, kind, data in events if kind == "progress"]
    assert progress == [("map", done, len(maps)) for done in range(len(maps) + 1)]
    kinds = [kind for _, kind, _ in events]
    assert kinds[: len(progress)] == ["progress"] * len(progress) and kinds[-2:] == ["stats", "answer"]
    lift = next(s for s in stored.sources if s["title"] == "Lift report")
    assert lift["number"] == 1
    assert stored.citations == [
        {
            "number": 1,
            "chunk_id": lift["chunk_id"],
            "document_id": lift["document_id"],
            "title": "Lift report",
            "start_offset": lift["start_offset"],
            "end_offset": lift["end_offset"],
        }
    ]
    assert stored.dropped_citations == 0
    state = stored.stats["map_reduce"]
    assert [item["status"] for item in state["maps"]] == ["ok"] * len(maps)
    assert all(item["note"] == reply for item in state["maps"])  # the stand-in says the same to every map
    assert state["reduce"]["notes_dropped"] == 0
    # The upstream saw the map requests (notes of note_tokens), then the reduce request.
    seen = upstream_log(upstream_server, api_key)
    assert [entry["max_tokens"] for entry in seen] == [context["note_tokens"]] * len(maps) + [64]
    assert seen[-1]["time"] >= max(entry["finished"] for entry in seen[:-1])
    for entry, tokens in zip(seen[:-1], context["prompt_tokens"], strict=True):
        assert entry["prompt_tokens"] + entry["max_tokens"] <= 512  # never over the window
        assert tokens + entry["max_tokens"] + prompt_budget_for(route).margin <= 512
    assert seen[-1]["prompt_tokens"] + 64 <= 512
    # Every request is on the ledger: the maps under their own ids, the reduce under the answer's.
    generations = UsageRecord.objects.filter(kind=UsageRecord.Kind.GENERATION)
    assert set(generations.values_list("request_id", flat=True)) == {uuid.UUID(item["request_id"]) for item in maps} | {
        answer.pk
    }


@pytest.mark.django_db(transaction=True)  # the async reader's queries run on another thread's connection
def test_the_async_reader_yields_what_the_sync_reader_yields(corpus):
    import asyncio

    workspace, _ = corpus
    answer = answer_create(workspace=workspace, question="How does lift change with the angle of attack?")

    async def read_all():
        return await read_all_of(answer.pk)

    assert answer.status == Answer.Status.DONE  # extractive: no route
    assert asyncio.run(read_all()) == list(answer_stream_read(answer))
    # An answer that never streamed is replayed from its stored record.
    failed = pending_answer(workspace)
    answer_fail(failed.pk, "the upstream refused the request")
    assert asyncio.run(read_all_of(failed.pk)) == [
        ("0-2", "error", {"field": None, "kind": "answer_failed", "message": "the upstream refused the request"})
    ]


async def read_all_of(answer_id):
    from asgiref.sync import sync_to_async
    from django.db import connections

    from search.answering.answers import answer_stream_aread

    events = [event async for event in answer_stream_aread(answer_id)]
    await sync_to_async(connections.close_all)()  # the reader's thread's connection, as a request's end does
    return events
