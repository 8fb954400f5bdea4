"""Daily rollups of the usage ledger, kept exact by PostgreSQL triggers (billing/dashboard.py).

``billing_usagedaily``: one row per UTC day x kind x model x provider x client key x
release x arm, with the sums the cost and performance dashboards read (requests, errors,
tokens, draft tokens, the latency of answered rows, the cost of priced rows, and the rows
and tokens without a price). ``billing_usagelatency``: per UTC day x release x arm, how
many answered generations fell in each latency bucket (16 per doubling), for the p99 of
the charts.

Why triggers, not the drain or a periodic job: the ledger is written by the drain's one
statement, by tests through the ORM, by operators' SQL and, for ``SET_NULL`` foreign keys,
by Django's own UPDATEs; a statement-level trigger with transition tables sees all of
them, in the same transaction, and sees only the rows an ``INSERT ... ON CONFLICT DO
NOTHING`` actually inserted. So the rollup is always exactly the aggregate of the ledger
(inserts add, deletes subtract, updates do both, TRUNCATE empties it). Upserts lock the
rollup rows in key order (``ORDER BY`` the key), so concurrent drains cannot deadlock.

The tables are not Django models: nothing writes them from Python, and the dashboard
reads them with SQL. ``billing_usage_rollup_rebuild(first, last)`` recomputes a range of
days from the ledger (a repair tool; the triggers never need it).
"""

from django.db import migrations

DAILY_KEY = "day, kind, model, provider_name, client_key_id, release_id, arm"
LATENCY_KEY = "day, release_id, arm, bucket"
# Bucket b holds latencies in [2^(b/16), 2^((b+1)/16)) ms (latencies under 1 ms in bucket 0).
BUCKET = "floor(16 * ln(greatest(r.latency_ms, 1.0)) / ln(2.0))::smallint"

CREATE_TABLES = [
    f"""CREATE TABLE billing_usagedaily (
    day date NOT NULL,
    kind varchar(16) NOT NULL,
    model varchar(300) NOT NULL,
    provider_name varchar(100) NOT NULL,
    client_key_id bigint,
    release_id bigint,
    arm varchar(8) NOT NULL,
    requests bigint NOT NULL,
    ok_requests bigint NOT NULL,
    errors bigint NOT NULL,
    cancelled bigint NOT NULL,
    prompt_tokens bigint NOT NULL,
    completion_tokens bigint NOT NULL,
    ok_completion_tokens bigint NOT NULL,
    ok_latency_ms double precision NOT NULL,
    draft_tokens_proposed bigint NOT NULL,
    draft_tokens_accepted bigint NOT NULL,
    cost_usd numeric(30, 12) NOT NULL,
    priced_requests bigint NOT NULL,
    unpriced_requests bigint NOT NULL,
    unpriced_tokens bigint NOT NULL,
    CONSTRAINT billing_usagedaily_key UNIQUE NULLS NOT DISTINCT ({DAILY_KEY})
)""",
    "COMMENT ON TABLE billing_usagedaily IS "
    "'Daily sums of billing_usagerecord, maintained by its triggers (billing migration 0004).'",
    f"""CREATE TABLE billing_usagelatency (
    day date NOT NULL,
    release_id bigint,
    arm varchar(8) NOT NULL,
    bucket smallint NOT NULL,
    requests bigint NOT NULL,
    CONSTRAINT billing_usagelatency_key UNIQUE NULLS NOT DISTINCT ({LATENCY_KEY})
)""",
    "COMMENT ON TABLE billing_usagelatency IS 'Answered generations per day, release, arm and latency bucket "
    "b: [2^(b/16), 2^((b+1)/16)) ms; maintained by triggers on billing_usagerecord (billing migration 0004).'",
]


