"""Fault injection with real processes (GitHub issue 8): each fault an automated test.

Real Celery workers and a uvicorn web process (tests/conftest.py), the session's own
PostgreSQL and Redis stopped and started in place (tests/reliability/conftest.py), the
OpenAI-protocol stand-in for upstreams (tests/upstream_server.py), SIGKILL for kill -9.

Covered elsewhere and not repeated here:

- a killed ingest *pool process* (the worker's parent re-queues the task,
  ``reject_on_worker_lost``): tests/search/test_ingest_worker.py;
- a killed generation *pool process* (the parent ends the stream, queues the ledger row
  through ``inference.execution.lost_generation_end``, the answer fails ``worker_lost``):
  tests/search/answering/test_answers.py::test_a_generation_whose_process_dies_fails_the_answer_and_is_still_billed
  and tests/inference/test_isolation.py.

Here the whole worker dies (SIGKILL to its process group, parent included: nobody is left
to re-queue or to end anything) and a new worker takes over; the broker's visibility
timeout is lowered for these workers (``CELERY_VISIBILITY_TIMEOUT``) so that the message of
the vanished worker comes back within the test rather than after an hour.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from billing import client_keys, ledger
from billing.models import UsageRecord
from inference.models import Provider, Route
from inference.streams import stream_events, stream_read
from ragsite.redis import Role, redis_client
from search.answering.answers import answer_create
from search.models import Answer, Chunk, Document
from search.services import collection_create, document_create, workspace_create
from tests.frontdoors.api.conftest import DOCUMENTS
from tests.inference.routing_helpers import key_make, provider_make
from tests.polling import wait_for
from tests.search.files import ingest_texts
from tests.search.test_ingest_worker import long_text
from tests.upstream_server import upstream_log, upstream_script

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# Workers whose unacknowledged messages come back 20 s after delivery (the hard time limit
# must stay below it: settings refuse otherwise).
QUICK_REDELIVERY = {
    "CELERY_TASK_SOFT_TIME_LIMIT": "15",
    "CELERY_TASK_TIME_LIMIT": "18",
    "CELERY_VISIBILITY_TIMEOUT": "20",
}


def kill_group(worker) -> None:
    """kill -9 of the worker's whole process group (parent and pool), and reap it."""
    os.killpg(worker.process.pid, signal.SIGKILL)
    worker.process.wait(timeout=30)


# --------------------------------------------------------------------------- ingest worker killed whole


def test_an_ingest_worker_killed_whole_mid_document_completes_it_once_after_a_restart(start_worker, settings):
    from search.ingest import pipeline

    text = long_text(400, seed=8).encode()
    workspace = workspace_create(name="Acme", slug="acme")
    clean_collection = collection_create(workspace=workspace, name="Clean")
    collection = collection_create(workspace=workspace, name="Killed")
    # The reference: the same text ingested here, with nothing killed.
    clean, _ = document_create(collection=clean_collection, source_name="long.txt", content=text, enqueue=False)
    pipeline.document_ingest(document_id=clean.pk)
    clean.refresh_from_db()
    assert clean.status == "indexed" and clean.chunks_total > 20

    # A whole document is one task: its limit is the time to embed 400 paragraphs after the new
    # worker has loaded its model, which on a slow 2-core machine is more than QUICK_REDELIVERY's.
    env = {
        "MEDIA_ROOT": str(settings.MEDIA_ROOT),
        "CELERY_TASK_SOFT_TIME_LIMIT": "45",
        "CELERY_TASK_TIME_LIMIT": "50",
        "CELERY_VISIBILITY_TIMEOUT": "55",
    }
    with start_worker(["ingest"], env=env) as first:
        document, created = document_create(collection=collection, source_name="long.txt", content=text)
        assert created
        progress = wait_for(
            lambda: (d := Document.objects.get(pk=document.pk)).status == "embedding" and d,
            120,
            lambda: f"the worker never started embedding: {Document.objects.get(pk=document.pk).status}",
        )
        kill_group(first)
        killed_at = time.monotonic()
    assert not psutil.pid_exists(first.process.pid)
    at_kill = Document.objects.get(pk=document.pk)
    assert at_kill.status == "embedding", "the kill came too late: the document was already finished"

    with start_worker(["ingest"], env=env) as second:
        final = wait_for(
            lambda: (d := Document.objects.get(pk=document.pk)).status in ("indexed", "failed") and d,
            180,
            lambda: f"the document was not finished by the new worker:\n{second.log()[-3000:]}",
        )
        recovered_s = time.monotonic() - killed_at
    assert final.status == "indexed", final.error
    assert final.attempts == 2  # the vanished worker's delivery, then the new worker's
    rows = list(Chunk.objects.filter(document=document).order_by("ordinal").values_list("ordinal", "text"))
    clean_rows = list(Chunk.objects.filter(document=clean).order_by("ordinal").values_list("ordinal", "text"))
    assert final.chunks_total == clean.chunks_total == len(rows)
    assert [ordinal for ordinal, _ in rows] == list(range(clean.chunks_total))  # no duplicate, no gap
    assert [text for _, text in rows] == [text for _, text in clean_rows]
    print(f"\ningest: killed at {progress.chunks_embedded}/{progress.chunks_total}, indexed {recovered_s:.1f} s later")


