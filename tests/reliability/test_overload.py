"""Overload shedding with real processes: beyond capacity the service answers 503 with
``Retry-After`` at once instead of letting work and waits pile up.

- Queue depth (``inference/backpressure.py``): with ``GENERATION_QUEUE_MAX=3`` and no
  worker consuming ``remote``, answers are admitted until the queue's Redis list holds 3
  messages, and every later one is refused (REST API and OpenAI-compatible API) with
  nothing enqueued, before its retrieval; a burst of concurrent requests never takes the list past the bound.
  Once a worker drains the queue, answers are admitted again.
- In-flight requests per web process (``ragsite/overload.py``): with
  ``WEB_MAX_IN_FLIGHT=2`` and two requests held (``POST /api/v1/answers?wait=60`` with no
  worker: they wait for answers that no worker generates yet), the next request is
  refused, while ``/healthz``, ``/readyz`` and a held answer's event stream are served;
  once a worker generates the answers, the held requests end and requests are served again.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from billing import client_keys
from inference import backpressure
from ragsite.celery import queue_lists
from ragsite.redis import Role, redis_client
from search.models import Answer
from search.services import workspace_create
from tests.frontdoors.api.test_live import stand_in_route

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

QUEUE = "remote"


def call(method: str, url: str, token: str | None = None, body: dict | None = None, timeout: float = 90):
    """``(status, headers, JSON body)`` of one request."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read() or b"null")