def apply_sql(source: str) -> list[str]:
    """Add the rows of ``source`` (ledger columns plus ``sign``: +1 to add, -1 to remove)
    to both rollups: two statements. Used by the triggers (transition tables), by the
    rebuild and by the backfill."""
    daily = f"""
    INSERT INTO billing_usagedaily AS d ({DAILY_KEY}, requests, ok_requests, errors, cancelled, prompt_tokens,
        completion_tokens, ok_completion_tokens, ok_latency_ms, draft_tokens_proposed, draft_tokens_accepted,
        cost_usd, priced_requests, unpriced_requests, unpriced_tokens)
    SELECT (r.created_at AT TIME ZONE 'UTC')::date, r.kind, r.model, r.provider_name, r.client_key_id,
        r.release_id, r.arm,
        sum(r.sign),
        sum(CASE WHEN r.status = 'ok' THEN r.sign ELSE 0 END),
        sum(CASE WHEN r.status = 'error' THEN r.sign ELSE 0 END),
        sum(CASE WHEN r.status = 'cancelled' THEN r.sign ELSE 0 END),
        sum(r.sign * r.prompt_tokens::bigint),
        sum(r.sign * r.completion_tokens::bigint),
        sum(CASE WHEN r.status = 'ok' THEN r.sign * r.completion_tokens::bigint ELSE 0 END),
        sum(CASE WHEN r.status = 'ok' THEN r.sign * r.latency_ms ELSE 0 END),
        sum(r.sign * r.draft_tokens_proposed::bigint),
        sum(r.sign * r.draft_tokens_accepted::bigint),
        coalesce(sum(r.sign * r.cost_usd), 0),
        sum(CASE WHEN r.cost_usd IS NOT NULL THEN r.sign ELSE 0 END),
        sum(CASE WHEN r.cost_usd IS NULL THEN r.sign ELSE 0 END),
        sum(CASE WHEN r.cost_usd IS NULL THEN r.sign * (r.prompt_tokens::bigint + r.completion_tokens) ELSE 0 END)
    FROM {source} r
    GROUP BY 1, 2, 3, 4, 5, 6, 7
    ORDER BY 1, 2, 3, 4, 5, 6, 7
    ON CONFLICT ({DAILY_KEY}) DO UPDATE SET
        requests = d.requests + EXCLUDED.requests,
        ok_requests = d.ok_requests + EXCLUDED.ok_requests,
        errors = d.errors + EXCLUDED.errors,
        cancelled = d.cancelled + EXCLUDED.cancelled,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        ok_completion_tokens = d.ok_completion_tokens + EXCLUDED.ok_completion_tokens,
        ok_latency_ms = d.ok_latency_ms + EXCLUDED.ok_latency_ms,
        draft_tokens_proposed = d.draft_tokens_proposed + EXCLUDED.draft_tokens_proposed,
        draft_tokens_accepted = d.draft_tokens_accepted + EXCLUDED.draft_tokens_accepted,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd,
        priced_requests = d.priced_requests + EXCLUDED.priced_requests,
        unpriced_requests = d.unpriced_requests + EXCLUDED.unpriced_requests,
        unpriced_tokens = d.unpriced_tokens + EXCLUDED.unpriced_tokens"""
    latency = f"""
    INSERT INTO billing_usagelatency AS h ({LATENCY_KEY}, requests)
    SELECT (r.created_at AT TIME ZONE 'UTC')::date, r.release_id, r.arm, {BUCKET}, sum(r.sign)
    FROM {source} r
    WHERE r.status = 'ok' AND r.kind = 'generation'
    GROUP BY 1, 2, 3, 4
    ORDER BY 1, 2, 3, 4
    ON CONFLICT ({LATENCY_KEY}) DO UPDATE SET requests = h.requests + EXCLUDED.requests"""
    return [daily, latency]


def body(statements: list[str]) -> str:
    return "".join(f"{statement};\n" for statement in statements)


def trigger_function(name: str, source: str, *, prune: bool) -> str:
    # Deletes and updates can leave rows at zero: removed, so that the rollup holds what
    # the ledger holds and nothing else.
    prune_sql = (
        ["DELETE FROM billing_usagedaily WHERE requests = 0", "DELETE FROM billing_usagelatency WHERE requests = 0"]
        if prune
        else []
    )
    return f"""
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
{body(apply_sql(source) + prune_sql)}
    RETURN NULL;
END $$"""


