"""The billing dashboards in the admin console: monthly cost (with its CSV), daily charts,
and stable against canary.

Pages live under ``/admin/billing/dashboard/`` and go through ``admin.site.admin_view``: the
admin's login, and staff only. Costs are what a user may see of the ledger, so a staff
user also needs the permission to view usage records (superusers have it). The figures come
from ``billing.dashboard``; this module parses the forms, formats and draws.

Charts are plotly.js figures described here (data and layout, as JSON in the page) and
drawn by ``billing/dashboard.js`` with the plotly.js of the ``plotly`` wheel, served as our
own static file (``billing.staticfiles``), never from a CDN.
"""

from __future__ import annotations

import csv
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from billing import dashboard
from inference.models import CanaryRelease

PERMISSION = "billing.view_usagerecord"
ARM_LABELS = {"": "no release", dashboard.STABLE: "stable", dashboard.CANARY: "canary"}
CENT = Decimal("0.01")


# --------------------------------------------------------------------------- formatting


def money(amount_usd: Decimal | None) -> str:
    """A USD amount in the display currency: cents, or 6 decimals below one cent (single
    requests cost fractions of a cent); "—" for unknown."""
    amount = dashboard.to_display(amount_usd)
    if amount is None:
        return "—"
    if amount and abs(amount) < CENT:
        return f"{amount.quantize(Decimal('0.000001'), ROUND_HALF_EVEN):f} {dashboard.display_currency()}"
    return f"{amount.quantize(CENT, ROUND_HALF_EVEN):,f} {dashboard.display_currency()}"


def percent(value) -> str:
    return "—" if value is None else f"{float(value):+.1f} %"


def metric(key: str, value) -> str:
    if value is None:
        return "—"
    if key == "monthly_cost_usd":
        return money(value)
    if key in ("error_rate", "acceptance_rate"):
        return f"{float(value) * 100:.2f} %"
    return f"{float(value):,.1f}"


def _float(value) -> float | None:
    return None if value is None else float(value)


# --------------------------------------------------------------------------- forms


class MonthRangeForm(forms.Form):
    first = forms.DateField(
        label="From month", input_formats=["%Y-%m"], widget=forms.DateInput(format="%Y-%m", attrs={"type": "month"})
    )
    last = forms.DateField(
        label="To month", input_formats=["%Y-%m"], widget=forms.DateInput(format="%Y-%m", attrs={"type": "month"})
    )

    def clean(self):
        data = super().clean()
        if data.get("first") and data.get("last") and data["first"] > data["last"]:
            raise forms.ValidationError("The first month comes after the last.")
        return data


def _month_range(request) -> tuple[MonthRangeForm, date, date]:
    """The months asked for, by default the last three (the current one included)."""
    current = dashboard.month_floor(timezone.now().astimezone(UTC).date())
    first = current
    for _ in range(2):
        first = dashboard.month_floor(first - timedelta(days=1))
    form = MonthRangeForm(request.GET or None, initial={"first": first, "last": current})
    if form.is_bound and form.is_valid():
        return form, form.cleaned_data["first"], form.cleaned_data["last"]
    return form, first, current


