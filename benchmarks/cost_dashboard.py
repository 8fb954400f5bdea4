"""Cost dashboard: the monthly summary and the stable/canary comparison over a large ledger.

    python -m benchmarks.cost_dashboard [--rows 1000000] [--runs 7] [--keep] [--explain]

Method
------
Database. A database of its own, ``ragsite_bench_cost``, on the project's PostgreSQL
(``DATABASE_URL``, else the embedded server under ``var/``), created and migrated here
(so with the rollup triggers of billing migration 0004), and dropped at the end unless
``--keep``.

Ledger. ``--rows`` rows (fixed seed) over the 91 days before now, written with COPY
(psycopg) in batches of 50,000 rows, each batch one statement, so the rollup trigger runs
once per batch as it runs once per drained batch in production; ``load_s`` includes it.
Traffic: 20 client keys (Zipf-like shares, 5 % of rows without a key); routes ``default``
(gpt-4.1, 60 %), ``cheap`` (deepseek-chat), ``long`` (claude-sonnet-4-5), ``local`` (the GPU
pool, with draft tokens), ``lab`` (a model without a price: NULL cost) and embeddings (no
price either). Two canary releases on ``default``: one rolled back (days 10-40, 10 % to
deepseek-chat, more errors), one live for the last 30 days (20 % to the local pool).
Latencies are log-normal per model (median 0.5-2.5 s), errors 1.5 % (6 % on the failed
canary), cancellations 0.5 %. Costs are each row's tokens at the seeded prices (exact, in
units of 1e-12 USD); rows without a price keep a NULL cost.

Timed, as the dashboard computes them (the same functions of ``billing.dashboard``), after
one warm-up, median of ``--runs``:

- ``summary_ms``: ``usage_summary`` over the months of the data (4 or 5 months, the
  current one projected), from the daily rollup;
- ``comparison_ms``: ``compare_arms`` for the live release over its 30 days, from the
  ledger's rows (exact p99); ``comparison_ended_ms`` for the rolled-back one;
- ``charts_ms``: ``usage_daily_series`` over the last 30 days, from the rollups.

For the choice between a rollup and indexes: ``summary_from_ledger_ms`` is the same summary
computed from the ledger itself (one GROUP BY over the months' rows, parallel scan), checked
to give the same rows (``rollup_matches_ledger``). ``comparison_default_work_mem_ms`` is the
comparison with PostgreSQL's default 4 MB of sort memory instead of ``COMPARISON_WORK_MEM``.

What the rollup costs the drain: ``drain_batch_ms`` times the drain's own statement
(``billing.ledger._store``: 500 rows priced and inserted with ``ON CONFLICT DO NOTHING``)
with the rollup trigger on and off (``ALTER TABLE ... DISABLE TRIGGER`` in the same
transaction), each batch rolled back, interleaved, median of 30 each.

Ledger writes and generation (``write_*``): what a generation's ledger row costs on its
request's path, where it is only queued: the stream's terminal event written with the row
in the same ``MULTI``/``EXEC`` (``write_p50_ms``) against the terminal event alone
(``terminal_only_p50_ms``), interleaved, 300 each; then, off the path, storing that one
row (``billing.ledger.usage_records_store``: priced, inserted, rolled up; ``store_one_p50_ms``). Redis
is the project's server, database number ``REDIS_DB`` (emptied first).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import numpy as np

from benchmarks.common import own_databases, report

DATABASE = "ragsite_bench_cost"
REDIS_DB = 14
SEED = 20261130
DAYS = 91
BATCH = 50_000
KEYS = 20
# (route, model, provider, provider kind, latency median in ms, share of rows)
ROUTES = [
    ("default", "gpt-4.1", "openai", "openai-compatible", 1800, 0.60),
    ("cheap", "deepseek-chat", "deepseek", "openai-compatible", 1400, 0.14),
    ("long", "claude-sonnet-4-5", "anthropic", "openai-compatible", 2500, 0.12),
    ("local", "qwen2.5-7b-instruct", "gpu-pool", "local", 700, 0.08),
    ("lab", "mystery-70b", "lab-vllm", "openai-compatible", 1200, 0.03),
    ("embed", "all-MiniLM-L6-v2", "embedder", "local", 40, 0.03),
]
# USD per million tokens (input, output), as seeded by billing migration 0003; the local
# model has the GPU pool's price; the others have none (NULL cost).
PRICES = {
    "gpt-4.1": ("2.00", "8.00"),
    "deepseek-chat": ("0.28", "0.42"),
    "claude-sonnet-4-5": ("3.00", "15.00"),
    "qwen2.5-7b-instruct": ("0.02", "0.10"),
}
COLUMNS = (
    "request_id, created_at, kind, client_key_id, route_id, route_name, release_id, arm, provider_id, "
    "provider_name, model, prompt_tokens, completion_tokens, draft_tokens_proposed, draft_tokens_accepted, "
    "usage_source, attempts, latency_ms, ttft_ms, status, error_class, cost_usd, price_id, trace_id"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="Ledger rows to generate.")
    parser.add_argument("--runs", type=int, default=7, help="Timed runs of each query (after one warm-up).")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    parser.add_argument("--explain", action="store_true", help="Print EXPLAIN ANALYZE of the comparison's query.")
    args = parser.parse_args()

    with own_databases(DATABASE, REDIS_DB, keep=args.keep):
        result = run(args)
    report("cost_dashboard", result)


def timed(function, runs: int) -> tuple[float, object]:
    """Median milliseconds of ``runs`` calls after one untimed call; the last result."""
    result = function()
    spent = []
    for _ in range(runs):
        started = time.perf_counter()
        result = function()
        spent.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(spent), 1), result


# --------------------------------------------------------------------------- data


def fixtures(now):
    """Providers, routes, the two releases and the client keys the rows point at."""
    from billing.models import ClientKey, Price
    from inference.models import CanaryRelease, Provider, Route
    from search.models import Workspace

    providers, routes = {}, {}
    for route_name, model, provider_name, kind, *_ in ROUTES:
        base_url = "" if kind == "local" else f"https://{provider_name}.example/v1"
        devices = [f"http://{provider_name}.example:8000/v1"] if kind == "local" else []  # a pool has devices
        provider = Provider.objects.create(
            name=provider_name, kind=kind, base_url=base_url, model=model, devices=devices
        )
        providers[model] = provider
        routes[route_name] = Route.objects.create(
            name=route_name, provider=provider, is_default=route_name == "default"
        )
    workspace = Workspace.objects.create(name="Bench", slug="bench-cost")
    keys = [
        ClientKey.objects.create(
            workspace=workspace,
            name=f"client-{n:02d}",
            prefix=f"bench{n:02d}",
            secret_hash="0" * 64,
            last_four="0000",
            monthly_budget_usd=Decimal(500 + 100 * n),
        ).pk
        for n in range(KEYS)
    ]
    # The canary routes of the releases: their own routes on the same providers.
    to_deepseek = Route.objects.create(name="default-deepseek", provider=providers["deepseek-chat"])
    to_local = Route.objects.create(name="default-local", provider=providers["qwen2.5-7b-instruct"])
    ended = CanaryRelease.objects.create(
        name="deepseek on default",
        stable_route=routes["default"],
        canary_route=to_deepseek,
        percent=10,
        state=CanaryRelease.State.ROLLED_BACK,
    )
    live = CanaryRelease.objects.create(
        name="local pool on default", stable_route=routes["default"], canary_route=to_local, percent=20
    )
    start = now - timedelta(days=DAYS)
    periods = {
        ended.pk: (start + timedelta(days=10), start + timedelta(days=40), 0.10, to_deepseek),
        live.pk: (now - timedelta(days=30), now, 0.20, to_local),
    }
    CanaryRelease.objects.filter(pk=ended.pk).update(created_at=periods[ended.pk][0], updated_at=periods[ended.pk][1])
    CanaryRelease.objects.filter(pk=live.pk).update(created_at=periods[live.pk][0])
    prices = {model: Price.objects.filter(model=model).order_by("-effective_from").first() for model in PRICES}
    prices["qwen2.5-7b-instruct"] = Price.objects.filter(model=Price.LOCAL_POOL).first()
    return providers, routes, keys, periods, prices


def rows_make(n: int, now, providers, routes, keys, periods, prices) -> dict[str, list]:
    """The ledger's columns, one list per column, in time order (as the table fills)."""
    rng = np.random.default_rng(SEED)
    start_s = (now - timedelta(days=DAYS)).timestamp()
    seconds = np.sort(rng.uniform(start_s, now.timestamp() - 1, n))
    route_index = rng.choice(len(ROUTES), size=n, p=[share for *_, share in ROUTES])
    models = np.array([model for _, model, *_ in ROUTES], dtype=object)[route_index]
    route_names = np.array([name for name, *_ in ROUTES], dtype=object)[route_index]
    medians = np.array([median for *_, median, _ in ROUTES], dtype=float)[route_index]

    # Canary arms on the default route while a release runs; the canary's model serves.
    release_ids = np.full(n, None, dtype=object)
    arms = np.full(n, "", dtype=object)
    error_share = np.full(n, 0.015)
    default = route_names == "default"
    for release_id, (begin, end, share, canary_route) in periods.items():
        inside = default & (seconds >= begin.timestamp()) & (seconds < end.timestamp())
        canary = inside & (rng.random(n) < share)
        release_ids[inside] = release_id
        arms[inside] = "stable"
        arms[canary] = "canary"
        models[canary] = canary_route.provider.model
        medians[canary] = next(median for _, model, *rest, median, _ in ROUTES if model == canary_route.provider.model)
        if canary_route.name == "default-deepseek":
            error_share[canary] = 0.06  # the release that was rolled back
    route_ids = np.array([routes[name].pk for name in route_names], dtype=object)
    provider_ids = np.array([providers[model].pk for model in models], dtype=object)
    provider_names = np.array([providers[model].name for model in models], dtype=object)

    draw = rng.random(n)
    status = np.where(draw < error_share, "error", np.where(draw < error_share + 0.005, "cancelled", "ok"))
    embedding = models == "all-MiniLM-L6-v2"
    prompt = np.clip(rng.lognormal(np.log(1200), 0.8, n), 20, 16000).astype(np.int64)
    completion = np.clip(rng.lognormal(np.log(250), 0.7, n), 1, 4000).astype(np.int64)
    completion[embedding] = 0
    completion[status == "error"] = 0
    latency = np.round(rng.lognormal(np.log(medians), 0.45), 3)
    latency[status == "error"] = np.round(latency[status == "error"] * 0.3, 3)
    ttft = np.round(latency * rng.uniform(0.1, 0.3, n), 3)
    local = models == "qwen2.5-7b-instruct"
    proposed = np.where(local, (completion * rng.uniform(1.2, 1.8, n)).astype(np.int64), 0)
    accepted = np.where(local, (proposed * rng.uniform(0.5, 0.8, n)).astype(np.int64), 0)
    key_weights = 1 / np.arange(1, KEYS + 1)
    key_index = rng.choice(KEYS, size=n, p=key_weights / key_weights.sum())
    client_keys = np.array(keys, dtype=object)[key_index]
    client_keys[rng.random(n) < 0.05] = None

    # Exact cost in units of 1e-12 USD: tokens x (USD per million tokens x 1e6).
    costs = np.full(n, None, dtype=object)
    price_ids = np.full(n, None, dtype=object)
    for model, price in prices.items():
        mine = models == model
        micro_in = int(price.input_usd_per_million * 1_000_000)
        micro_out = int(price.output_usd_per_million * 1_000_000)
        picos = prompt[mine] * micro_in + completion[mine] * micro_out
        costs[mine] = [f"{value // 10**12}.{value % 10**12:012d}" for value in picos.tolist()]
        price_ids[mine] = price.pk
    raw = rng.bytes(16 * n).hex()  # request ids: 32 hex digits each
    return {
        "request_id": [raw[32 * i : 32 * i + 32] for i in range(n)],
        "created_at": [datetime.fromtimestamp(value, tz=UTC) for value in seconds.tolist()],
        "kind": np.where(embedding, "embedding", "generation").tolist(),
        "client_key_id": client_keys.tolist(),
        "route_id": np.where(embedding, None, route_ids).tolist(),
        "route_name": np.where(embedding, "", route_names).tolist(),
        "release_id": release_ids.tolist(),
        "arm": arms.tolist(),
        "provider_id": provider_ids.tolist(),
        "provider_name": provider_names.tolist(),
        "model": models.tolist(),
        "prompt_tokens": prompt.tolist(),
        "completion_tokens": completion.tolist(),
        "draft_tokens_proposed": proposed.tolist(),
        "draft_tokens_accepted": accepted.tolist(),
        "usage_source": np.where(local, "engine", np.where(embedding, "counted", "upstream")).tolist(),
        "attempts": np.where(status == "error", 2, 1).tolist(),
        "latency_ms": latency.tolist(),
        "ttft_ms": np.where(status == "ok", ttft, None).tolist(),
        "status": status.tolist(),
        "error_class": np.where(status == "error", "server_error", "").tolist(),
        "cost_usd": costs.tolist(),
        "price_id": price_ids.tolist(),
        "trace_id": [""] * n,  # no trace: requests made outside a traced web request
    }