ADDED = "(SELECT 1 AS sign, * FROM added_rows)"
REMOVED = "(SELECT -1 AS sign, * FROM removed_rows)"
CHANGED = "(SELECT -1 AS sign, * FROM removed_rows UNION ALL SELECT 1 AS sign, * FROM added_rows)"
# Days [first_day, last_day] (UTC) of the ledger, for the rebuild.
DAYS = (
    "(SELECT 1 AS sign, * FROM billing_usagerecord WHERE created_at >= first_day::timestamp AT TIME ZONE 'UTC'"
    " AND created_at < (last_day + 1)::timestamp AT TIME ZONE 'UTC')"
)

CREATE_TRIGGERS = [
    trigger_function("billing_usage_rollup_insert", ADDED, prune=False),
    trigger_function("billing_usage_rollup_delete", REMOVED, prune=True),
    trigger_function("billing_usage_rollup_update", CHANGED, prune=True),
    """
CREATE FUNCTION billing_usage_rollup_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE billing_usagedaily, billing_usagelatency;
    RETURN NULL;
END $$""",
    """CREATE TRIGGER billing_usage_rollup_insert AFTER INSERT ON billing_usagerecord
    REFERENCING NEW TABLE AS added_rows FOR EACH STATEMENT EXECUTE FUNCTION billing_usage_rollup_insert()""",
    """CREATE TRIGGER billing_usage_rollup_delete AFTER DELETE ON billing_usagerecord
    REFERENCING OLD TABLE AS removed_rows FOR EACH STATEMENT EXECUTE FUNCTION billing_usage_rollup_delete()""",
    """CREATE TRIGGER billing_usage_rollup_update AFTER UPDATE ON billing_usagerecord
    REFERENCING OLD TABLE AS removed_rows NEW TABLE AS added_rows
    FOR EACH STATEMENT EXECUTE FUNCTION billing_usage_rollup_update()""",
    """CREATE TRIGGER billing_usage_rollup_truncate AFTER TRUNCATE ON billing_usagerecord
    FOR EACH STATEMENT EXECUTE FUNCTION billing_usage_rollup_truncate()""",
]

# Recompute days [first_day, last_day] (UTC) from the ledger; returns the days that have
# rows. SHARE mode holds writers back until the transaction ends, so no row is stored
# between the delete and the re-insert.
CREATE_REBUILD = f"""
CREATE FUNCTION billing_usage_rollup_rebuild(first_day date, last_day date) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    days bigint;
BEGIN
    LOCK TABLE billing_usagerecord IN SHARE MODE;
    DELETE FROM billing_usagedaily WHERE day BETWEEN first_day AND last_day;
    DELETE FROM billing_usagelatency WHERE day BETWEEN first_day AND last_day;
{body(apply_sql(DAYS))}
    SELECT count(DISTINCT day) INTO days FROM billing_usagedaily WHERE day BETWEEN first_day AND last_day;
    RETURN days;
END $$"""

# The rows already in the ledger.
BACKFILL = apply_sql("(SELECT 1 AS sign, * FROM billing_usagerecord)")

DROP = [
    "DROP TRIGGER IF EXISTS billing_usage_rollup_insert ON billing_usagerecord",
    "DROP TRIGGER IF EXISTS billing_usage_rollup_delete ON billing_usagerecord",
    "DROP TRIGGER IF EXISTS billing_usage_rollup_update ON billing_usagerecord",
    "DROP TRIGGER IF EXISTS billing_usage_rollup_truncate ON billing_usagerecord",
    "DROP FUNCTION IF EXISTS billing_usage_rollup_insert()",
    "DROP FUNCTION IF EXISTS billing_usage_rollup_delete()",
    "DROP FUNCTION IF EXISTS billing_usage_rollup_update()",
    "DROP FUNCTION IF EXISTS billing_usage_rollup_truncate()",
    "DROP FUNCTION IF EXISTS billing_usage_rollup_rebuild(date, date)",
    "DROP TABLE IF EXISTS billing_usagedaily",
    "DROP TABLE IF EXISTS billing_usagelatency",
]


class Migration(migrations.Migration):
    dependencies = [("billing", "0003_seed_prices")]

    operations = [
        migrations.RunSQL([*CREATE_TABLES, *CREATE_TRIGGERS, CREATE_REBUILD, *BACKFILL], DROP),
    ]
