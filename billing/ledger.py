"""Writing the usage ledger: appended on the request path, stored off it.

A generation's ledger row is appended to the Redis stream ``ledger:outbox`` in the same
``MULTI``/``EXEC`` as its stream's terminal event (``inference.streams``): one round trip
the worker makes anyway, and atomic with it, so a stream that ended always has its row
queued, and a row is never queued for a stream that did not end. The same entry carries the
generation's outcome (its text, stats or error, route and attempts) when someone waits for it:
an answer, or one map step of a map-reduce answer. PostgreSQL gets the rows from
``usage_records_store``, after the reader already has its stream:

- the task ``billing.tasks.ledger_drain`` on queue ``default``, sent by the generation task
  as it ends (``inference.tasks``), stores the row, then hands the outcome to its consumer
  (``outcome_consumer``: the answer is finalized there), and acknowledges the entry
  only after both have committed;
- the beat sends the same task every 15 s, which also takes over entries that a drainer
  read but never acknowledged (it died, PostgreSQL was down, a consumer failed), once they
  have been pending ``LEDGER_CLAIM_IDLE_S`` (``XAUTOCLAIM``).

A generation's end therefore travels once, in one entry, to one consumer: docs/architecture.md,
"Where a generation's end goes".

Each row is priced when stored, at its own time (``created_at``, when the request ended):
``billing.pricing``; the cost and the price used are stored with it, NULL when the model
has no price.

Exactly once: drainers read through the consumer group ``ledger-writers`` (each entry goes
to one of them), a batch is one ``INSERT ... ON CONFLICT (request_id) DO NOTHING`` (a row
stored twice, after a drainer died between the commit and its ``XACK``, is skipped), and
entries are acknowledged and deleted only after the commit. The same statement counts each
upstream key's successes from the rows it actually inserted, so a redelivered row never
counts twice. A row PostgreSQL refuses (a violated constraint: a bug) is moved to the stream
``ledger:rejected`` with the reason, and logged; the rest of its batch is stored.

Why not an INSERT on the request path: it cost 1.1-1.6 ms of the router's 2 ms budget
(``benchmarks/worker_routing_cost.py``), on every request, for a row nobody reads for seconds.
Durability: the outbox is as durable as the Celery queue in the same Redis (append-only
file, fsync every second; docs/operations.md).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import redis
from django.db import DataError, IntegrityError, connection

from billing import limits
from billing.models import UsageRecord
from billing.pricing import PRICE_LATERAL
from ragsite.logs import current_request_id
from ragsite.redis import Role, redis_client, resp_command

logger = logging.getLogger(__name__)

OUTBOX = "ledger:outbox"
REJECTED = "ledger:rejected"
GROUP = "ledger-writers"
BATCH = 500


def outbox_command(row: dict, outcome: dict | None = None) -> bytes:
    """The ``XADD`` that queues ``row`` (``UsageRecord`` attnames to JSON values), in the
    Redis protocol, for a pipelined writer to send with the stream's terminal event; with
    the generation's ``outcome`` when someone waits for it (``outcome["to"]``, see
    ``outcome_consumer``)."""
    fields = [b"row", json.dumps(row).encode()]
    if outcome is not None:
        fields += [b"outcome", json.dumps(outcome).encode()]
    return resp_command(b"XADD", OUTBOX.encode(), b"*", *fields)


# Who takes a generation's outcome once its ledger row is stored, by ``outcome["to"]["kind"]``:
# the module that asks for generations registers its consumer when it is imported (as a Celery
# task registers itself; every worker imports the apps' task modules), so that billing, below
# it, calls it without importing it.
_OUTCOME_CONSUMERS: dict[str, Callable[[dict], None]] = {}


def outcome_consumer(kind: str):
    """Decorator: ``consumer(outcome)`` takes the outcomes addressed to ``kind``, after their
    rows are committed; it must be idempotent (an entry is taken again when its drainer died
    before the ``XACK``) and raise only for a failure worth retrying (the entry stays pending
    and is claimed again after ``LEDGER_CLAIM_IDLE_S``)."""

    def register(consumer: Callable[[dict], None]) -> Callable[[dict], None]:
        _OUTCOME_CONSUMERS[kind] = consumer
        return consumer

    return register


def _outcomes_deliver(entries: list[tuple[bytes, dict]]) -> list[bytes]:
    """Hand each entry's outcome to its consumer; the ids of the entries done with (no
    outcome, or delivered). One addressed to no consumer this process knows stays pending,
    logged: a process that imports it takes it at the next claim."""
    done = []
    for entry_id, fields in entries:
        raw = fields.get(b"outcome")
        if raw is None:
            done.append(entry_id)
            continue
        outcome = json.loads(raw)
        kind = (outcome.get("to") or {}).get("kind")
        consumer = _OUTCOME_CONSUMERS.get(kind)
        if consumer is None:
            logger.error(
                "outcome of request %s addressed to %r, which this process does not take; left pending",
                outcome.get("request_id"),
                kind,
            )
            continue
        try:
            consumer(outcome)
        except Exception:
            logger.exception("outcome of request %s not taken; it is claimed again later", outcome.get("request_id"))
            continue
        done.append(entry_id)
    return done


def usage_record_queue(row: dict, client: redis.Redis | None = None) -> None:
    """Queue one row on its own (paths that have no pipelined writer)."""
    (client or redis_client(Role.STREAMS)).xadd(OUTBOX, {"row": json.dumps(row)})


def usage_records_queue(rows: list[dict], client: redis.Redis | None = None) -> None:
    """Queue several rows in one round trip."""
    if rows:
        pipe = (client or redis_client(Role.STREAMS)).pipeline(transaction=False)
        for row in rows:
            pipe.xadd(OUTBOX, {"row": json.dumps(row)})
        pipe.execute()


def embedding_row(
    *,
    model: str,
    tokens: int,
    latency_ms: float,
    workspace_id: int | None = None,
    user_id: int | None = None,
    client_key_id: int | None = None,
    provider_name: str = "",
    status: str = UsageRecord.Status.OK,
    error_class: str = "",
) -> dict:
    """The ledger row of one embedding call (``kind`` embedding; its tokens are prompt
    tokens), priced like any row by its model when stored; ``trace_id`` is the request id
    current when it is built (the upload's or the API call's, ragsite/logs.py)."""
    return {
        "request_id": uuid.uuid4().hex,
        "trace_id": current_request_id() or "",
        "created_at": datetime.now(tz=UTC).isoformat(),
        "kind": UsageRecord.Kind.EMBEDDING.value,
        "workspace_id": workspace_id,
        "user_id": user_id,
        "client_key_id": client_key_id,
        "route_id": None,
        "route_name": "",
        "release_id": None,
        "arm": "",
        "provider_id": None,
        "provider_name": provider_name,
        "model": model,
        "upstream_key_id": None,
        "prompt_tokens": tokens,
        "completion_tokens": 0,
        "draft_tokens_proposed": 0,
        "draft_tokens_accepted": 0,
        "usage_source": "counted",
        "attempts": 1,
        "latency_ms": max(0.0, latency_ms),
        "ttft_ms": None,
        "status": str(status),
        "error_class": error_class,
        "cost_usd": None,
        "price_id": None,
    }


# --------------------------------------------------------------------------- draining


@functools.cache
def _columns() -> tuple[str, ...]:
    return tuple(field.column for field in UsageRecord._meta.concrete_fields if not field.primary_key)


def _existing(table: str, key: str, column: str) -> str:
    """The row's ``column`` if ``table`` still has that ``key``, else NULL."""
    return f"(SELECT t.{key} FROM {table} t WHERE t.{key} = r.{column})"  # noqa: S608 (names from the models)


