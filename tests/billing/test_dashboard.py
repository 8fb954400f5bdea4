"""Monthly cost and the billing dashboards (billing/dashboard.py, frontdoors/dashboards.py) on real
PostgreSQL: handmade ledger rows (explicit UTC times and costs) give exact Decimal totals
split at month boundaries, a projection computed by hand, rows without a price counted and
flagged (never as 0), an exact CSV, an exact stable/canary comparison, the display currency,
the pages for staff only with charts drawn by the local plotly.js, and daily rollups that
always equal the ledger (the triggers of migration 0004), whoever writes it: the ORM,
updates and deletes, and the ledger's own drain, which calls nothing for them.

Rows are dated 2021, so that rows other tests store "now" never fall in these months.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.db import connection

from billing import dashboard
from billing.models import BudgetAlert, ClientKey, UsageRecord
from billing.staticfiles import bundle_directory
from inference.models import CanaryRelease, Provider, Route
from search.models import Workspace

pytestmark = pytest.mark.django_db

PLOTLY_URL = "/static/billing/vendor/plotly.min.js"


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def record(created_at: str, cost: str | None = "0.001", **fields) -> UsageRecord:
    values = {
        "request_id": uuid.uuid4(),
        "created_at": at(created_at),
        "status": "ok",
        "model": "gpt-4.1",
        "provider_name": "openai",
        "prompt_tokens": 100,
        "completion_tokens": 50,
        "latency_ms": 100.0,
        "cost_usd": None if cost is None else Decimal(cost),
        **fields,
    }
    return UsageRecord.objects.create(**values)


@pytest.fixture
def keys():
    workspace = Workspace.objects.create(name="Acme", slug=f"acme-{uuid.uuid4().hex[:8]}")

    def key(name: str, prefix: str, budget: str | None = None) -> ClientKey:
        return ClientKey.objects.create(
            workspace=workspace,
            name=name,
            prefix=f"{prefix}{uuid.uuid4().hex[:6]}",
            secret_hash="0" * 64,
            last_four="abcd",
            monthly_budget_usd=None if budget is None else Decimal(budget),
        )

    return key("web", "w", "5.00"), key("batch", "b")


@pytest.fixture
def release():
    provider = Provider.objects.create(
        name=f"p-{uuid.uuid4().hex[:8]}", kind="openai-compatible", base_url="http://127.0.0.1:9/v1", model="m"
    )
    stable = Route.objects.create(name=f"s-{uuid.uuid4().hex[:8]}", provider=provider)
    canary = Route.objects.create(name=f"c-{uuid.uuid4().hex[:8]}", provider=provider)
    return CanaryRelease.objects.create(name="v2", stable_route=stable, canary_route=canary, percent=50)


def staff_user(*, permission: bool = True, staff: bool = True):
    user = get_user_model().objects.create_user(f"u-{uuid.uuid4().hex[:8]}", password="pw-for-tests", is_staff=staff)
    if permission:
        user.user_permissions.add(
            Permission.objects.get(codename="view_usagerecord", content_type__app_label="billing")
        )
    return user


# --------------------------------------------------------------------------- monthly summary


def test_summary_totals_are_exact_decimal_sums_by_month_model_provider_key_and_arm(keys):
    web, batch = keys
    record("2021-01-05T10:00:00", "0.1", client_key=web, prompt_tokens=10, completion_tokens=1)
    record("2021-01-06T10:00:00", "0.2", client_key=web, prompt_tokens=20, completion_tokens=2)
    record(
        "2021-01-07T10:00:00", "0.000000000001", client_key=web, status="error", prompt_tokens=3, completion_tokens=0
    )
    record("2021-01-08T10:00:00", "1.5", client_key=batch, model="claude-sonnet-4-5", provider_name="anthropic")
    record("2021-01-09T10:00:00", "0.25", client_key=web, arm="canary")

    summary = dashboard.usage_summary(date(2021, 1, 1), date(2021, 1, 1), now=at("2021-06-01T00:00:00"))

    rows = {(row.model, row.provider, row.client_key_id, row.arm): row for row in summary.rows}
    assert set(rows) == {
        ("gpt-4.1", "openai", web.id, ""),
        ("claude-sonnet-4-5", "anthropic", batch.id, ""),
        ("gpt-4.1", "openai", web.id, "canary"),
    }
    web_stable = rows[("gpt-4.1", "openai", web.id, "")]
    # 0.1 + 0.2 + 1e-12: exact (a float sum would give 0.30000000000000004).
    assert web_stable.cost_usd == Decimal("0.300000000001")
    assert (web_stable.requests, web_stable.errors) == (3, 1)
    assert (web_stable.prompt_tokens, web_stable.completion_tokens) == (33, 3)
    assert web_stable.client_key == f"web ({web.masked})"
    (january,) = summary.months
    assert january.cost_usd == Decimal("2.050000000001")
    assert (january.requests, january.errors, january.unpriced_requests) == (5, 1, 0)
    # The most expensive row first.
    assert summary.rows[0].model == "claude-sonnet-4-5"


def test_a_month_boundary_splits_the_totals_at_midnight_utc():
    record("2021-01-31T23:59:59.999999", "0.4")
    record("2021-02-01T00:00:00", "0.6")
    record("2021-02-28T23:59:59", "0.01")
    record("2021-03-01T00:00:00", "7")  # the month after the range

    summary = dashboard.usage_summary(date(2021, 1, 1), date(2021, 2, 1), now=at("2021-06-01T00:00:00"))

    assert [(month.month, month.requests, month.cost_usd) for month in summary.months] == [
        (date(2021, 1, 1), 1, Decimal("0.4")),
        (date(2021, 2, 1), 2, Decimal("0.61")),
    ]
    assert summary.total.cost_usd == Decimal("1.01")
    # Months that have ended project to what they cost.
    assert [month.projected_usd for month in summary.months] == [Decimal("0.4"), Decimal("0.61")]


def test_the_month_in_progress_is_projected_by_its_run_rate_to_the_second(keys):
    web, batch = keys
    record("2021-02-01T08:00:00", "0.5", client_key=web)
    record("2021-02-10T11:00:00", "0.45", client_key=web)
    record("2021-02-03T00:00:00", "0.19", client_key=batch)
    BudgetAlert.objects.create(
        client_key=web, month=date(2021, 2, 1), threshold_percent=80, spent_usd=Decimal("4"), budget_usd=Decimal("5")
    )
    now = at("2021-02-10T12:00:00")  # 9.5 days of February's 28

    summary = dashboard.usage_summary(date(2021, 1, 1), date(2021, 2, 1), now=now)

    february = summary.current
    assert february.month == date(2021, 2, 1)
    assert (february.elapsed_s, february.month_s) == (820_800, 2_419_200)
    # (0.5 + 0.45 + 0.19) x 2,419,200 s / 820,800 s = 1.14 x 28 / 9.5
    assert february.projected_usd == Decimal("3.360000000000")
    web_row = next(row for row in summary.rows if row.client_key_id == web.id)
    assert web_row.projected_usd == Decimal("2.800000000000")  # 0.95 x 28 / 9.5
    web_month = next(key for key in summary.keys if key.client_key_id == web.id)
    assert (web_month.spent_usd, web_month.projected_usd, web_month.budget_usd) == (
        Decimal("0.95"),
        Decimal("2.8"),
        Decimal("5.00"),
    )
    assert web_month.projected_percent == Decimal("56.0")
    assert [alert.threshold_percent for alert in summary.alerts] == [80]
    # January (no rows) has ended: it projects to its cost, 0.
    assert summary.months[0].projected_usd == 0 and not summary.months[0].current
    # The helper itself: a linear run rate; a month over is its cost.
    assert dashboard.project_month(Decimal("1"), date(2021, 2, 1), at("2021-02-08T00:00:00")) == Decimal("4")
    assert dashboard.project_month(Decimal("1"), date(2021, 2, 1), at("2021-03-08T00:00:00")) == Decimal("1")


def test_rows_without_a_price_are_counted_and_flagged_never_summed_as_zero():
    record(
        "2021-01-05T00:00:00", None, model="mystery-7b", provider_name="lab", prompt_tokens=100, completion_tokens=50
    )
    record(
        "2021-01-06T00:00:00", None, model="mystery-7b", provider_name="lab", prompt_tokens=100, completion_tokens=50
    )
    record("2021-01-07T00:00:00", "0.3")
    record("2021-01-08T00:00:00", None)  # a priced model's row stored before its price existed

    summary = dashboard.usage_summary(date(2021, 1, 1), date(2021, 1, 1), now=at("2021-06-01T00:00:00"))

    assert [flag.message for flag in summary.unpriced] == [
        "1 request of model gpt-4.1 (provider openai) has no price in 2021-01 (150 tokens): not included in the costs",
        "2 requests of model mystery-7b (provider lab) have no price in 2021-01 (300 tokens): "
        "not included in the costs",
    ]
    mystery = next(row for row in summary.rows if row.model == "mystery-7b")
    assert mystery.cost_known is None  # unknown, not 0
    assert (mystery.requests, mystery.priced_requests, mystery.unpriced_requests) == (2, 0, 2)
    gpt = next(row for row in summary.rows if row.model == "gpt-4.1")
    assert (gpt.cost_known, gpt.priced_requests, gpt.unpriced_requests) == (Decimal("0.3"), 1, 1)
    january = summary.months[0]
    assert (january.cost_usd, january.requests, january.unpriced_requests, january.unpriced_tokens) == (
        Decimal("0.3"),
        4,
        3,
        450,
    )
    assert not january.complete


def test_the_csv_export_is_exact_in_usd_and_in_the_display_currency(client, keys, settings):
    settings.BILLING_DISPLAY_CURRENCY = "EUR"
    settings.BILLING_EXCHANGE_RATE = Decimal("0.9")
    web, _ = keys
    record("2021-01-05T10:00:00", "0.1", client_key=web)
    record("2021-01-06T10:00:00", "0.2", client_key=web, status="error")
    record("2021-02-01T00:00:00", None, model="mystery-7b", provider_name="lab")
    client.force_login(staff_user())

    response = client.get("/admin/billing/dashboard/cost.csv?first=2021-01&last=2021-02")

    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == 'attachment; filename="cost-2021-01-to-2021-02.csv"'
    assert b"".join(response.streaming_content).decode() == (
        "month,model,provider,client_key_id,client_key,arm,requests,errors,prompt_tokens,completion_tokens,"
        "priced_requests,unpriced_requests,unpriced_tokens,cost_usd,projected_usd,display_currency,cost_display,"
        "projected_display\r\n"
        f"2021-01,gpt-4.1,openai,{web.id},web ({web.masked}),,2,1,200,100,2,0,0,0.300000000000,,EUR,"
        "0.2700000000000,\r\n"
        "2021-02,mystery-7b,lab,,(no client key),,1,0,100,50,0,1,150,,,EUR,,\r\n"
    )


# --------------------------------------------------------------------------- stable against canary


def test_the_comparison_of_stable_and_canary_is_exact(release):
    other = CanaryRelease.objects.create(
        name="other", stable_route=release.canary_route, canary_route=release.stable_route
    )

    def row(arm, latency, cost="0.002", status="ok", completion=50, **fields):
        return record(
            "2021-03-01T12:00:00",
            cost,
            release=release,
            arm=arm,
            latency_ms=latency,
            status=status,
            completion_tokens=completion,
            **fields,
        )

    # Stable: answered in 150, 300, 300 ms (50 tokens each), one error.
    for latency in (150, 300, 300):
        row("stable", latency)
    row("stable", 10, status="error")
    # Canary: answered in 100, 200, 600, 600 ms (150 tokens each), four errors, drafts.
    for latency in (100, 200, 600, 600):
        row("canary", latency, cost="0.001", completion=150, draft_tokens_proposed=10, draft_tokens_accepted=7)
    for _ in range(4):
        row("canary", 5, cost="0.001", status="error", completion=0)
    # Not counted: outside the period, another release, no arm, an embedding.
    record("2021-03-02T00:00:00", "9", release=release, arm="stable", latency_ms=9000)
    record("2021-03-01T12:00:00", "9", release=other, arm="canary", latency_ms=9000)
    record("2021-03-01T12:00:00", "9", release=release, arm="", latency_ms=9000)
    record("2021-03-01T12:00:00", "9", release=release, arm="stable", kind="embedding", latency_ms=9000)

    comparison = dashboard.compare_arms(release.id, at("2021-03-01T00:00:00"), at("2021-03-02T00:00:00"))

    stable, canary = comparison.stable, comparison.canary
    assert (stable.requests, stable.ok_requests, stable.errors) == (4, 3, 1)
    assert (canary.requests, canary.ok_requests, canary.errors) == (8, 4, 4)
    assert (stable.cost_usd, canary.cost_usd) == (Decimal("0.008"), Decimal("0.008"))
    assert (stable.cost_per_request_usd, canary.cost_per_request_usd) == (Decimal("0.002"), Decimal("0.001"))
    table = {row.key: (row.stable, row.canary, row.change_percent) for row in comparison.rows}
    assert table == {
        "avg_latency_ms": (250.0, 375.0, 50.0),
        "p99_latency_ms": (300.0, 600.0, 100.0),
        # Per priced request x all 12 requests x average month (2,629,746 s) / period (86,400 s).
        "monthly_cost_usd": (Decimal("0.730485"), Decimal("0.3652425"), Decimal("-50")),
        # Completion tokens per second of generation: 150 / 0.75 s and 600 / 1.5 s.
        "throughput_tps": (200.0, 400.0, 100.0),
        "error_rate": (0.25, 0.5, 100.0),
        "acceptance_rate": (None, 0.7, None),
    }
    assert comparison.notes == []
    assert comparison.period_s == 86_400


def test_a_comparison_notes_an_arm_without_rows_and_requests_without_a_price(release):
    record("2021-03-01T12:00:00", "0.002", release=release, arm="stable")
    record("2021-03-01T13:00:00", None, release=release, arm="stable")

    comparison = dashboard.compare_arms(release.id, at("2021-03-01T00:00:00"), at("2021-03-02T00:00:00"))

    assert comparison.notes == [
        "1 stable requests have no price: its cost per request is over the 1 priced ones",
        "the canary arm has no generation in this period",
    ]
    assert comparison.stable.cost_per_request_usd == Decimal("0.002")
    assert comparison.row("monthly_cost_usd").canary is None
    assert comparison.row("monthly_cost_usd").change_percent is None


# --------------------------------------------------------------------------- display currency


def test_the_display_currency_converts_exactly(settings):
    settings.BILLING_DISPLAY_CURRENCY = "EUR"
    settings.BILLING_EXCHANGE_RATE = Decimal("0.9")
    from frontdoors.dashboards import money

    assert dashboard.to_display(Decimal("1.234567890123")) == Decimal("1.1111111011107")
    assert dashboard.to_display(None) is None
    assert money(Decimal("1234.565")) == "1,111.11 EUR"  # 1111.1085, to the cent
    assert money(Decimal("0.001")) == "0.000900 EUR"  # below a cent: 6 decimals
    assert money(None) == "—"


# --------------------------------------------------------------------------- pages


def test_the_dashboard_pages_render_for_staff_with_the_local_plotly(client, release, settings):
    settings.BILLING_DISPLAY_CURRENCY = "CHF"
    settings.BILLING_EXCHANGE_RATE = Decimal("0.8")
    record("2021-03-01T12:00:00", "0.002", release=release, arm="stable")
    client.force_login(staff_user())

    for url in (
        "/admin/billing/dashboard/?first=2021-01&last=2021-03",
        "/admin/billing/dashboard/charts/?start=2021-02-20&end=2021-03-05",
        f"/admin/billing/dashboard/charts/?release={release.id}",
        "/admin/billing/dashboard/compare/",
        f"/admin/billing/dashboard/compare/?release={release.id}&start=2021-03-01&end=2021-03-01",
        "/admin/billing/dashboard/compare/?start=2021-03-01&end=2021-03-01",
    ):
        response = client.get(url)
        assert response.status_code == 200, url
        page = response.content.decode()
        assert "Amounts in CHF at 0.8 per USD" in page
        if "compare" in url:
            assert 'id="billing-comparison"' in page, url
            continue
        assert f'<script src="{PLOTLY_URL}" defer></script>' in page
        assert 'id="chart-cost-per-day"' in page and 'id="billing-charts"' in page
        # Every script and stylesheet from this site, none from a CDN (a substring test would
        # also find "cdn" inside a random CSRF token).
        assets = re.findall(r'<(?:script|link)\b[^>]*\b(?:src|href)="([^"]+)"', page)
        assert assets and all(url.startswith("/") and not url.startswith("//") for url in assets), assets
    charts = client.get("/admin/billing/dashboard/charts/?start=2021-02-20&end=2021-03-05").content.decode()
    for chart in ("p99-latency-ms", "avg-latency-ms", "error-rate", "throughput-tps", "acceptance-rate"):
        assert f'id="chart-{chart}"' in charts
    index = client.get("/admin/").content.decode()
    assert 'href="/admin/billing/dashboard/"' in index


def test_the_dashboard_pages_are_refused_to_non_staff_and_to_staff_without_the_permission(client):
    urls = ["/admin/billing/dashboard/", "/admin/billing/dashboard/cost.csv", "/admin/billing/dashboard/compare/"]
    for url in urls:
        response = client.get(url)  # anonymous
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/"), url
    client.force_login(staff_user(staff=False))
    for url in urls:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/"), url
    client.force_login(staff_user(permission=False))
    for url in urls:
        assert client.get(url).status_code == 403, url
    assert "/admin/billing/dashboard/" not in client.get("/admin/").content.decode()


def test_plotly_is_a_static_file_served_and_collected_from_the_wheel(client, settings, tmp_path):
    bundle = bundle_directory() / "plotly.min.js"
    assert b"plotly.js" in bundle.read_bytes()[:2000]

    response = client.get(PLOTLY_URL)  # ServeStatic, from the wheel (no collectstatic needed)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/javascript")
    assert int(response["Content-Length"]) == bundle.stat().st_size

    settings.STATIC_ROOT = tmp_path
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    call_command("collectstatic", interactive=False, verbosity=0)
    assert (tmp_path / "billing" / "vendor" / "plotly.min.js").read_bytes() == bundle.read_bytes()
    assert not (tmp_path / "billing" / "vendor" / "widgetbundle.js").exists()


# --------------------------------------------------------------------------- rollups


def _ledger_by_day() -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (created_at AT TIME ZONE 'UTC')::date, arm, count(*), sum(cost_usd), count(*) - count(cost_usd),"
            " sum(completion_tokens) FROM billing_usagerecord WHERE created_at < '2022-01-01'"
            " GROUP BY 1, 2 ORDER BY 1, 2"
        )
        ledger = cursor.fetchall()
        cursor.execute(
            "SELECT day, arm, sum(requests), sum(cost_usd), sum(unpriced_requests), sum(completion_tokens)"
            " FROM billing_usagedaily WHERE day < '2022-01-01' GROUP BY 1, 2 ORDER BY 1, 2"
        )
        rollup = cursor.fetchall()
    normalise = [
        (day, arm, int(n), cost or 0, int(unpriced), int(tokens)) for day, arm, n, cost, unpriced, tokens in ledger
    ]
    return normalise, [(day, arm, int(n), cost, int(u), int(t)) for day, arm, n, cost, u, t in rollup]


def test_the_daily_rollup_follows_inserts_updates_and_deletes_of_the_ledger(release):
    rows = [record("2021-04-01T10:00:00", "0.5"), record("2021-04-01T11:00:00", None), record("2021-04-02T00:00:00")]
    ledger, rollup = _ledger_by_day()
    assert ledger == rollup and len(rollup) == 2

    UsageRecord.objects.filter(pk=rows[0].pk).update(arm="canary", release=release)
    UsageRecord.objects.filter(pk=rows[1].pk).delete()
    ledger, rollup = _ledger_by_day()
    assert ledger == rollup
    assert rollup == [
        (date(2021, 4, 1), "canary", 1, Decimal("0.5"), 0, 50),
        (date(2021, 4, 2), "", 1, Decimal("0.001"), 0, 50),
    ]

    # A rebuild from the ledger finds what the triggers kept.
    assert dashboard.usage_rollup_rebuild(date(2021, 4, 1), date(2021, 4, 30)) == 2
    assert _ledger_by_day() == (ledger, rollup)


def test_daily_series_per_arm_come_from_the_rollups(release):
    for n in range(100):
        record("2021-05-03T10:00:00", "0.01", release=release, arm="stable", latency_ms=100.0 + n, completion_tokens=20)
    record("2021-05-03T11:00:00", "0.01", release=release, arm="stable", status="error")
    record("2021-05-04T10:00:00", None, model="mystery-7b", release=release, arm="canary", latency_ms=1000.0)

    series = dashboard.usage_daily_series(date(2021, 5, 3), date(2021, 5, 4), release_id=release.id)

    assert series.days == [date(2021, 5, 3), date(2021, 5, 4)]
    assert series.cost_by_model == {"gpt-4.1": [Decimal("1.01"), Decimal(0)], "mystery-7b": [Decimal(0), Decimal(0)]}
    assert series.unpriced_by_model == {"mystery-7b": 1}
    stable_day, stable_next = series.arms["stable"]
    assert stable_next is None
    assert (stable_day.requests, stable_day.errors, stable_day.error_rate) == (101, 1, 1 / 101)
    assert stable_day.avg_latency_ms == 149.5
    assert stable_day.throughput_tps == 2000 * 1000 / 14950
    # The p99 of 100..199 ms is 198.01 (exact); the buckets give it within 2.2 %.
    assert abs(stable_day.p99_latency_ms / 198.01 - 1) < 0.022
    assert series.arms["canary"][1].p99_latency_ms == pytest.approx(1000, rel=0.022)


def test_rows_stored_by_the_ledgers_drain_are_rolled_up_once_even_when_redelivered():
    from billing import ledger

    ledger.usage_records_store(claim_idle_ms=0)  # rows other tests left queued, stored (and rolled back) here
    row = {
        "request_id": uuid.uuid4().hex,
        "created_at": "2021-06-01T10:00:00+00:00",
        "kind": "generation",
        "route_name": "",
        "arm": "",
        "provider_name": "openai",
        "model": "gpt-4.1",
        "prompt_tokens": 1000,
        "completion_tokens": 500,
        "draft_tokens_proposed": 0,
        "draft_tokens_accepted": 0,
        "usage_source": "upstream",
        "attempts": 1,
        "latency_ms": 800.0,
        "status": "ok",
        "error_class": "",
        "cost_usd": "0.006",
    }
    ledger.usage_record_queue(row)
    ledger.usage_record_queue(row)  # delivered twice: stored once (ON CONFLICT DO NOTHING), counted once

    assert ledger.usage_records_store(claim_idle_ms=0) == 1

    summary = dashboard.usage_summary(date(2021, 6, 1), date(2021, 6, 1), now=at("2021-07-01T00:00:00"))
    assert [(row.model, row.requests, row.cost_usd) for row in summary.rows] == [("gpt-4.1", 1, Decimal("0.006"))]
    ledger_, rollup = _ledger_by_day()
    assert ledger_ == rollup
