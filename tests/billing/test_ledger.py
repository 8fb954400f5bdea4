"""The usage ledger's outbox (billing/ledger.py) on real Redis and PostgreSQL: a routed
request queues its row with its stream's terminal event, the drain stores each row exactly
once (a drainer that died before acknowledging, a database that was down, a row PostgreSQL
refuses), and a key's successes are counted from the rows actually stored.
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import OperationalError

from billing import ledger
from billing.models import Price, UsageRecord
from billing.pricing import cost_of
from inference.execution import run_routed
from inference.streams import stream_events, stream_read
from ragsite.redis import Role, redis_client
from tests.inference.routing_helpers import REPLY, WORDS, key_make, payload, provider_make, route_make
from tests.upstream_server import upstream_script

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def outbox():
    """An empty outbox (rows other tests left queued would be drained here)."""
    client = redis_client(Role.STREAMS)
    ledger.usage_records_store(claim_idle_ms=0)
    client.delete(ledger.OUTBOX, ledger.REJECTED)
    yield client
    client.delete(ledger.OUTBOX, ledger.REJECTED)


def request(route) -> tuple[str, dict]:
    request_id = uuid.uuid4().hex
    return request_id, run_routed(request_id, payload(route))


def test_the_row_is_queued_with_the_terminal_event_and_stored_by_the_drain(upstream_server, outbox):
    provider = provider_make(upstream_server)
    key, _ = key_make(provider)
    route = route_make(provider)

    request_id, result = request(route)

    assert result["status"] == "ok"
    kinds = [kind for _, kind, _ in stream_events(request_id)]
    assert kinds == ["delta"] * len(WORDS) + ["stats"]
    # Queued, not stored: the request's path never waited for PostgreSQL's insert.
    assert outbox.xlen(ledger.OUTBOX) == 1
    assert not UsageRecord.objects.filter(request_id=request_id).exists()
    key.refresh_from_db()
    assert key.success_count == 0

    assert ledger.usage_records_store() == 1

    row = UsageRecord.objects.get(request_id=request_id)
    assert (row.status, row.route_id, row.provider_id, row.upstream_key_id) == ("ok", route.id, provider.id, key.id)
    assert (row.completion_tokens, row.attempts, row.error_class, row.arm) == (len(WORDS), 1, "", "")
    assert row.prompt_tokens > 0 and row.latency_ms > 0 and row.ttft_ms is not None
    assert row.created_at.utcoffset().total_seconds() == 0
    key.refresh_from_db()
    assert (key.success_count, key.consecutive_failures) == (1, 0)
    assert outbox.xlen(ledger.OUTBOX) == 0
    assert ledger.usage_records_store() == 0


def test_a_row_stored_by_a_drainer_that_died_before_acknowledging_is_not_stored_or_counted_twice(
    upstream_server, outbox
):
    provider = provider_make(upstream_server)
    key, _ = key_make(provider)
    route = route_make(provider)
    request_id, _ = request(route)

    # A drainer reads the entry, commits the row, and dies before XACK.
    ledger._ensure_group(outbox)
    read = outbox.xreadgroup(ledger.GROUP, "dead-drainer", {ledger.OUTBOX: ">"}, count=10)
    entries = read[0][1]
    assert len(entries) == 1
    assert ledger._store([json.loads(entries[0][1][b"row"])]) == {str(uuid.UUID(request_id))}

    # Another drainer without claiming sees nothing new; the beat's claim takes it over.
    assert ledger.usage_records_store() == 0
    assert outbox.xpending(ledger.OUTBOX, ledger.GROUP)["pending"] == 1
    assert ledger.usage_records_store(claim_idle_ms=0) == 0

    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    key.refresh_from_db()
    assert key.success_count == 1
    assert outbox.xpending(ledger.OUTBOX, ledger.GROUP)["pending"] == 0
    assert outbox.xlen(ledger.OUTBOX) == 0


def test_the_outcome_in_the_entry_goes_to_its_consumer_after_the_row_and_waits_for_the_claim_if_it_fails(
    upstream_server, outbox, monkeypatch
):
    """One entry: the row and, for whoever waits, the outcome. The consumer registered for its
    kind sees the row already stored; one that fails leaves the entry pending (not lost, not
    acknowledged), and the beat's claim delivers it again; the row is not stored twice."""
    provider = provider_make(upstream_server)
    key_make(provider)
    route = route_make(provider)
    monkeypatch.setattr(ledger, "_OUTCOME_CONSUMERS", {})
    taken, failing = [], [True]

    def consumer(outcome):
        stored = UsageRecord.objects.filter(request_id=outcome["request_id"]).count()
        if failing[0]:
            raise OperationalError("the database went away")
        taken.append((outcome["to"], outcome["status"], outcome["text"], stored))

    ledger.outcome_consumer("test-kind")(consumer)
    request_id = uuid.uuid4().hex
    result = run_routed(request_id, payload(route, outcome_to={"kind": "test-kind", "n": 7}))
    [(_, fields)] = outbox.xrange(ledger.OUTBOX)
    assert json.loads(fields[b"outcome"]) == result  # the outcome is what the task returned
    assert result["to"] == {"kind": "test-kind", "n": 7} and result["text"] == REPLY

    assert ledger.usage_records_store() == 1  # the row stored; the consumer failed
    assert taken == [] and outbox.xpending(ledger.OUTBOX, ledger.GROUP)["pending"] == 1
    assert ledger.usage_records_store() == 0  # a plain drain takes new entries only
    failing[0] = False
    assert ledger.usage_records_store(claim_idle_ms=0) == 0  # the claim: delivered, the row not stored twice
    assert taken == [({"kind": "test-kind", "n": 7}, "ok", REPLY, 1)]
    assert outbox.xlen(ledger.OUTBOX) == 0 and outbox.xpending(ledger.OUTBOX, ledger.GROUP)["pending"] == 0
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1

    # No one waits: the entry holds the row alone.
    run_routed(uuid.uuid4().hex, payload(route))
    [(_, fields)] = outbox.xrange(ledger.OUTBOX)
    assert set(fields) == {b"row"}


