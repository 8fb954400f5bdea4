"""Structured logs and the request id (ragsite/logs.py).

End to end: a question asked over HTTP with ``X-Request-ID`` is answered by a remote worker
over the OpenAI-protocol stand-in; the response echoes the id, the web's and the worker's
JSON log lines carry it, and the generation's ledger row stores it as ``trace_id``.
"""

from __future__ import annotations

import json
import logging
import uuid

import pytest
import requests

from billing import client_keys, ledger
from billing.models import UsageRecord
from ragsite.logs import ContextFilter, JsonFormatter, request_id_var
from search.services import collection_create, workspace_create
from tests.inference.routing_helpers import key_make, provider_make, route_make
from tests.search.files import ingest_texts

REPLY = "The Atlas-7 robot runs for 10 hours on one charge [1]."
JSON_LOGS = {"LOG_FORMAT": "json"}


def json_lines(text: str) -> list[dict]:
    """Every line that starts with ``{``, parsed (a line that does not parse fails the test)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.django_db(transaction=True)
def test_a_request_id_follows_a_question_to_the_worker_and_the_ledger(
    start_web, start_worker, upstream_server, tmp_path
):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(collection, {"robot.md": "# Atlas-7 robot\n\nThe Atlas-7 robot runs for 10 hours on one charge."})
    _, token = client_keys.client_key_create(workspace, "integration", scopes=["search", "generate"])
    provider = provider_make(upstream_server)
    key_make(provider)
    route_make(provider, is_default=True)
    request_id = f"trace-{uuid.uuid4().hex}"

    with (
        start_worker(["remote", "default"], pool="threads", concurrency=2, env=JSON_LOGS) as worker,
        start_web(env=JSON_LOGS) as base_url,
    ):
        response = requests.post(
            f"{base_url}/api/v1/answers?wait=30",
            json={"question": f"How long does the robot run?\nREPLY: {REPLY}"},
            headers={"Authorization": f"Bearer {token}", "X-Request-ID": request_id},
            timeout=60,
        )
        answer = response.json()
        assert (response.status_code, answer["status"], answer["text"]) == (200, "done", REPLY)
        assert response.headers["X-Request-ID"] == request_id
        # A header that is not a sane token is replaced by a fresh id, never echoed.
        refused = requests.get(f"{base_url}/healthz", headers={"X-Request-ID": "<not a token>"}, timeout=30)
        assert refused.headers["X-Request-ID"] != "<not a token>" and len(refused.headers["X-Request-ID"]) == 32
        ledger.usage_records_store()
        worker_log = worker.log()
    web_log = next(iter(tmp_path.glob("web-*.log"))).read_text()

    web_lines, worker_lines = json_lines(web_log), json_lines(worker_log)
    for line in web_lines + worker_lines:
        assert {"time", "level", "logger", "message", "process"} <= line.keys(), line
        assert line["time"].endswith("Z")
    # The web: the request's own line, with its id; uvicorn's lines are JSON too.
    ours = [line for line in web_lines if line["logger"] == "ragsite.request" and line.get("request_id") == request_id]
    assert [(line["message"], line["method"], line["path"], line["status"]) for line in ours] == [
        ("POST /api/v1/answers 200", "POST", "/api/v1/answers", 200)
    ]
    assert any(line["logger"] == "uvicorn.access" and "POST /api/v1/answers" in line["message"] for line in web_lines)
    # The worker: the generation task's lines carry the id, and so do those of the drain it
    # sends, which stores the row and finalizes the answer.
    tasks = {line.get("task") for line in worker_lines if line.get("request_id") == request_id}
    assert tasks == {"inference.tasks.generate_routed", "billing.tasks.ledger_drain"}
    assert any(line["logger"] == "celery.worker.consumer.connection" for line in worker_lines)
    # The ledger row of the generation.
    row = UsageRecord.objects.get(request_id=answer["id"])
    assert (row.kind, row.status, row.trace_id) == ("generation", "ok", request_id)
    assert token not in web_log + worker_log
    # The generation's result (the answer's text) is withheld from Celery's success line, as its
    # payload is from the task's arguments.
    [succeeded] = [
        line for line in worker_lines if "generate_routed" in line["message"] and "succeeded" in line["message"]
    ]
    assert succeeded["message"].endswith(": <result withheld>")
    assert REPLY not in worker_log


def test_the_filter_masks_secrets_and_adds_the_request_id():
    secrets = ("sk-live-" + "a" * 20, "Authorization: Bearer rk_AbCdEfGh_" + "Z" * 43)
    record = logging.LogRecord("tests", logging.WARNING, __file__, 1, "key %s refused; header %s", secrets, None)
    token = request_id_var.set("req-12345678")
    try:
        assert ContextFilter().filter(record)
    finally:
        request_id_var.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "key sk-*** refused; header Authorization: Bearer ***"
    assert (line["level"], line["logger"], line["request_id"]) == ("WARNING", "tests", "req-12345678")

    bare = logging.LogRecord("tests", logging.INFO, __file__, 1, "client key rk_AbCdEfGh_%s", ("Z" * 43,), None)
    assert ContextFilter().filter(bare)
    line = json.loads(JsonFormatter().format(bare))
    assert line["message"] == "client key rk_AbCdEfGh_***" and "request_id" not in line


@pytest.mark.django_db(transaction=True)
def test_a_row_written_by_a_dead_workers_parent_keeps_the_request_id(upstream_server):
    from inference import router
    from inference.execution import lost_generation_end

    provider = provider_make(upstream_server)
    key_make(provider)
    route = route_make(provider)
    token = request_id_var.set("trace-from-the-web-0123")
    try:  # the web request plans and sends the generation
        plan = router.plan(route_name=route.name)
        payload = router.payload_for(plan, messages=[{"role": "user", "content": "Hello"}])
    finally:
        request_id_var.reset(token)
    # The pool process died; its parent (no request id of its own) ends the stream and queues the row.
    assert lost_generation_end(plan.request_id, payload, "the worker process running this request died")
    ledger.usage_records_store()
    row = UsageRecord.objects.get(request_id=plan.request_id)
    assert (row.status, row.trace_id) == ("error", "trace-from-the-web-0123")