def copy_rows(columns: dict[str, list]) -> float:
    """COPY the rows in batches (one statement, so one trigger run, each); seconds taken."""
    from django.db import connection

    names = [name.strip() for name in COLUMNS.split(",")]
    n = len(columns["request_id"])
    ordered = [columns[name] for name in names]
    started = time.perf_counter()
    connection.ensure_connection()
    raw = connection.connection
    with raw.cursor() as cursor:
        for begin in range(0, n, BATCH):
            end = min(begin + BATCH, n)
            with cursor.copy(f"COPY billing_usagerecord ({COLUMNS}) FROM STDIN") as copy:
                for i in range(begin, end):
                    copy.write_row([column[i] for column in ordered])
            raw.commit()
    return time.perf_counter() - started


# --------------------------------------------------------------------------- measures


SUMMARY_FROM_LEDGER = """
SELECT date_trunc('month', created_at AT TIME ZONE 'UTC')::date AS month, model, provider_name, client_key_id, arm,
       count(*), count(*) FILTER (WHERE status = 'error'), sum(prompt_tokens), sum(completion_tokens),
       coalesce(sum(cost_usd), 0), count(cost_usd), count(*) - count(cost_usd),
       coalesce(sum(prompt_tokens + completion_tokens) FILTER (WHERE cost_usd IS NULL), 0)
FROM billing_usagerecord
WHERE created_at >= %s AND created_at < %s
GROUP BY 1, 2, 3, 4, 5
ORDER BY 1, 10 DESC, 2, 3, 4, 5
"""