# --------------------------------------------------------------------------- gpu worker killed whole mid-answer


@pytest.fixture
def corpus():
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(collection, DOCUMENTS)
    return workspace


def final_answer(answer_id, timeout: float = 60) -> Answer:
    return wait_for(
        lambda: (a := Answer.objects.get(pk=answer_id)).status in (Answer.Status.DONE, Answer.Status.FAILED) and a,
        timeout,
        lambda: f"answer {answer_id} still {Answer.objects.get(pk=answer_id).status}",
    )


def test_a_gpu_worker_killed_whole_mid_answer_fails_the_answer_with_its_ledger_row(start_worker, corpus, ngram_pool):
    provider = Provider.objects.create(name="pool", **ngram_pool.provider_fields())
    Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=1500)

    with start_worker(["gpu"], pool="threads", concurrency=4, env=QUICK_REDELIVERY) as first:
        answer = answer_create(workspace=corpus, question="the wing lift and the heat flux")
        events = stream_read(str(answer.pk), block_ms=60000)
        first_event = next(events)  # a token: the worker is streaming it from the engine
        assert first_event[1] == "delta"
        kill_group(first)
        killed_at = time.monotonic()
    streamed_at_kill = [data["text"] for _, kind, data in stream_events(str(answer.pk)) if kind == "delta"]
    assert Answer.objects.get(pk=answer.pk).status == Answer.Status.GENERATING  # nobody was left to end it

    # The message of the vanished worker comes back to the new one, which ends the stream and
    # queues the ledger row instead of generating a second answer; the link stores the answer.
    with start_worker(["gpu", "default"], pool="threads", concurrency=4, env=QUICK_REDELIVERY) as second:
        seen = [first_event, *events]  # the rest of the stream, up to its terminal event
        stored = final_answer(answer.pk, 60)
        recovered_s = time.monotonic() - killed_at
        log = second.log()
    ledger.usage_records_store(claim_idle_ms=0)

    kinds = [kind for _, kind, _ in seen]
    assert kinds[-1] == "error" and set(kinds[:-1]) == {"delta"}
    error = seen[-1][2]
    assert error["kind"] == "worker_lost"
    assert error["message"].startswith("interrupted: the worker running this request was lost after ")
    streamed = [data["text"] for _, kind, data in seen if kind == "delta"]
    assert streamed == streamed_at_kill and 1 <= len(streamed) < 1500  # nothing streamed twice
    assert stored.status == Answer.Status.FAILED
    assert "the worker running this request was lost" in stored.error and "worker_lost" in stored.error
    assert stored.text == "".join(streamed)
    [record] = UsageRecord.objects.filter(request_id=answer.pk)
    assert (record.status, record.error_class, record.attempts) == ("error", "worker_lost", 1)
    assert record.completion_tokens == len(streamed)
    assert (record.route_name, record.provider_id) == ("default", provider.pk)
    assert "generate_routed" in log
    print(f"\ngpu: killed after {len(streamed)} tokens, answer failed {recovered_s:.1f} s later")


# --------------------------------------------------------------------------- the worker of a map step killed


