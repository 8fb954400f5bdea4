"""Monthly cost and dashboards: the figures behind the admin's billing pages (``frontdoors.dashboards``).

Where each figure comes from
----------------------------
- Monthly cost (``usage_summary``, ``summary_csv``) and the daily charts
  (``usage_daily_series``) read the daily rollups ``billing_usagedaily`` and
  ``billing_usagelatency`` (migration 0004), which PostgreSQL triggers on the ledger keep
  equal to the ledger's own sums, in the same transaction as each insert (the drain needs
  to call nothing). A month is at most a few thousand rollup rows whatever the traffic, so
  these pages cost the same at a million rows a month as at a hundred.
- The stable/canary comparison (``compare_arms``) reads the ledger's raw rows of the
  release in the period (index ``usage_release_arm_time``): its p99 is exact
  (``percentile_cont``, as the canary analysis computes it), which no rollup can give.

Money is ``Decimal`` throughout: sums are exact (``numeric`` in SQL), projections are
rounded once, to the ledger's 12 decimals. A row whose model has no price (``cost_usd``
NULL) is never counted as 0: costs are sums over priced rows, and every total says how many
requests (and tokens) of which model had no price. Costs are stored and computed in USD; the
display currency (``BILLING_DISPLAY_CURRENCY`` at ``BILLING_EXCHANGE_RATE`` per USD) is
applied only when showing or exporting, also in ``Decimal``.

Projection to month end: month-to-date cost / elapsed time x the month's length, both to the
second (``project_month``): a linear run rate over the elapsed part of the month.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, localcontext

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Avg, Count, Q, Sum
from django.utils import timezone

from billing.models import COST_DECIMALS, BudgetAlert, ClientKey, UsageRecord
from ragsite.aggregates import PercentileCont
from ragsite.databases import reads

COST_QUANTUM = Decimal(1).scaleb(-COST_DECIMALS)
DAY_SECONDS = 86_400
# The average Gregorian month (365.2425 days / 12), for a comparison period's monthly cost:
# it depends on no particular month.
AVERAGE_MONTH_SECONDS = 2_629_746
# Latency buckets of billing_usagelatency: bucket b is [2^(b/16), 2^((b+1)/16)) ms; a
# bucket's estimate is its geometric middle, within 2.2 % of any latency in it.
BUCKETS_PER_DOUBLING = 16
STABLE, CANARY = "stable", "canary"
# Sorting memory for the comparison's percentiles (this query only). PostgreSQL's default
# 4 MB holds about 150,000 latencies; past that the sort goes to disk: over 330,000 rows,
# 390 ms with 4 MB against 358 ms (benchmarks/cost_dashboard.py machine).
COMPARISON_WORK_MEM = "64MB"


# --------------------------------------------------------------------------- months, money


def month_floor(day: date) -> date:
    return date(day.year, day.month, 1)


def next_month(month: date) -> date:
    return date(month.year + month.month // 12, month.month % 12 + 1, 1)


def month_seconds(month: date) -> int:
    return (next_month(month) - month_floor(month)).days * DAY_SECONDS


def month_start_utc(month: date) -> datetime:
    return datetime(month.year, month.month, 1, tzinfo=UTC)


def display_currency() -> str:
    return settings.BILLING_DISPLAY_CURRENCY


def exchange_rate() -> Decimal:
    """Units of the display currency per USD."""
    return settings.BILLING_EXCHANGE_RATE


def to_display(amount_usd: Decimal | None) -> Decimal | None:
    """A USD amount in the display currency, exact (no rounding: that is the page's job)."""
    return None if amount_usd is None else amount_usd * exchange_rate()


def _exact(value: Decimal) -> Decimal:
    """Round once, to the ledger's precision; arithmetic before it runs at 60 digits."""
    return value.quantize(COST_QUANTUM)


def project_month(mtd_usd: Decimal, month: date, now: datetime) -> Decimal:
    """The month's cost at its run rate so far: ``mtd * month length / elapsed``, both in
    seconds (so "elapsed days" counts the day in progress by its hours). A month that has
    ended projects to what it cost; one that has not started, to its cost so far."""
    elapsed = int((now - month_start_utc(month)).total_seconds())
    length = month_seconds(month)
    if elapsed >= length or elapsed <= 0:
        return mtd_usd
    with localcontext() as context:
        context.prec = 60
        return _exact(mtd_usd * length / elapsed)


# --------------------------------------------------------------------------- monthly summary


@dataclass
class Totals:
    """Sums over ledger rows. ``cost_usd`` is over the priced rows only; the others are
    counted in ``unpriced_requests`` / ``unpriced_tokens`` (prompt plus completion)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    priced_requests: int = 0
    unpriced_requests: int = 0
    unpriced_tokens: int = 0

    def add(self, other: Totals) -> None:
        for name in Totals.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def cost_known(self) -> Decimal | None:
        """The cost, or None when no row had a price (unknown, not zero)."""
        return self.cost_usd if self.priced_requests else None

    @property
    def complete(self) -> bool:
        return self.unpriced_requests == 0


@dataclass
class SummaryRow(Totals):
    month: date = None
    model: str = ""
    provider: str = ""
    client_key_id: int | None = None
    client_key: str = ""
    arm: str = ""
    projected_usd: Decimal | None = None  # the month in progress only


@dataclass
class MonthTotals(Totals):
    month: date = None
    current: bool = False
    projected_usd: Decimal | None = None
    elapsed_s: int | None = None  # the month in progress only
    month_s: int = 0


@dataclass
class Unpriced:
    month: date
    model: str
    provider: str
    requests: int
    tokens: int

    @property
    def message(self) -> str:
        plural = "request" if self.requests == 1 else "requests"
        have = "has" if self.requests == 1 else "have"
        via = f" (provider {self.provider})" if self.provider else ""
        return (
            f"{self.requests} {plural} of model {self.model or '(none)'}{via} {have} no price in "
            f"{self.month:%Y-%m} ({self.tokens} tokens): not included in the costs"
        )


@dataclass
class KeyMonth:
    """A client key's month in progress against its budget."""

    client_key_id: int | None
    client_key: str
    spent_usd: Decimal
    projected_usd: Decimal
    unpriced_requests: int
    budget_usd: Decimal | None

    @property
    def projected_percent(self) -> Decimal | None:
        if not self.budget_usd:
            return None
        return (self.projected_usd * 100 / self.budget_usd).quantize(Decimal("0.1"))


@dataclass
class MonthlySummary:
    first_month: date
    last_month: date
    now: datetime
    months: list[MonthTotals]
    rows: list[SummaryRow]
    unpriced: list[Unpriced]
    keys: list[KeyMonth]
    alerts: list[BudgetAlert]
    total: Totals = field(default_factory=Totals)
    projection_method: str = (
        "month-to-date cost / elapsed seconds of the month x seconds in the month (a linear run rate)"
    )

    @property
    def current(self) -> MonthTotals | None:
        return next((month for month in self.months if month.current), None)


SUMMARY_SQL = """
SELECT date_trunc('month', day)::date AS month, model, provider_name, client_key_id, arm,
       sum(requests), sum(errors), sum(prompt_tokens), sum(completion_tokens), sum(cost_usd),
       sum(priced_requests), sum(unpriced_requests), sum(unpriced_tokens)
FROM billing_usagedaily
WHERE day >= %s AND day < %s
GROUP BY 1, 2, 3, 4, 5
ORDER BY 1, 10 DESC, 2, 3, 4, 5
"""


def key_labels(ids) -> dict[int | None, str]:
    """Names of client keys by id; a key deleted since keeps its number."""
    ids = {key_id for key_id in ids if key_id is not None}
    labels: dict[int | None, str] = {None: "(no client key)"}
    found = {key.pk: f"{key.name} ({key.masked})" for key in ClientKey.objects.filter(pk__in=ids)}
    labels.update({key_id: found.get(key_id, f"deleted key #{key_id}") for key_id in ids})
    return labels


def usage_summary(first_month: date, last_month: date, *, now: datetime | None = None) -> MonthlySummary:
    """Cost and usage by month x model x provider x client key x arm, for the months from
    ``first_month`` to ``last_month`` (inclusive), with each month's totals, the month in
    progress projected to its end (also per row and per client key, against its budget),
    the requests without a price, and the months' budget alerts."""
    now = now or timezone.now()
    first, last = month_floor(first_month), month_floor(last_month)
    if last < first:
        first, last = last, first
    current = month_floor(now.astimezone(UTC).date())
    with reads().cursor() as cursor:
        cursor.execute(SUMMARY_SQL, [first, next_month(last)])
        fetched = cursor.fetchall()
    labels = key_labels(row[3] for row in fetched)
    rows = []
    for month, model, provider, key_id, arm, *sums in fetched:
        requests, errors, prompt, completion, cost, priced, unpriced, unpriced_tokens = sums
        row = SummaryRow(
            month=month,
            model=model,
            provider=provider,
            client_key_id=key_id,
            client_key=labels[key_id],
            arm=arm,
            requests=int(requests),
            errors=int(errors),
            prompt_tokens=int(prompt),
            completion_tokens=int(completion),
            cost_usd=cost,
            priced_requests=int(priced),
            unpriced_requests=int(unpriced),
            unpriced_tokens=int(unpriced_tokens),
        )
        if month == current:
            row.projected_usd = project_month(row.cost_usd, month, now)
        rows.append(row)

    months, total = [], Totals()
    month = first
    while month <= last:
        totals = MonthTotals(month=month, current=month == current, month_s=month_seconds(month))
        for row in rows:
            if row.month == month:
                totals.add(row)
        if totals.current:
            totals.elapsed_s = int((now - month_start_utc(month)).total_seconds())
        if month <= current:
            totals.projected_usd = project_month(totals.cost_usd, month, now)
        total.add(totals)
        months.append(totals)
        month = next_month(month)

    unpriced: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        if row.unpriced_requests:
            counts = unpriced[(row.month, row.model, row.provider)]
            counts[0] += row.unpriced_requests
            counts[1] += row.unpriced_tokens
    flags = [Unpriced(*key, requests, tokens) for key, (requests, tokens) in sorted(unpriced.items())]

    alerts = list(
        BudgetAlert.objects.filter(month__gte=first, month__lte=last)
        .select_related("client_key")
        .order_by("-month", "-created_at")[:500]
    )
    return MonthlySummary(
        first_month=first,
        last_month=last,
        now=now,
        months=months,
        rows=rows,
        unpriced=flags,
        keys=_key_months(rows, current, now) if first <= current <= last else [],
        alerts=alerts,
        total=total,
    )


def _key_months(rows: list[SummaryRow], current: date, now: datetime) -> list[KeyMonth]:
    spent: dict[int | None, list] = defaultdict(lambda: [Decimal(0), 0, ""])
    for row in rows:
        if row.month == current:
            entry = spent[row.client_key_id]
            entry[0] += row.cost_usd
            entry[1] += row.unpriced_requests
            entry[2] = row.client_key
    budgets = dict(
        ClientKey.objects.filter(pk__in=[key for key in spent if key is not None]).values_list(
            "pk", "monthly_budget_usd"
        )
    )
    keys = [
        KeyMonth(key_id, label, cost, project_month(cost, current, now), unpriced, budgets.get(key_id))
        for key_id, (cost, unpriced, label) in spent.items()
    ]
    return sorted(keys, key=lambda key: (-key.projected_usd, key.client_key))


CSV_HEADER = [
    "month",
    "model",
    "provider",
    "client_key_id",
    "client_key",
    "arm",
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "priced_requests",
    "unpriced_requests",
    "unpriced_tokens",
    "cost_usd",
    "projected_usd",
    "display_currency",
    "cost_display",
    "projected_display",
]


def _plain(value: Decimal | None) -> str:
    """A decimal as written by hand (``0.000000000000``, never ``0E-12``); empty for unknown."""
    return "" if value is None else format(value, "f")


def summary_csv(summary: MonthlySummary) -> Iterator[list[str]]:
    """The summary's rows for a CSV file, header first. Costs are exact: USD as stored,
    display currency = USD x rate. A row with no priced request has an empty cost (unknown),
    and ``unpriced_requests`` says how many of its requests have no price."""
    currency = display_currency()
    yield CSV_HEADER
    for row in summary.rows:
        cost = row.cost_known
        projected = row.projected_usd if cost is not None else None
        yield [
            f"{row.month:%Y-%m}",
            row.model,
            row.provider,
            "" if row.client_key_id is None else str(row.client_key_id),
            row.client_key,
            row.arm,
            str(row.requests),
            str(row.errors),
            str(row.prompt_tokens),
            str(row.completion_tokens),
            str(row.priced_requests),
            str(row.unpriced_requests),
            str(row.unpriced_tokens),
            _plain(cost),
            _plain(projected),
            currency,
            _plain(to_display(cost)),
            _plain(to_display(projected)),
        ]


# --------------------------------------------------------------------------- daily charts


@dataclass
class ArmDay:
    requests: int
    errors: int
    error_rate: float | None
    avg_latency_ms: float | None
    p99_latency_ms: float | None  # from the latency buckets: within 2.2 %
    throughput_tps: float | None
    acceptance_rate: float | None


@dataclass
class DailySeries:
    days: list[date]
    cost_by_model: dict[str, list[Decimal]]  # USD per day, priced rows
    unpriced_by_model: dict[str, int]  # requests without a price over the period
    cost_per_model: dict[str, Decimal]  # USD over the period
    arms: dict[str, list[ArmDay | None]]  # per day; None: no generation that day


DAILY_COST_SQL = """
SELECT day, model, sum(cost_usd), sum(unpriced_requests)
FROM billing_usagedaily WHERE day >= %s AND day < %s {release}
GROUP BY 1, 2 ORDER BY 1, 2
"""
DAILY_ARMS_SQL = """
SELECT day, arm, sum(requests), sum(errors), sum(ok_requests), sum(ok_latency_ms), sum(ok_completion_tokens),
       sum(draft_tokens_proposed), sum(draft_tokens_accepted)
FROM billing_usagedaily WHERE kind = 'generation' AND day >= %s AND day < %s {release}
GROUP BY 1, 2 ORDER BY 1, 2
"""
# The nearest-rank p99 bucket of each day and arm: the first bucket where the running count
# reaches 99 % of the day's answered generations.
DAILY_P99_SQL = """
WITH h AS (
    SELECT day, arm, bucket, sum(requests) AS n FROM billing_usagelatency
    WHERE day >= %s AND day < %s {release} GROUP BY 1, 2, 3
), c AS (
    SELECT day, arm, bucket, sum(n) OVER (PARTITION BY day, arm ORDER BY bucket) AS running,
           sum(n) OVER (PARTITION BY day, arm) AS total
    FROM h
)
SELECT DISTINCT ON (day, arm) day, arm, bucket FROM c WHERE running >= 0.99 * total ORDER BY day, arm, bucket
"""


def bucket_latency_ms(bucket: int) -> float:
    return 2 ** ((bucket + 0.5) / BUCKETS_PER_DOUBLING)


def _ratio(numerator, denominator) -> float | None:
    return float(numerator) / float(denominator) if denominator else None


def usage_daily_series(first_day: date, last_day: date, *, release_id: int | None = None) -> DailySeries:
    """Per day from ``first_day`` to ``last_day`` (inclusive, UTC): cost per model, and per
    arm (``""``: no release applied) the generations' error rate, average and p99 latency of
    answered ones, throughput (completion tokens per second of generation) and draft
    acceptance rate (accepted / proposed draft tokens). ``release_id``: only its rows."""
    end = last_day + timedelta(days=1)
    release = "AND release_id = %s" if release_id is not None else ""
    params = [first_day, end] + ([release_id] if release_id is not None else [])
    with reads().cursor() as cursor:
        cursor.execute(DAILY_COST_SQL.format(release=release), params)
        costs = cursor.fetchall()
        cursor.execute(DAILY_ARMS_SQL.format(release=release), params)
        arm_rows = cursor.fetchall()
        cursor.execute(DAILY_P99_SQL.format(release=release), params)
        p99 = {(day, arm): bucket_latency_ms(bucket) for day, arm, bucket in cursor.fetchall()}
    days = [first_day + timedelta(days=n) for n in range((end - first_day).days)]
    index = {day: n for n, day in enumerate(days)}
    cost_by_model: dict[str, list[Decimal]] = {}
    unpriced: dict[str, int] = defaultdict(int)
    for day, model, cost, unpriced_requests in costs:
        cost_by_model.setdefault(model, [Decimal(0)] * len(days))[index[day]] = cost
        unpriced[model] += int(unpriced_requests)
    arms: dict[str, list[ArmDay | None]] = {}
    for day, arm, requests, errors, ok, latency, tokens, proposed, accepted in arm_rows:
        arms.setdefault(arm, [None] * len(days))[index[day]] = ArmDay(
            requests=int(requests),
            errors=int(errors),
            error_rate=_ratio(errors, requests),
            avg_latency_ms=_ratio(latency, ok),
            p99_latency_ms=p99.get((day, arm)),
            throughput_tps=_ratio(tokens * 1000, latency),
            acceptance_rate=_ratio(accepted, proposed),
        )
    return DailySeries(
        days=days,
        cost_by_model=cost_by_model,
        unpriced_by_model={model: count for model, count in unpriced.items() if count},
        cost_per_model={model: sum(values, Decimal(0)) for model, values in cost_by_model.items()},
        arms=arms,
    )


# --------------------------------------------------------------------------- stable against canary


@dataclass
class ArmMetrics:
    requests: int = 0
    ok_requests: int = 0
    errors: int = 0
    error_rate: float | None = None
    avg_latency_ms: float | None = None
    p99_latency_ms: float | None = None
    cost_usd: Decimal | None = None  # priced rows of the arm in the period
    priced_requests: int = 0
    unpriced_requests: int = 0
    cost_per_request_usd: Decimal | None = None
    monthly_cost_usd: Decimal | None = None
    throughput_tps: float | None = None
    acceptance_rate: float | None = None


@dataclass
class MetricRow:
    key: str
    label: str
    stable: float | Decimal | None
    canary: float | Decimal | None
    change_percent: float | Decimal | None
    lower_is_better: bool


@dataclass
class Comparison:
    release_id: int | None
    start: datetime
    end: datetime
    stable: ArmMetrics
    canary: ArmMetrics
    rows: list[MetricRow]
    notes: list[str]

    @property
    def period_s(self) -> int:
        return int((self.end - self.start).total_seconds())

    def row(self, key: str) -> MetricRow:
        return next(row for row in self.rows if row.key == key)


def change_percent(stable, canary):
    """Canary against stable, in percent of stable; None when either is unknown or stable
    is 0 (no finite change). Decimal in, Decimal out (cost); floats otherwise."""
    if stable is None or canary is None or stable == 0:
        return None
    if isinstance(stable, Decimal) or isinstance(canary, Decimal):
        with localcontext() as context:
            context.prec = 60
            return _exact((Decimal(canary) - Decimal(stable)) * 100 / Decimal(stable))
    return (canary - stable) / stable * 100


def release_period(release, now: datetime | None = None) -> tuple[datetime, datetime]:
    """A release's life: from its creation to now while live, else to its last change
    (when it was promoted or rolled back)."""
    now = now or timezone.now()
    return release.created_at, (now if release.is_live else min(release.updated_at, now))


def comparison_queryset(release_id: int | None, start: datetime, end: datetime):
    """One row per arm: the sums and percentiles ``compare_arms`` derives its figures from.
    With a release, an index range scan of ``usage_release_arm_time`` per arm."""
    rows = UsageRecord.objects.filter(
        kind=UsageRecord.Kind.GENERATION, arm__in=(STABLE, CANARY), created_at__gte=start, created_at__lt=end
    )
    if release_id is not None:
        rows = rows.filter(release_id=release_id)
    ok = Q(status=UsageRecord.Status.OK)
    return (
        rows.order_by()
        .values("arm")
        .annotate(
            requests=Count("id"),
            ok_requests=Count("id", filter=ok),
            errors=Count("id", filter=Q(status=UsageRecord.Status.ERROR)),
            avg_latency_ms=Avg("latency_ms", filter=ok),
            p99_latency_ms=PercentileCont("latency_ms", 0.99, filter=ok),
            cost=Sum("cost_usd"),
            priced=Count("cost_usd"),
            ok_completion_tokens=Sum("completion_tokens", filter=ok),
            ok_latency_ms=Sum("latency_ms", filter=ok),
            proposed=Sum("draft_tokens_proposed"),
            accepted=Sum("draft_tokens_accepted"),
        )
    )


def compare_arms(release_id: int | None, start: datetime, end: datetime) -> Comparison:
    """Stable against canary over ``[start, end)``, from the ledger's generations of the
    release (``None``: every release's arms together): average and p99 latency of answered
    rows (the p99 exact, ``percentile_cont`` as in the canary analysis), error rate (errors
    over all rows), throughput (completion tokens per second of generation, answered rows),
    draft acceptance rate, and monthly cost.

    Monthly cost: what the release's whole traffic in the period would cost per average
    month (30.44 days) if this arm served it: the arm's cost per priced request x all
    requests of both arms x (average month / period). Arms carry different shares of the
    traffic (10 % on the canary...), so their raw costs do not compare; their costs per
    request do. Requests without a price are left out of the cost per request and noted.
    """
    aggregated = comparison_queryset(release_id, start, end)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL work_mem = '{COMPARISON_WORK_MEM}'")
        found = {row["arm"]: row for row in aggregated}
    period_s = int((end - start).total_seconds())
    all_requests = sum(row["requests"] for row in found.values())
    arms = {arm: _arm_metrics(found.get(arm), all_requests, period_s) for arm in (STABLE, CANARY)}
    stable, canary = arms[STABLE], arms[CANARY]
    metrics = [
        ("avg_latency_ms", "Average latency (ms, answered)", True),
        ("p99_latency_ms", "p99 latency (ms, answered)", True),
        ("monthly_cost_usd", "Monthly cost if it served all the traffic", True),
        ("throughput_tps", "Throughput (completion tokens/s)", False),
        ("error_rate", "Error rate", True),
        ("acceptance_rate", "Draft acceptance rate", False),
    ]
    table = [
        MetricRow(
            key,
            label,
            getattr(stable, key),
            getattr(canary, key),
            change_percent(getattr(stable, key), getattr(canary, key)),
            lower,
        )
        for key, label, lower in metrics
    ]
    notes = []
    for arm, metrics_ in arms.items():
        if not metrics_.requests:
            notes.append(f"the {arm} arm has no generation in this period")
        elif metrics_.unpriced_requests:
            notes.append(
                f"{metrics_.unpriced_requests} {arm} requests have no price: its cost per request is over the "
                f"{metrics_.priced_requests} priced ones"
            )
    return Comparison(release_id, start, end, stable, canary, table, notes)


def _arm_metrics(row: dict | None, all_requests: int, period_s: int) -> ArmMetrics:
    if row is None:
        return ArmMetrics()
    metrics = ArmMetrics(
        requests=row["requests"],
        ok_requests=row["ok_requests"],
        errors=row["errors"],
        error_rate=_ratio(row["errors"], row["requests"]),
        avg_latency_ms=row["avg_latency_ms"],
        p99_latency_ms=row["p99_latency_ms"],
        priced_requests=row["priced"],
        unpriced_requests=row["requests"] - row["priced"],
        throughput_tps=_ratio((row["ok_completion_tokens"] or 0) * 1000, row["ok_latency_ms"]),
        acceptance_rate=_ratio(row["accepted"] or 0, row["proposed"]),
    )
    if row["priced"]:
        metrics.cost_usd = row["cost"]
        with localcontext() as context:
            context.prec = 60
            per_request = row["cost"] / row["priced"]
            metrics.cost_per_request_usd = _exact(per_request)
            if period_s > 0:
                metrics.monthly_cost_usd = _exact(per_request * all_requests * AVERAGE_MONTH_SECONDS / period_s)
    return metrics


# --------------------------------------------------------------------------- upkeep


def usage_rollup_rebuild(first_day: date | None = None, last_day: date | None = None) -> int:
    """Recompute the daily rollups of days ``first_day`` to ``last_day`` (UTC, inclusive;
    default: the whole ledger) from the ledger, holding writers back meanwhile. The
    triggers keep the rollups exact; this is for repairs (rollups restored from an older
    backup than the ledger, triggers disabled by hand). Returns the days with rows."""
    with connection.cursor() as cursor:
        if first_day is None or last_day is None:
            cursor.execute("SELECT min(created_at), max(created_at) FROM billing_usagerecord")
            low, high = cursor.fetchone()
            if low is None:
                cursor.execute("TRUNCATE billing_usagedaily, billing_usagelatency")
                return 0
            first_day = first_day or low.astimezone(UTC).date()
            last_day = last_day or high.astimezone(UTC).date()
        with transaction.atomic():
            cursor.execute("SELECT billing_usage_rollup_rebuild(%s, %s)", [first_day, last_day])
            return cursor.fetchone()[0]