def test_rows_wait_in_the_outbox_while_the_database_is_down(upstream_server, outbox, monkeypatch):
    provider = provider_make(upstream_server)
    key_make(provider)
    route = route_make(provider)
    request_ids = [request(route)[0] for _ in range(3)]

    def database_down(rows):
        raise OperationalError("connection to server on socket failed: No such file or directory")

    with monkeypatch.context() as patch:
        patch.setattr(ledger, "_store", database_down)
        with pytest.raises(OperationalError):
            ledger.usage_records_store()

    assert not UsageRecord.objects.filter(request_id__in=request_ids).exists()
    assert outbox.xpending(ledger.OUTBOX, ledger.GROUP)["pending"] == 3
    assert ledger.usage_records_store() == 0  # read by the failed drainer: only a claim takes them over
    assert ledger.usage_records_store(claim_idle_ms=0) == 3
    assert UsageRecord.objects.filter(request_id__in=request_ids).count() == 3
    assert outbox.xlen(ledger.OUTBOX) == 0


def test_a_row_postgresql_refuses_is_set_aside_with_its_reason_and_the_others_are_stored(
    upstream_server, outbox, client
):
    provider = provider_make(upstream_server)
    key_make(provider)
    route = route_make(provider)
    good_ids = [request(route)[0] for _ in range(2)]
    # A third row like the others but with a negative token count (what only a bug would send).
    ((_, fields),) = outbox.xrange(ledger.OUTBOX, count=1)
    bad_id = uuid.uuid4().hex
    ledger.usage_record_queue({**json.loads(fields[b"row"]), "request_id": bad_id, "prompt_tokens": -5})

    assert ledger.usage_records_store() == 2

    assert UsageRecord.objects.filter(request_id__in=good_ids).count() == 2
    assert not UsageRecord.objects.filter(request_id=bad_id).exists()
    ((_, fields),) = outbox.xrange(ledger.REJECTED)
    assert json.loads(fields[b"row"])["request_id"] == bad_id
    assert 'violates check constraint "billing_usagerecord_prompt_tokens' in fields[b"reason"].decode()
    assert ledger.usage_outbox_backlog() == {"queued": 0, "rejected": 1}
    assert client.get("/readyz").json()["ledger"] == {"queued": 0, "rejected": 1}  # where operators look