def test_a_map_steps_worker_killed_mid_generation_fails_the_answer_with_that_steps_reason(
    start_worker, upstream_server
):
    """A map-reduce answer whose map requests are killed mid-stream (kill -9 of the pool
    processes running them): each step's end reaches the answer through its ledger entry,
    written by the worker's parent at once, and the answer fails within seconds with that
    step's reason. Exactly one ledger row per map request that ran; no reduce request."""
    from tests.search.answering.test_answers import BIG, remote_provider

    workspace = workspace_create(name="Big", slug="big-killed")
    collection = collection_create(workspace=workspace, name="Reports")
    ingest_texts(collection, {"lift.md": "# Lift report\n\n" + BIG, "robot.md": DOCUMENTS["robot.md"]})
    _, api_key = remote_provider(upstream_server, window=512, max_tokens=64)
    reply = "The wing stalls when the boundary layer separates near the critical angle [1]."
    # Every map request streams slowly: they are all mid-generation when their processes die.
    upstream_script(upstream_server, api_key, [{"token_delay_ms": 400, "repeat": True}])

    with (
        start_worker(["default"]) as drain,
        start_worker(["remote"], concurrency=8) as remote,  # prefork: a pool process for each map request
    ):
        answer = answer_create(workspace=workspace, question=f"When does the wing stall?\nREPLY: {reply}")
        maps = answer.stats["map_reduce"]["maps"]
        assert answer.stats["context"]["strategy"] == "map_reduce" and len(maps) >= 2
        map_ids = [entry["request_id"] for entry in maps]

        def every_map_streaming() -> bool:
            return all(any(kind == "delta" for _, kind, _ in stream_events(map_id)) for map_id in map_ids)

        wait_for(every_map_streaming, 60, "every map request streaming")
        children = psutil.Process(remote.process.pid).children()
        assert len(children) == 8
        for child in children:
            child.kill()
        killed_at = time.monotonic()

        wait_for(
            lambda: Answer.objects.get(pk=answer.pk).status == Answer.Status.FAILED,
            30,
            lambda: f"answer still {Answer.objects.get(pk=answer.pk).status}:\n{remote.log()[-3000:]}",
        )
        failed_s = time.monotonic() - killed_at
        stored = Answer.objects.get(pk=answer.pk)
        ledger.usage_records_store(claim_idle_ms=0)
        drain_log = drain.log()

    assert stored.error.startswith("map request ")
    assert f" of {len(maps)} failed: the worker process running this request died" in stored.error
    assert "the request was not retried (worker_lost)" in stored.error
    steps = stored.stats["map_reduce"]["maps"]
    # The first step's end failed the answer; the others found it failed and left it so.
    assert sorted(entry["status"] for entry in steps) == ["error"] + ["pending"] * (len(maps) - 1)
    assert "reduce" not in stored.stats["map_reduce"]
    # The answer's own stream: the maps' progress, then the failure; no generation of its own.
    kinds = [kind for _, kind, _ in stream_events(str(answer.pk))]
    assert set(kinds[:-1]) == {"progress"} and kinds[-1] == "error"
    # Each map request that ran has exactly one row (killed: worker_lost, with what it streamed).
    rows = {str(row.request_id): row for row in UsageRecord.objects.filter(request_id__in=[*map_ids, answer.pk])}
    assert set(rows) == set(map_ids)
    for map_id in map_ids:
        row = rows[map_id]
        streamed = [data["text"] for _, kind, data in stream_events(map_id) if kind == "delta"]
        assert (row.status, row.error_class, row.attempts) == ("error", "worker_lost", 1)
        assert row.completion_tokens == len(streamed) >= 1
    assert "billing.tasks.ledger_drain" in drain_log
    print(f"\nmap steps killed mid-stream; the answer failed {failed_s:.1f} s later")


# --------------------------------------------------------------------------- every upstream key rate-limited


def queued(queue: str) -> int:
    """Messages waiting in a Celery queue on Redis (kombu's list, and its priority lists)."""
    client = redis_client(Role.BROKER)
    return sum(client.llen(key) for key in client.scan_iter(match=f"{queue}*") if client.type(key) == b"list")


