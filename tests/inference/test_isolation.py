"""A redelivered generation never streams twice.

``generate_routed`` is acknowledged late and not rejected on a lost worker
(``GENERATION_TASK_OPTIONS``), but the broker still hands a message back once its whole
worker vanished (past the visibility timeout), marked ``redelivered`` (kombu marks every
message it restores; ``redelivered`` here runs the task as such a delivery, and
tests/reliability/test_faults.py kills a real worker for a real one). The task then looks at
the request's stream first: an ended stream is left alone (``already finished``); a stream holding events that
nobody will finish is ended with ``worker_lost`` and one ledger row (``interrupted``); the
events a hand-over expects (the ``retry`` that sent it to the other queue) are no restart.

The requests are real routed ones, on routes on the OpenAI-protocol stand-in (and a GPU
pool whose only device does not answer), run in this process as the worker runs them.
The in-process engine's isolation tests (a crash, out of memory, a killed pool process)
are gone with ``generate_local``: the gpu worker now only streams from engine servers.
"""

from __future__ import annotations

import socket
import uuid

import pytest

from billing import ledger
from billing.models import UsageRecord
from inference.execution import run_routed
from inference.models import Provider, Route
from inference.streams import StreamWriter
from inference.tasks import generate_routed
from tests.inference.routing_helpers import (
    PROMPT,
    REPLY,
    deltas,
    events_of,
    key_make,
    kinds,
    payload,
    provider_make,
    route_make,
    unique,
)
from tests.upstream_server import upstream_log

pytestmark = pytest.mark.django_db(transaction=True)


def redelivered(request_id: str, body: dict) -> dict:
    """The task run as the broker's restored message runs it: ``delivery_info.redelivered``."""
    generate_routed.push_request(id=request_id, delivery_info={"redelivered": True})
    try:
        return generate_routed.run(request_id, body)
    finally:
        generate_routed.pop_request()


def closed_device() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def upstream_route(upstream_server) -> tuple[Route, str]:
    provider = provider_make(upstream_server)
    _, secret = key_make(provider)
    return route_make(provider), secret


def test_a_finished_request_that_comes_back_is_skipped(upstream_route, upstream_server):
    route, secret = upstream_route
    request_id, body = uuid.uuid4().hex, payload(route)

    first = generate_routed.run(request_id, body)
    streamed = events_of(request_id)
    again = redelivered(request_id, body)

    assert (first["status"], first["text"], first["attempts"]) == ("ok", REPLY, 1)
    assert kinds(streamed)[-1] == "stats" and "".join(deltas(streamed)) == REPLY
    assert again == {"skipped": "already finished"}
    assert events_of(request_id) == streamed  # nothing appended
    assert len(upstream_log(upstream_server, secret)) == 1  # and nothing asked of the upstream
    ledger.usage_records_store()  # the drain the task sent to queue default, run here
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1


def test_a_stream_a_lost_worker_left_open_is_ended_and_billed_not_restarted(upstream_route, upstream_server):
    route, secret = upstream_route
    request_id, body = uuid.uuid4().hex, payload(route)
    StreamWriter(request_id).write("delta", text="Lift")  # what the vanished worker had sent

    result = redelivered(request_id, body)
    events = events_of(request_id)

    assert result == {"error": "interrupted"}
    assert kinds(events) == ["delta", "error"] and deltas(events) == ["Lift"]
    error = events[-1][1]
    assert error == {
        "field": None,
        "kind": "worker_lost",
        "message": "interrupted: the worker running this request was lost after 1 event and the message came "
        "back to another worker; the request was not retried",
    }
    assert upstream_log(upstream_server, secret) == []
    ledger.usage_records_store()  # the drain the task sent to queue default, run here
    row = UsageRecord.objects.get(request_id=request_id)
    assert (row.status, row.error_class, row.completion_tokens, row.attempts, row.route_id) == (
        "error",
        "worker_lost",
        1,
        1,
        route.id,
    )
    assert row.upstream_key_id is None and row.prompt_tokens > 0  # estimated: the upstream had read it
    # Redelivered once more: the stream has ended now.
    assert redelivered(request_id, body) == {"skipped": "already finished"}
    ledger.usage_records_store()
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1


def test_a_handed_over_request_runs_on_past_the_events_it_expects_and_only_once(upstream_route, upstream_server):
    """A pool route whose only device does not answer hands the request over to its upstream
    fallback (the other queue) with the stream's one ``retry`` event: the task that receives
    it runs; the same message again is refused; and a hand-over that finds more events than
    it expects (the next worker began, then vanished) is interrupted, not restarted."""
    fallback, secret = upstream_route
    pool = Provider.objects.create(
        name=unique("pool"), kind=Provider.Kind.LOCAL, devices=[closed_device()], model="tiny", connect_timeout_s=2
    )
    route = route_make(pool, fallbacks=(fallback,))
    request_id = uuid.uuid4().hex

    handed = run_routed(request_id, payload(route, PROMPT))
    assert (handed["status"], handed["queue"]) == ("handed_over", "remote")
    body = handed["payload"]
    assert (body["route_id"], body["handover"]["events"], body["handover"]["attempts"]) == (fallback.id, 1, 1)
    assert body["handover"]["last_error"]["kind"] == "connection"

    result = generate_routed.run(request_id, body)
    events = events_of(request_id)
    assert (result["status"], result["route"], result["attempts"], result["text"]) == ("ok", fallback.name, 2, REPLY)
    assert kinds(events)[0] == "retry" and kinds(events)[-1] == "stats"
    assert events[0][1]["route"] == fallback.name and events[0][1]["kind"] == "connection"
    assert redelivered(request_id, body) == {"skipped": "already finished"}
    assert len(upstream_log(upstream_server, secret)) == 1
    ledger.usage_records_store()  # the drain the task sent to queue default, run here
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1

    # The same hand-over, but the receiving worker had streamed a delta before it vanished.
    lost = uuid.uuid4().hex
    handed = run_routed(lost, payload(route, PROMPT))
    StreamWriter(lost).write("delta", text="Lift")
    assert generate_routed.run(lost, handed["payload"]) == {"error": "interrupted"}
    events = events_of(lost)
    assert kinds(events) == ["retry", "delta", "error"]
    assert events[-1][1]["message"].startswith("interrupted: the worker running this request was lost after 2 events")
    ledger.usage_records_store()
    row = UsageRecord.objects.get(request_id=lost)
    assert (row.status, row.error_class, row.completion_tokens, row.attempts, row.route_id) == (
        "error",
        "worker_lost",
        1,
        1,
        fallback.id,
    )
    assert len(upstream_log(upstream_server, secret)) == 1