def _insert_sql() -> str:
    """One batch: rows from a JSON array (PostgreSQL types each value by its column), each
    priced at its own time (``billing.pricing``: cost in ``numeric``, exact), the new ones
    inserted, and each key's successes among those counted onto the key. A success resets
    the key's consecutive failures unless a failure came after it."""
    columns = _columns()
    # A reference to a row deleted since the request (a route, a key, a workspace...) is
    # stored as NULL, as the foreign key's SET_NULL would have done had the row been there
    # first: the usage itself is kept (its names and figures are columns of its own).
    dangling = {
        field.column: _existing(field.related_model._meta.db_table, field.target_field.column, field.column)
        for field in UsageRecord._meta.concrete_fields
        if field.is_relation and field.column != "price_id"
    }
    computed = {
        **dangling,
        "cost_usd": "COALESCE(r.cost_usd, (r.prompt_tokens * price.input_usd_per_million "
        "+ r.completion_tokens * price.output_usd_per_million) / 1000000)",
        "price_id": "CASE WHEN r.cost_usd IS NULL THEN price.id ELSE r.price_id END",
        # Rows queued without one (before the column existed) have no request id to store.
        "trace_id": "COALESCE(r.trace_id, '')",
    }
    names = ", ".join(connection.ops.quote_name(column) for column in columns)
    values = ", ".join(computed.get(column, f"r.{connection.ops.quote_name(column)}") for column in columns)
    return f"""
WITH inserted AS (
    INSERT INTO billing_usagerecord ({names})
    SELECT {values}
    FROM jsonb_populate_recordset(NULL::billing_usagerecord, %s::jsonb) r
    LEFT JOIN inference_provider provider ON provider.id = r.provider_id
    {PRICE_LATERAL}
    ON CONFLICT (request_id) DO NOTHING
    RETURNING request_id, upstream_key_id, status, created_at
), successes AS (
    SELECT upstream_key_id, count(*) AS n, max(created_at) AS last_at FROM inserted
    WHERE status = 'ok' AND upstream_key_id IS NOT NULL GROUP BY upstream_key_id
), counted AS (
    UPDATE inference_upstreamkey k SET
        success_count = k.success_count + s.n,
        consecutive_failures = CASE
            WHEN k.last_failure_at IS NULL OR k.last_failure_at < s.last_at THEN 0
            ELSE k.consecutive_failures END
    FROM successes s WHERE k.id = s.upstream_key_id
    RETURNING k.id
)
SELECT request_id::text FROM inserted
"""  # noqa: S608 (column names from the model; the rows are one bound parameter)