def test_every_key_rate_limited_is_503_with_retry_after_and_refused_at_the_door(
    start_worker, start_web, upstream_server, corpus
):
    import openai

    provider = provider_make(upstream_server)
    secrets = [key_make(provider, label)[1] for label in ("a", "b")]
    for secret in secrets:
        upstream_script(upstream_server, secret, [{"status": 429, "retry_after": "30", "repeat": True}])
    Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=32)
    _, token = client_keys.client_key_create(corpus, "rate", scopes=["generate"])
    headers = {"Authorization": f"Bearer {token}"}

    with start_worker(["remote", "default"], pool="threads", concurrency=4) as worker, start_web() as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "How long does charging take?"}]
        # 1. Keys usable when asked: the worker tries each once, both answer 429, and the request
        # ends unavailable rather than waiting 30 s (more than ROUTER_BACKOFF_MAX_S).
        with pytest.raises(openai.APIStatusError) as first:
            client.chat.completions.create(model="default", messages=messages)
        assert first.value.status_code == 503 and not isinstance(first.value, openai.RateLimitError)
        assert first.value.code == "unavailable"
        assert 28 <= int(first.value.response.headers["Retry-After"]) <= 31
        assert [len(upstream_log(upstream_server, s)) for s in secrets] == [1, 1]

        # 2. Every key cooling down: refused at the door (router.submit), nothing enqueued.
        refused = [
            http_json(f"{base_url}/api/v1/answers", {"question": "How long does charging take?"}, headers)
            for _ in range(4)
        ]
        for stream in (False, False, False, True):
            with pytest.raises(openai.APIStatusError) as door:
                client.chat.completions.create(model="default", messages=messages, stream=stream)
            response = door.value.response
            refused.append((response.status_code, dict(response.headers), response.json()))
        waiting = queued("remote")
        active = worker_active(worker.name)

    assert [status for status, _, _ in refused] == [503] * 8
    assert all(27 <= int(headers["retry-after"]) <= 31 for _, headers, _ in refused)
    assert {body["error"]["code"] for _, _, body in refused} == {"route_unavailable"}
    assert all("cooling down after rate limits" in body["error"]["message"] for _, _, body in refused)
    assert waiting == 0 and active == []
    assert [len(upstream_log(upstream_server, s)) for s in secrets] == [1, 1]  # no call while cooling
    ledger.usage_records_store(claim_idle_ms=0)
    [record] = UsageRecord.objects.filter(kind="generation")  # the one that ran; refusals cost nothing
    assert (record.status, record.error_class, record.attempts) == ("error", "unavailable", 2)
    statuses = list(Answer.objects.values_list("status", flat=True))
    assert statuses == [Answer.Status.FAILED] * 9
    print(f"\nrate limits: {len(refused)} refused at the door, queue {waiting}, in flight {len(active)}")


def worker_active(name: str) -> list:
    from ragsite.celery import app

    replies = app.control.inspect(destination=[name], timeout=5).active() or {}
    return replies.get(name, [])