def test_a_success_stored_after_a_later_failure_keeps_the_failure_count(upstream_server, outbox):
    provider = provider_make(upstream_server)
    key, _ = key_make(provider)
    route = route_make(provider)
    request(route)  # succeeds; its row is still queued
    # Then the key fails (after the success), before the drain stores the success.
    from inference import keypool

    keypool.upstream_key_failed(key.id, kind="server_error", message="HTTP 500", provider_name=provider.name)

    assert ledger.usage_records_store() == 1

    key.refresh_from_db()
    assert (key.success_count, key.consecutive_failures, key.failure_count) == (1, 1, 1)


# --------------------------------------------------------------------------- costs


def queued_row(outbox) -> dict:
    ((_, fields),) = outbox.xrange(ledger.OUTBOX, count=1)
    return json.loads(fields[b"row"])


def test_each_row_is_priced_at_its_own_time_and_a_price_change_mid_month_splits_the_costs(upstream_server, outbox):
    provider = provider_make(upstream_server, model=f"model-{uuid.uuid4().hex[:8]}")
    key_make(provider)
    route = route_make(provider)
    old = Price.objects.create(
        model=provider.model,
        input_usd_per_million=Decimal("1.250000"),
        output_usd_per_million=Decimal("3.500000"),
        effective_from=datetime(2026, 11, 1, tzinfo=UTC),
    )
    new = Price.objects.create(
        model=provider.model,
        input_usd_per_million=Decimal("0.400000"),
        output_usd_per_million=Decimal("1.600000"),
        effective_from=datetime(2026, 11, 15, 12, tzinfo=UTC),
    )
    request(route)
    row = queued_row(outbox)
    outbox.delete(ledger.OUTBOX)
    # The same request as if it had ended at four moments of the month.
    moments = {
        "before-any-price": datetime(2026, 10, 31, 23, 59, 59, tzinfo=UTC),
        "old-price": datetime(2026, 11, 15, 11, 59, 59, 999999, tzinfo=UTC),
        "new-price-starts": datetime(2026, 11, 15, 12, tzinfo=UTC),
        "new-price": datetime(2026, 11, 30, 6, tzinfo=UTC),
    }
    ids = {}
    for name, at in moments.items():
        ids[name] = uuid.uuid4().hex
        ledger.usage_record_queue(
            {**row, "request_id": ids[name], "created_at": at.isoformat(), "prompt_tokens": 1234567}
        )

    assert ledger.usage_records_store() == 4

    stored = {name: UsageRecord.objects.get(request_id=ids[name]) for name in moments}
    completion = row["completion_tokens"]
    assert completion == len(WORDS)
    old_cost = (Decimal(1234567) * Decimal("1.25") + Decimal(completion) * Decimal("3.5")) / Decimal(1_000_000)
    new_cost = (Decimal(1234567) * Decimal("0.4") + Decimal(completion) * Decimal("1.6")) / Decimal(1_000_000)
    assert old_cost == Decimal("1.543247250")  # exact, no rounding anywhere
    assert (stored["before-any-price"].cost_usd, stored["before-any-price"].price_id) == (None, None)
    assert (stored["old-price"].cost_usd, stored["old-price"].price_id) == (old_cost, old.id)
    assert (stored["new-price-starts"].cost_usd, stored["new-price-starts"].price_id) == (new_cost, new.id)
    assert (stored["new-price"].cost_usd, stored["new-price"].price_id) == (new_cost, new.id)
    assert cost_of(1234567, completion, old) == old_cost
    # A later price change never rewrites the past.
    Price.objects.create(
        model=provider.model,
        input_usd_per_million=Decimal("9"),
        output_usd_per_million=Decimal("9"),
        effective_from=datetime(2026, 11, 20, tzinfo=UTC),
    )
    assert UsageRecord.objects.get(request_id=ids["old-price"]).cost_usd == old_cost