def _store(rows: list[dict]) -> set[str]:
    """Insert a batch in one statement (one transaction); the request ids inserted now."""
    with connection.cursor() as cursor:
        cursor.execute(_insert_sql(), [json.dumps(rows)])
        return {request_id for (request_id,) in cursor.fetchall()}


# What PostgreSQL answers to a row it refuses (a violated constraint, a value of the wrong
# type): the row is at fault, not the database, and retrying it would block the queue.
REFUSED = (IntegrityError, DataError)


def _store_each(entries: list[tuple[bytes, dict]], client: redis.Redis) -> int:
    """A batch PostgreSQL refused: row by row, each refused row set aside with its reason."""
    inserted = 0
    for entry_id, row in entries:
        try:
            inserted += len(_store([row]))
        except REFUSED as exc:
            reason = f"{type(exc).__name__}: {exc}".strip()
            logger.error(
                "ledger row %s refused by PostgreSQL, set aside in %s: %s", row.get("request_id"), REJECTED, reason
            )
            client.xadd(REJECTED, {"row": json.dumps(row), "reason": reason, "entry": entry_id})
    return inserted


def _settle(rows: list[dict]) -> None:
    """Settle the client-key admissions of stored rows (``billing.limits``): the reservation
    replaced by the stored cost. Idempotent per reservation, so a row drained twice (a
    drainer died before its XACK) settles once; a row that was refused is charged what was
    reserved, the most it could have cost."""
    if not rows:
        return
    costs = dict(
        UsageRecord.objects.filter(request_id__in=[row["request_id"] for row in rows]).values_list(
            "request_id", "cost_usd"
        )
    )
    costs = {request_id.hex: cost for request_id, cost in costs.items()}
    for row in rows:
        request_key = row["request_id"].replace("-", "")
        try:
            limits.admission_settle(
                limits.Admission.from_json(row["admission"]),
                actual_cost_usd=costs.get(request_key),
                actual_tokens=int(row.get("prompt_tokens") or 0) + int(row.get("completion_tokens") or 0),
            )
        except Exception:  # the row is stored; a settlement left undone expires (limits.reservation_ttl_s)
            logger.exception("the admission of request %s could not be settled", row["request_id"])


def _consumer() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _ensure_group(client: redis.Redis) -> None:
    try:
        client.xgroup_create(OUTBOX, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _read(client: redis.Redis, *, claim_idle_ms: int | None, count: int) -> list[tuple[bytes, dict]]:
    """Entries for this consumer: first those pending longer than ``claim_idle_ms`` with
    any consumer (when given), then new ones."""
    consumer = _consumer()
    for _ in range(2):
        try:
            if claim_idle_ms is not None:
                claimed = client.xautoclaim(OUTBOX, GROUP, consumer, min_idle_time=claim_idle_ms, count=count)[1]
                entries = [(entry_id, fields) for entry_id, fields in claimed if fields]
                if entries:
                    return entries
            read = client.xreadgroup(GROUP, consumer, {OUTBOX: ">"}, count=count)
            return [(entry_id, fields) for _, items in read for entry_id, fields in items]
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            _ensure_group(client)  # first use, or the stream was deleted
    return []


def usage_records_store(*, claim_idle_ms: int | None = None, batch: int = BATCH, max_batches: int | None = None) -> int:
    """Store queued ledger rows in PostgreSQL until none is left (or ``max_batches``);
    returns how many were inserted now. ``claim_idle_ms``: also take over entries another
    drainer read that long ago and never acknowledged (the beat task; 0 in tests). A
    database error leaves the batch pending, to be claimed later, and is raised."""
    client = redis_client(Role.STREAMS)
    inserted, batches = 0, 0
    while max_batches is None or batches < max_batches:
        entries = _read(client, claim_idle_ms=claim_idle_ms, count=batch)
        if not entries:
            break
        batches += 1
        parsed = [(entry_id, json.loads(fields[b"row"])) for entry_id, fields in entries]
        try:
            inserted += len(_store([row for _, row in parsed]))
        except REFUSED:  # find the refused row, store the others
            inserted += _store_each(parsed, client)
        _settle([row for _, row in parsed if row.get("admission")])
        ids = _outcomes_deliver(entries)  # after the rows' commit: a consumer finds its row stored
        if ids:
            pipe = client.pipeline(transaction=False)
            pipe.xack(OUTBOX, GROUP, *ids)
            pipe.xdel(OUTBOX, *ids)
            pipe.execute()
        if len(ids) < len(entries):
            break  # an outcome left pending: it waits for the claim, not for this loop
    return inserted


def usage_outbox_backlog(client: redis.Redis | None = None) -> dict:
    """Rows waiting (queued and read but not stored) and rows refused, for /readyz and
    operators."""
    client = client or redis_client(Role.STREAMS)
    pipe = client.pipeline(transaction=False)
    pipe.xlen(OUTBOX)
    pipe.xlen(REJECTED)
    queued, rejected = pipe.execute()
    return {"queued": queued, "rejected": rejected}