def summary_from_ledger(first, end) -> list[tuple]:
    """The summary's rows computed from the ledger itself (the alternative to the rollup)."""
    from django.db import connection

    from billing.dashboard import month_start_utc

    with connection.cursor() as cursor:
        cursor.execute(SUMMARY_FROM_LEDGER, [month_start_utc(first), month_start_utc(end)])
        return cursor.fetchall()


def _drain_rows(columns: dict[str, list], base: int, count: int) -> list[dict]:
    """Rows shaped as the drain receives them (fresh request ids, ended now)."""
    names = [name.strip() for name in COLUMNS.split(",")]
    ended = datetime.now(tz=UTC).isoformat()
    rows = []
    for i in range(base, base + count):
        row = {name: columns[name][i] for name in names}
        row.update(request_id=uuid.uuid4().hex, created_at=ended)
        rows.append(row)
    return rows


def drain_batches(columns: dict[str, list], batches: int) -> dict:
    """The drain's statement on 500 rows, with the rollup trigger on and off, rolled back."""
    from django.db import connection, transaction

    from billing import ledger

    spent: dict[str, list[float]] = {"with_rollup": [], "without_rollup": []}
    for number in range(2 * batches + 2):
        side = "with_rollup" if number % 2 == 0 else "without_rollup"
        rows = _drain_rows(columns, (number * 500) % (len(columns["request_id"]) - 500), 500)
        with transaction.atomic():
            if side == "without_rollup":
                with connection.cursor() as cursor:
                    cursor.execute("ALTER TABLE billing_usagerecord DISABLE TRIGGER billing_usage_rollup_insert")
            started = time.perf_counter()
            inserted = len(ledger._store(rows))
            elapsed = (time.perf_counter() - started) * 1000
            transaction.set_rollback(True)
        if inserted != 500:
            raise SystemExit(f"a drain batch inserted {inserted} rows, expected 500")
        if number >= 2:  # the first of each side warms up
            spent[side].append(elapsed)
    return {side: round(statistics.median(values), 2) for side, values in spent.items()}