def http_json(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 30):
    """``(status, headers with lower-case names, JSON body or the raw text)`` of a request;
    POST with ``body``, else GET. HTTP errors are answers too."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw, found = response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        status, raw, found = error.code, error.read(), error.headers
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return status, {name.lower(): value for name, value in found.items()}, parsed


# --------------------------------------------------------------------------- Redis and PostgreSQL restarted


@pytest.fixture
def serving(start_worker, start_web, upstream_server, corpus):
    """A web process and a worker (queues remote and default) over a route to the stand-in,
    with a client key; yields what the tests need to send traffic."""
    provider = provider_make(upstream_server)
    _, secret = key_make(provider, "main")
    Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=32)
    _, token = client_keys.client_key_create(corpus, "traffic", scopes=["search", "generate"])
    with start_worker(["remote", "default"], pool="threads", concurrency=4) as worker, start_web() as base_url:
        yield {
            "base_url": base_url,
            "headers": {"Authorization": f"Bearer {token}"},
            "worker": worker,
            "secret": secret,
            "upstream": upstream_server,
        }


def search(serving, timeout: float = 30):
    return http_json(f"{serving['base_url']}/api/v1/search?query=charging", headers=serving["headers"], timeout=timeout)


def ask(serving, wait: int | None = None, timeout: float = 40):
    query = f"?wait={wait}" if wait is not None else ""
    body = {"question": "How long does charging take?"}
    return http_json(f"{serving['base_url']}/api/v1/answers{query}", body, serving["headers"], timeout=timeout)


def assert_clean_failure(response, statuses=(500, 502, 503)) -> None:
    """An error in the API's one shape, not a hang (the call's timeout) nor a traceback page."""
    status, headers, body = response
    assert status in statuses, response
    if status == 503:
        assert int(headers["retry-after"]) > 0, response
    assert isinstance(body, dict) and body["error"]["code"] and body["error"]["message"], response
    assert "Traceback" not in body["error"]["message"]


def recovered(serving, timeout: float = 60) -> float:
    """Seconds until a search and an answer both succeed again."""
    started = time.monotonic()
    wait_for(lambda: search(serving)[0] == 200, timeout, lambda: f"search still fails: {search(serving)}")
    status, _, answer = ask(serving, wait=30)
    assert (status, answer["status"]) == (200, "done"), answer
    return time.monotonic() - started


def no_answer_left_pending(timeout: float = 60) -> list[str]:
    unfinished = (Answer.Status.QUEUED, Answer.Status.GENERATING)
    wait_for(
        lambda: not Answer.objects.filter(status__in=unfinished).exists(),
        timeout,
        lambda: f"answers left unfinished: {list(Answer.objects.filter(status__in=unfinished).values('id', 'status'))}",
    )
    return list(Answer.objects.order_by("created_at").values_list("status", flat=True))


def test_redis_restarted_under_traffic_web_and_workers_reconnect_by_themselves(serving, redis_outage):
    assert search(serving)[0] == 200
    status, _, before = ask(serving, wait=30)
    assert (status, before["status"]) == (200, "done"), before
    web_pid, worker_pid = serving["worker"].process.pid, serving["worker"].process.pid
    # An answer in flight when Redis stops: its upstream is slow (12 tokens, 0.3 s apart).
    upstream_script(serving["upstream"], serving["secret"], [{"token_delay_ms": 300}])
    status, _, in_flight = ask(serving)
    assert status == 202, in_flight

    with redis_outage():
        during = [search(serving), ask(serving), ask(serving, wait=5)]
    restarted_at = time.monotonic()
    for response in during:
        assert_clean_failure(response, statuses=(503,))
    seconds = recovered(serving)
    statuses = no_answer_left_pending()
    assert serving["worker"].process.poll() is None and serving["worker"].process.pid == worker_pid
    assert web_pid  # the same processes served before, during and after
    assert Answer.objects.get(pk=in_flight["id"]).status in (Answer.Status.DONE, Answer.Status.FAILED)
    print(
        f"\nredis: {len(during)} requests failed cleanly in the gap ({[r[0] for r in during]}), "
        f"served again {seconds:.1f} s after the restart ({time.monotonic() - restarted_at:.1f} s), "
        f"answers {statuses}"
    )


def test_postgres_restarted_loses_nothing_committed_and_the_same_processes_serve_after(serving, postgres_outage):
    status, _, before = ask(serving, wait=30)
    assert (status, before["status"]) == (200, "done"), before
    answers_before = set(map(str, Answer.objects.values_list("pk", flat=True)))
    chunks_before = Chunk.objects.count()
    ledger.usage_records_store(claim_idle_ms=0)
    rows_before = UsageRecord.objects.filter(kind="generation").count()
    assert rows_before == 1

    with postgres_outage():
        during = [search(serving), ask(serving), ask(serving, wait=5)]
    for response in during:
        assert_clean_failure(response, statuses=(503,))
    seconds = recovered(serving)
    assert serving["worker"].process.poll() is None
    assert answers_before <= set(map(str, Answer.objects.values_list("pk", flat=True)))
    assert Chunk.objects.count() == chunks_before
    assert Answer.objects.get(pk=before["id"]).text == before["text"]
    statuses = no_answer_left_pending()
    ledger.usage_records_store(claim_idle_ms=0)
    assert UsageRecord.objects.filter(kind="generation").count() == rows_before + 1  # the answer after
    print(f"\npostgres: {len(during)} requests failed in the gap, served again {seconds:.1f} s later, {statuses}")