def wait_until(condition, seconds: float = 60, what: str = "the condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def site(upstream_server):
    """A workspace without documents (retrieval finds nothing, no embedding model loads), a
    default route on the stand-in upstream, and a key that may search and generate, with no
    limits of its own. Returns the key's token."""
    workspace = workspace_create(name="Acme", slug="acme")
    # Without documents nothing answers a question: this route generates all the same, so that
    # its answers are queued (the subject here), instead of declining at once.
    stand_in_route(upstream_server, "overload", steps=[], max_tokens=32, abstains=False)
    broker = redis_client(Role.BROKER)
    broker.delete(
        *queue_lists(QUEUE), backpressure.reservations_key(QUEUE), *broker.keys(f"backpressure:taken:{QUEUE}:*")
    )
    _, token = client_keys.client_key_create(workspace, "load", scopes=["search", "generate"])
    return token


def queued() -> int:
    return redis_client(Role.BROKER).llen(QUEUE)


def ask(base_url: str, token: str, question: str = "How long does charging take?", wait: int | None = None):
    query = f"?wait={wait}" if wait is not None else ""
    return call("POST", f"{base_url}/api/v1/answers{query}", token, {"question": question})


def test_answers_beyond_the_queue_bound_get_503_and_nothing_is_enqueued(site, start_web, start_worker):
    token = site
    with start_web(env={"GENERATION_QUEUE_MAX": "3", "GENERATION_QUEUE_RETRY_AFTER_S": "2"}) as base_url:
        # A burst of 12 concurrent requests: never more than 3 messages, each admitted one enqueued.
        with ThreadPoolExecutor(12) as pool:
            burst = list(pool.map(lambda n: ask(base_url, token, f"Burst question {n}?"), range(12)))
        statuses = [status for status, _, _ in burst]
        accepted = statuses.count(202)
        assert statuses.count(503) == 12 - accepted
        assert 1 <= accepted <= 3 and queued() == accepted
        for status, headers, body in burst:
            if status == 503:
                assert headers["Retry-After"] == "2" and body["error"]["code"] == "route_unavailable"

        # One at a time: exactly the free slots are taken, then the next answer is refused.
        for n in range(3 - accepted):
            status, _, body = ask(base_url, token, f"Top-up question {n}?")
            assert (status, body["status"]) == (202, "generating")
        assert queued() == 3
        status, headers, body = ask(base_url, token, "One too many?")
        assert status == 503 and headers["Retry-After"] == "2"
        assert body["error"]["code"] == "route_unavailable"
        assert "3 generations are waiting on queue 'remote' (the limit is 3)" in body["error"]["message"]
        # Refused before its retrieval (router.capacity_check): a refusal does not cost a search.
        refused = Answer.objects.get(question="One too many?")
        assert "retrieve_ms" not in refused.timings and refused.sources == []
        status, headers, body = call(
            "POST", f"{base_url}/v1/chat/completions", token,
            {"model": "default", "messages": [{"role": "user", "content": "And this one?"}]},
        )  # fmt: skip
        assert status == 503 and (headers["Retry-After"], headers["retry-after-ms"]) == ("2", "2000")
        assert body["error"]["code"] == "route_unavailable" and body["error"]["type"] == "service_unavailable"
        assert queued() == 3 and redis_client(Role.BROKER).zcard(backpressure.reservations_key(QUEUE)) == 0
        # Each refused answer is stored failed with the reason; the admitted ones wait.
        assert Answer.objects.filter(status=Answer.Status.GENERATING).count() == 3
        failed = Answer.objects.filter(status=Answer.Status.FAILED)
        assert failed.count() == 12 - accepted + 2
        assert all("the service is at capacity" in answer.error for answer in failed)

        # A worker drains the queue: answers are admitted again.
        with start_worker([QUEUE, "default"], pool="threads", concurrency=4):
            wait_until(lambda: queued() == 0, what="the worker to take the queued generations")
            status, _, body = ask(base_url, token, "After the drain?", wait=30)
            assert (status, body["status"]) == (200, "done")
            # Each generation the worker took counted in the queue's drain rate (its bound in time).
            broker = redis_client(Role.BROKER)
            taken = [broker.get(key) for key in broker.keys(f"backpressure:taken:{QUEUE}:*")]
            assert sum(int(count) for count in taken) == 4
    assert Answer.objects.filter(status=Answer.Status.DONE).count() >= 1


def test_the_in_flight_limit_answers_503_at_once_while_health_and_streams_are_served(site, start_web, start_worker):
    token = site
    env = {"WEB_MAX_IN_FLIGHT": "2", "WEB_OVERLOAD_RETRY_AFTER_S": "1", "GENERATION_QUEUE_MAX": "0"}
    with start_web(env=env) as base_url:
        # Two requests held: each waits (up to 60 s) for an answer that no worker generates yet.
        held: list[tuple] = []

        def hold(n: int):
            held.append(ask(base_url, token, f"Held question {n}?", wait=60))

        threads = [threading.Thread(target=hold, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        # Both are inside their views once both generations are enqueued.
        wait_until(lambda: queued() == 2, what="both held requests to enqueue their generations")

        status, headers, body = call("POST", f"{base_url}/api/v1/search", token, {"query": "charging"})
        assert (status, headers["Retry-After"], body["error"]["code"]) == (503, "1", "overloaded")
        status, headers, body = call(
            "POST", f"{base_url}/v1/chat/completions", token,
            {"model": "default", "messages": [{"role": "user", "content": "Refused?"}]},
        )  # fmt: skip
        assert status == 503 and (headers["Retry-After"], headers["retry-after-ms"]) == ("1", "1000")
        assert (body["error"]["code"], body["error"]["type"]) == ("overloaded", "service_unavailable")
        status, _, body = ask(base_url, token, "Refused too?")
        assert status == 503 and body["error"]["code"] == "overloaded"
        assert queued() == 2  # the refused requests reached no view: nothing created, nothing enqueued
        assert Answer.objects.count() == 2

        # Not counted: liveness, readiness (not ready here: no worker), an answer's event stream.
        assert call("GET", f"{base_url}/healthz")[:3:2] == (200, {"status": "ok"})
        status, _, body = call("GET", f"{base_url}/readyz")
        assert status == 503 and body["status"] == "not ready"
        answer = Answer.objects.order_by("created_at").first()
        request = urllib.request.Request(
            f"{base_url}/api/v1/answers/{answer.pk}/stream", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert (response.status, response.headers["Content-Type"]) == (200, "text/event-stream")

        # A worker generates the answers: the held requests end, and requests are served again.
        with start_worker([QUEUE, "default"], pool="threads", concurrency=4):
            for thread in threads:
                thread.join(timeout=90)
            assert [(status, body["status"]) for status, _, body in held] == [(200, "done"), (200, "done")]
            status, _, body = call("POST", f"{base_url}/api/v1/search", token, {"query": "charging"})
            assert (status, body["results"]) == (200, [])


def test_chat_completion_streams_held_open_count_neither_against_the_limit_nor_the_database_pool(
    site, start_web, start_worker, upstream_server
):
    """A chat completion counts (and holds a pooled connection) while its view's thread runs:
    waiting for the first token and streaming take neither. Six streams whose first token
    takes 3 s, against a web process allowing three requests in flight with two pooled
    connections: all six are served, and (nearly) all six wait for their first token at the
    same time (the stand-in's log says when each ran). Counted until their first token, or
    holding their connections, at most three (two) would."""
    import openai

    from tests.upstream_server import upstream_log

    steps = [{"first_byte_delay_ms": 3000, "repeat": True}]
    secret = stand_in_route(upstream_server, "paced", steps=steps, route="paced", max_tokens=32, abstains=False)
    env = {"WEB_MAX_IN_FLIGHT": "3", "WEB_OVERLOAD_RETRY_AFTER_S": "1", "DATABASE_POOL_MAX_SIZE": "2"}
    reply = "one two three four"

    with start_web(env=env) as base_url, start_worker([QUEUE, "default"], pool="threads", concurrency=8):
        # The SDK's retries honour Retry-After: a request arriving while three others are being
        # started is told to come back in a second, as under any load.
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=site, max_retries=5, timeout=60)

        def stream(number: int) -> str:
            messages = [{"role": "user", "content": f"Stream {number}.\nREPLY: {reply}"}]
            chunks = client.chat.completions.create(model="paced", messages=messages, stream=True)
            return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(stream, range(6)))

    assert texts == [reply] * 6
    served = [(entry["time"], entry["finished"]) for entry in upstream_log(upstream_server, secret)]
    assert len(served) == 6
    most_at_once = max(sum(1 for start, end in served if start <= moment < end) for moment, _ in served)
    assert most_at_once >= 5, served