class PeriodForm(forms.Form):
    release = forms.ModelChoiceField(
        queryset=CanaryRelease.objects.select_related("stable_route", "canary_route").order_by("-created_at"),
        required=False,
        empty_label="(any)",
    )
    start = forms.DateField(label="From (UTC day)", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(
        label="To (UTC day, included)", required=False, widget=forms.DateInput(attrs={"type": "date"})
    )

    def clean(self):
        data = super().clean()
        if data.get("start") and data.get("end") and data["start"] > data["end"]:
            raise forms.ValidationError("The period starts after it ends.")
        return data


def _day_start(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


# --------------------------------------------------------------------------- pages


def _context(request, title: str, **extra) -> dict:
    return {
        **admin.site.each_context(request),
        "title": title,
        "currency": dashboard.display_currency(),
        "exchange_rate": dashboard.exchange_rate(),
        "pages": [
            ("Monthly cost", reverse("billing_dashboard:cost")),
            ("Daily charts", reverse("billing_dashboard:charts")),
            ("Stable vs canary", reverse("billing_dashboard:compare")),
        ],
        **extra,
    }


def _allowed(request) -> None:
    if not request.user.has_perm(PERMISSION):
        raise PermissionDenied("Viewing costs needs the permission to view usage records.")


def cost(request):
    """Monthly cost: totals, month-to-date and projection, per-row detail, prices missing,
    client keys against their budgets, budget alerts; charts of cost per day and per model."""
    _allowed(request)
    form, first, last = _month_range(request)
    summary = dashboard.usage_summary(first, last)
    series = dashboard.usage_daily_series(first, min(dashboard.next_month(last) - timedelta(days=1), _today()))
    charts = [_cost_per_day(series), _cost_per_model(series)]
    return TemplateResponse(
        request,
        "billing/dashboard/cost.html",
        _context(
            request,
            "Monthly cost",
            form=form,
            summary=summary,
            months=[_month_view(month) for month in summary.months],
            rows=[_row_view(row) for row in summary.rows],
            keys=[_key_view(key) for key in summary.keys],
            total=_totals_view(summary.total),
            charts=charts,
            csv_url=f"{reverse('billing_dashboard:cost_csv')}?first={first:%Y-%m}&last={last:%Y-%m}",
        ),
    )


def cost_csv(request):
    """The monthly summary's rows as CSV (exact decimals, USD and display currency)."""
    _allowed(request)
    _, first, last = _month_range(request)
    summary = dashboard.usage_summary(first, last)

    class Echo:
        def write(self, value):
            return value

    writer = csv.writer(Echo())
    response = StreamingHttpResponse(
        (writer.writerow(line) for line in dashboard.summary_csv(summary)), content_type="text/csv; charset=utf-8"
    )
    response["Content-Disposition"] = f'attachment; filename="cost-{first:%Y-%m}-to-{last:%Y-%m}.csv"'
    return response


def charts(request):
    """Per day and arm: latency (average and p99), error rate, throughput, draft acceptance;
    and cost per day and per model."""
    _allowed(request)
    today = _today()
    form = PeriodForm(request.GET or None)
    release, first, last = None, today - timedelta(days=29), today
    if form.is_bound and form.is_valid():
        release = form.cleaned_data["release"]
        first = form.cleaned_data["start"] or (release.created_at.astimezone(UTC).date() if release else first)
        last = form.cleaned_data["end"] or last
    if not form.is_bound:
        form = PeriodForm(initial={"start": first, "end": last})
    series = dashboard.usage_daily_series(first, last, release_id=release.pk if release else None)
    figures = [
        _cost_per_day(series),
        _cost_per_model(series),
        _arm_figure(series, "avg_latency_ms", "Average latency of answered generations (ms)", "ms"),
        _arm_figure(series, "p99_latency_ms", "p99 latency of answered generations (ms, ±2.2 %)", "ms"),
        _arm_figure(series, "error_rate", "Error rate", "share of requests", percent_axis=True),
        _arm_figure(series, "throughput_tps", "Throughput (completion tokens per second of generation)", "tokens/s"),
        _arm_figure(series, "requests", "Generations per day", "requests"),
        _arm_figure(series, "acceptance_rate", "Draft acceptance rate (accepted / proposed)", "", percent_axis=True),
    ]
    return TemplateResponse(
        request,
        "billing/dashboard/charts.html",
        _context(
            request,
            "Daily charts",
            form=form,
            charts=figures,
            first=first,
            last=last,
            release=release,
            unpriced=[
                f"{count} requests of model {model or '(none)'} have no price (not in the costs)"
                for model, count in sorted(series.unpriced_by_model.items())
            ],
        ),
    )


def compare(request):
    """Stable against canary over a release's life or a date range, from the ledger."""
    _allowed(request)
    form = PeriodForm(request.GET or None)
    comparison, release, error = None, None, ""
    now = timezone.now()
    if not form.is_bound:
        release = CanaryRelease.objects.order_by("-created_at").first()
        form = PeriodForm(initial={"release": release})
        start, end = dashboard.release_period(release, now) if release else (None, None)
    elif form.is_valid():
        release = form.cleaned_data["release"]
        start, end = dashboard.release_period(release, now) if release else (now - timedelta(days=30), now)
        if form.cleaned_data["start"]:
            start = _day_start(form.cleaned_data["start"])
        if form.cleaned_data["end"]:
            end = _day_start(form.cleaned_data["end"]) + timedelta(days=1)
    else:
        start = end = None
    if start is not None and end is not None:
        if end <= start:
            error = "The period is empty."
        else:
            comparison = dashboard.compare_arms(release.pk if release else None, start, end)
    rows = []
    if comparison:
        for row in comparison.rows:
            better = None
            if row.change_percent is not None and row.change_percent != 0:
                better = (row.change_percent < 0) == row.lower_is_better
            rows.append(
                {
                    "label": row.label,
                    "stable": metric(row.key, row.stable),
                    "canary": metric(row.key, row.canary),
                    "change": percent(row.change_percent),
                    "better": better,
                }
            )
    return TemplateResponse(
        request,
        "billing/dashboard/compare.html",
        _context(
            request,
            "Stable vs canary",
            form=form,
            comparison=comparison,
            release=release,
            rows=rows,
            error=error,
            arms=[
                (name, metrics, money(metrics.cost_usd))
                for name, metrics in (("stable", comparison.stable), ("canary", comparison.canary))
            ]
            if comparison
            else [],
        ),
    )


def _today() -> date:
    return timezone.now().astimezone(UTC).date()


# --------------------------------------------------------------------------- views of the figures


def _totals_view(totals: dashboard.Totals) -> dict:
    return {
        "requests": f"{totals.requests:,}",
        "errors": f"{totals.errors:,}",
        "prompt_tokens": f"{totals.prompt_tokens:,}",
        "completion_tokens": f"{totals.completion_tokens:,}",
        "cost": money(totals.cost_known),
        "unpriced": f"{totals.unpriced_requests:,}" if totals.unpriced_requests else "",
    }


def _month_view(month: dashboard.MonthTotals) -> dict:
    return {
        **_totals_view(month),
        "month": month.month,
        "current": month.current,
        "projected": money(month.projected_usd) if month.current else "",
        "elapsed_days": f"{month.elapsed_s / dashboard.DAY_SECONDS:.2f}" if month.elapsed_s is not None else "",
        "days": month.month_s // dashboard.DAY_SECONDS,
    }


def _row_view(row: dashboard.SummaryRow) -> dict:
    return {
        **_totals_view(row),
        "month": row.month,
        "model": row.model,
        "provider": row.provider,
        "client_key": row.client_key,
        "arm": ARM_LABELS.get(row.arm, row.arm),
        "projected": money(row.projected_usd) if row.projected_usd is not None and row.priced_requests else "",
    }


def _key_view(key: dashboard.KeyMonth) -> dict:
    share = key.projected_percent
    return {
        "client_key": key.client_key,
        "spent": money(key.spent_usd),
        "projected": money(key.projected_usd),
        "budget": money(key.budget_usd) if key.budget_usd is not None else "none",
        "projected_percent": "" if share is None else f"{share} %",
        "over": share is not None and share >= 100,
        "unpriced": key.unpriced_requests,
    }


def _figure(element_id: str, title: str, traces: list[dict], y_title: str, *, percent_axis=False, barmode=None):
    layout = {
        "title": {"text": title},
        "margin": {"t": 48, "r": 16, "b": 48, "l": 64},
        "yaxis": {"title": {"text": y_title}, "rangemode": "tozero", **({"tickformat": ".1%"} if percent_axis else {})},
        "legend": {"orientation": "h"},
        "height": 340,
    }
    if barmode:
        layout["barmode"] = barmode
    return {"id": element_id, "data": traces, "layout": layout}


def _cost_per_day(series: dashboard.DailySeries) -> dict:
    days = [day.isoformat() for day in series.days]
    # Models whose rows all lack a price have no cost to draw: the page lists them instead.
    traces = [
        {"type": "bar", "name": model or "(none)", "x": days, "y": [_float(dashboard.to_display(v)) for v in values]}
        for model, values in sorted(series.cost_by_model.items())
        if any(values)
    ]
    return _figure(
        "chart-cost-per-day",
        f"Cost per day and model ({dashboard.display_currency()})",
        traces,
        dashboard.display_currency(),
        barmode="stack",
    )


def _cost_per_model(series: dashboard.DailySeries) -> dict:
    ordered = sorted(((m, c) for m, c in series.cost_per_model.items() if c), key=lambda item: item[1], reverse=True)
    trace = {
        "type": "bar",
        "name": "cost",
        "x": [model or "(none)" for model, _ in ordered],
        "y": [_float(dashboard.to_display(cost)) for _, cost in ordered],
    }
    return _figure(
        "chart-cost-per-model", f"Cost per model over the period ({dashboard.display_currency()})", [trace], ""
    )


def _arm_figure(series: dashboard.DailySeries, key: str, title: str, y_title: str, *, percent_axis=False) -> dict:
    days = [day.isoformat() for day in series.days]
    traces = []
    for arm, values in sorted(series.arms.items()):
        points = [None if value is None else getattr(value, key) for value in values]
        if any(point is not None for point in points):  # e.g. no drafts on an arm: no line
            traces.append(
                {"type": "scatter", "mode": "lines+markers", "name": ARM_LABELS.get(arm, arm), "x": days, "y": points}
            )
    return _figure(f"chart-{key.replace('_', '-')}", title, traces, y_title, percent_axis=percent_axis)