def test_a_model_without_a_price_keeps_no_cost_and_the_local_pool_has_its_own(upstream_server, outbox):
    remote_provider = provider_make(upstream_server, model=f"unpriced-{uuid.uuid4().hex[:8]}")
    key_make(remote_provider)
    request(route_make(remote_provider))
    row = queued_row(outbox)
    local_provider = provider_make("", kind="local", devices=["http://127.0.0.1:9/v1"], model="tests/tiny-local")
    pool = Price.objects.create(
        model=Price.LOCAL_POOL,
        input_usd_per_million=Decimal("0.02"),
        output_usd_per_million=Decimal("0.10"),
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    )
    local_id = uuid.uuid4().hex
    ledger.usage_record_queue(
        {
            **row,
            "request_id": local_id,
            "provider_id": local_provider.id,
            "model": local_provider.model,
            "upstream_key_id": None,
            "prompt_tokens": 1000,
            "completion_tokens": 500,
        }
    )

    assert ledger.usage_records_store() == 2

    unpriced = UsageRecord.objects.get(request_id=row["request_id"])
    assert (unpriced.cost_usd, unpriced.price_id) == (None, None)
    local = UsageRecord.objects.get(request_id=local_id)
    assert (local.cost_usd, local.price_id) == (Decimal("0.00007"), pool.id)


def test_a_reader_that_goes_away_does_not_stop_the_billing_of_what_was_produced(upstream_server, outbox):
    provider = provider_make(upstream_server)
    _, secret = key_make(provider)
    route = route_make(provider)
    request_id = uuid.uuid4().hex
    upstream_script(upstream_server, secret, [{"token_delay_ms": 20}])
    # The reader reads two deltas and leaves (its connection closed), mid-generation.
    reader = threading.Thread(target=lambda: list(itertools.islice(stream_read(request_id, block_ms=10000), 2)))
    reader.start()
    result = run_routed(request_id, payload(route))
    reader.join(timeout=30)
    assert not reader.is_alive()
    ledger.usage_records_store()

    row = UsageRecord.objects.get(request_id=request_id)
    assert (result["status"], row.status, row.completion_tokens) == ("ok", "ok", len(WORDS))


def test_a_row_whose_route_and_key_were_deleted_meanwhile_is_kept_without_the_references(upstream_server, outbox):
    provider = provider_make(upstream_server)
    key_make(provider)
    route = route_make(provider)
    request_id, _ = request(route)
    row = queued_row(outbox)
    outbox.delete(ledger.OUTBOX)
    ledger.usage_record_queue({**row, "route_id": 2**40, "upstream_key_id": 2**40, "workspace_id": 2**40})

    assert ledger.usage_records_store() == 1

    stored = UsageRecord.objects.get(request_id=request_id)
    assert (stored.route_id, stored.upstream_key_id, stored.workspace_id) == (None, None, None)
    assert (stored.route_name, stored.provider_id, stored.completion_tokens) == (route.name, provider.id, len(WORDS))
    assert outbox.xlen(ledger.REJECTED) == 0


def test_storing_a_row_settles_its_client_keys_reservation_to_the_real_cost(upstream_server, outbox):
    from billing import client_keys, limits
    from search.models import Workspace

    provider = provider_make(upstream_server, model=f"model-{uuid.uuid4().hex[:8]}")
    key_make(provider)
    route = route_make(provider)
    price = Price.objects.create(
        model=provider.model,
        input_usd_per_million=Decimal("2"),
        output_usd_per_million=Decimal("8"),
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    )
    workspace = Workspace.objects.create(name="Budget", slug=f"budget-{uuid.uuid4().hex[:8]}")
    client_key, _ = client_keys.client_key_create(workspace, "ci", scopes=["generate"], monthly_budget_usd=Decimal("5"))
    admission = limits.admission_reserve(
        client_key, model=provider.model, local=False, prompt_tokens=100, max_tokens=64
    )
    assert admission.reserved_usd == cost_of(100, 64, price)
    assert limits.budget_state(client_key).reserved_usd == admission.reserved_usd

    request_id = uuid.uuid4().hex
    body = payload(route, client_key_id=client_key.id, admission=admission.as_json())
    run_routed(request_id, body)
    assert ledger.usage_records_store() == 1

    row = UsageRecord.objects.get(request_id=request_id)
    assert row.client_key_id == client_key.id
    assert row.cost_usd == cost_of(row.prompt_tokens, row.completion_tokens, price) < admission.reserved_usd
    state = limits.budget_state(client_key)
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (row.cost_usd, Decimal(0), 0)
    # Drained again (a drainer that died before acknowledging): settled once.
    ledger._settle([{**queued_like(row), "admission": admission.as_json()}])
    assert limits.month_spent(client_key) == row.cost_usd


def queued_like(row: UsageRecord) -> dict:
    return {"request_id": row.request_id.hex, "prompt_tokens": row.prompt_tokens, "completion_tokens": 0}