def ledger_writes(columns: dict[str, list], requests: int = 300) -> dict:
    """A generation's ledger row on its path (queued with the terminal event) and off it
    (stored by the drain); see the module docstring."""
    from billing import ledger
    from billing.models import UsageRecord
    from inference.streams import PipelinedStreamWriter

    spent: dict[str, list[float]] = {"with_row": [], "terminal_only": [], "store": []}
    queued: list[str] = []
    for number in range(2 * requests + 2):
        side = "with_row" if number % 2 == 0 else "terminal_only"
        writer = PipelinedStreamWriter(uuid.uuid4().hex)
        writer.write("delta", text="Lift")  # a stream under way, as a generation's end finds it
        writer.flush()
        if side == "with_row":
            (row,) = _drain_rows(columns, number % (len(columns["request_id"]) - 1), 1)
            writer.end_with(ledger.outbox_command(row))
            queued.append(row["request_id"])
        started = time.perf_counter()
        writer.write("stats", completion_tokens=1, attempts=1)
        elapsed = (time.perf_counter() - started) * 1000
        writer.close()
        if side == "with_row":
            store_started = time.perf_counter()
            ledger.usage_records_store()
            store_ms = (time.perf_counter() - store_started) * 1000
        if number >= 2:
            spent[side].append(elapsed)
            if side == "with_row":
                spent["store"].append(store_ms)
    stored = UsageRecord.objects.filter(request_id__in=queued).count()
    if stored != len(queued):
        raise SystemExit(f"the drain stored {stored} of the {len(queued)} rows queued")
    return {
        "write_p50_ms": round(statistics.median(spent["with_row"]), 3),
        "terminal_only_p50_ms": round(statistics.median(spent["terminal_only"]), 3),
        "store_one_p50_ms": round(statistics.median(spent["store"]), 3),
    }


def run(args) -> dict:
    from django.db import connection, transaction
    from django.utils import timezone

    from billing import dashboard

    now = timezone.now().replace(microsecond=0)
    providers, routes, keys, periods, prices = fixtures(now)
    started = time.perf_counter()
    columns = rows_make(args.rows, now, providers, routes, keys, periods, prices)
    generate_s = time.perf_counter() - started
    load_s = copy_rows(columns)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE billing_usagerecord")
        cursor.execute("VACUUM ANALYZE billing_usagedaily")
        cursor.execute("VACUUM ANALYZE billing_usagelatency")
        cursor.execute("SELECT count(*), count(*) - count(cost_usd) FROM billing_usagerecord")
        rows, null_costs = cursor.fetchone()
        cursor.execute("SELECT count(*) FROM billing_usagedaily")
        (daily_rows,) = cursor.fetchone()
        cursor.execute("SELECT count(*) FROM billing_usagelatency")
        (latency_rows,) = cursor.fetchone()

    first_month = dashboard.month_floor((now - timedelta(days=DAYS)).date())
    current_month = dashboard.month_floor(now.date())
    summary_ms, summary = timed(lambda: dashboard.usage_summary(first_month, current_month, now=now), args.runs)
    from_ledger_ms, ledger_rows = timed(
        lambda: summary_from_ledger(first_month, dashboard.next_month(current_month)), args.runs
    )
    from_rollup = {
        (row.month, row.model, row.provider, row.client_key_id, row.arm): (
            row.requests,
            row.errors,
            row.prompt_tokens,
            row.completion_tokens,
            row.cost_usd,
            row.priced_requests,
            row.unpriced_requests,
            row.unpriced_tokens,
        )
        for row in summary.rows
    }
    from_ledger = {tuple(row[:5]): tuple(row[5:]) for row in ledger_rows}
    matches = from_rollup == from_ledger and len(from_rollup) == len(summary.rows)

    (ended_id, ended_period), (live_id, live_period) = [(pk, period) for pk, period in periods.items()]
    live_start, live_end = live_period[0], live_period[1]
    comparison_ms, comparison = timed(lambda: dashboard.compare_arms(live_id, live_start, live_end), args.runs)
    ended_ms, _ = timed(lambda: dashboard.compare_arms(ended_id, ended_period[0], ended_period[1]), args.runs)

    def default_work_mem():
        with transaction.atomic():
            return list(dashboard.comparison_queryset(live_id, live_start, live_end))

    default_mem_ms, _ = timed(default_work_mem, args.runs)
    charts_ms, _ = timed(lambda: dashboard.usage_daily_series(now.date() - timedelta(days=29), now.date()), args.runs)
    drain = drain_batches(columns, 30)
    writes = ledger_writes(columns)
    if args.explain:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL work_mem = '{dashboard.COMPARISON_WORK_MEM}'")
            print(dashboard.comparison_queryset(live_id, live_start, live_end).explain(analyze=True, buffers=True))

    current = summary.current
    return {
        "rows": rows,
        "summary_ms": summary_ms,
        "comparison_ms": comparison_ms,
        "charts_ms": charts_ms,
        "comparison_ended_ms": ended_ms,
        "summary_from_ledger_ms": from_ledger_ms,
        "comparison_default_work_mem_ms": default_mem_ms,
        "rollup_matches_ledger": matches,
        "comparison_rows": comparison.stable.requests + comparison.canary.requests,
        "summary_rows": len(summary.rows),
        "months": len(summary.months),
        "null_cost_rows": null_costs,
        "daily_rollup_rows": daily_rows,
        "latency_rollup_rows": latency_rows,
        "drain_batch_500_ms": drain,
        **writes,
        "write_method": "on the path: the terminal event with the row queued (MULTI/EXEC); stored off the path",
        "load_s": round(load_s, 1),
        "generate_s": round(generate_s, 1),
        "month_to_date_usd": str(current.cost_usd.quantize(Decimal("0.01"))) if current else None,
        "projected_usd": str(current.projected_usd.quantize(Decimal("0.01"))) if current else None,
        "comparison": {
            row.key: [
                None if row.stable is None else round(float(row.stable), 4),
                None if row.canary is None else round(float(row.canary), 4),
                None if row.change_percent is None else round(float(row.change_percent), 1),
            ]
            for row in comparison.rows
        },
        "runs": args.runs,
        "method": "median of runs after one warm-up; same process, same database",
    }


if __name__ == "__main__":
    main()
