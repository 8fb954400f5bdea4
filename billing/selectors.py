"""Reads of the usage ledger for the APIs (the admin's dashboards read ``billing.dashboard``)."""

from __future__ import annotations

from datetime import date

from django.db import connection
from django.db.models import Count, Q, Sum

from billing.dashboard import month_start_utc, next_month
from billing.models import UsageRecord

_COLUMNS = ("model", "provider", "requests", "errors", "prompt_tokens", "completion_tokens", "cost_usd", "unpriced")


def usage_month_by_model(
    *, month: date, client_key_id: int | None = None, user_id: int | None = None, workspace_id: int | None = None
) -> list[dict]:
    """A month's usage (UTC), one row per model and provider: ``requests``, ``errors``,
    ``prompt_tokens``, ``completion_tokens``, ``cost_usd`` (of the priced rows) and ``unpriced``
    (rows without a price), ordered by model and provider.

    A client key's: from the daily rollup (``billing_usagedaily``, kept by the ledger's triggers:
    a month is at most 31 rows a model). A user's in a workspace (a browser session, which
    the rollup does not key by): from the ledger itself."""
    first, following = month.replace(day=1), next_month(month)
    if client_key_id is not None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT model, provider_name, sum(requests), sum(errors), sum(prompt_tokens), sum(completion_tokens), "
                "sum(cost_usd), sum(unpriced_requests) FROM billing_usagedaily "
                "WHERE client_key_id = %s AND day >= %s AND day < %s GROUP BY 1, 2 ORDER BY 1, 2",
                [client_key_id, first, following],
            )
            return [dict(zip(_COLUMNS, row, strict=True)) for row in cursor.fetchall()]
    rows = (
        UsageRecord.objects.filter(user_id=user_id, workspace_id=workspace_id)
        .filter(created_at__gte=month_start_utc(first), created_at__lt=month_start_utc(following))
        .values("model", "provider_name")
        .annotate(
            requests=Count("id"),
            errors=Count("id", filter=Q(status=UsageRecord.Status.ERROR)),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cost=Sum("cost_usd"),
            unpriced=Count("id", filter=Q(cost_usd__isnull=True)),
        )
        .order_by("model", "provider_name")
    )
    return [
        {"model": row["model"], "provider": row["provider_name"], **{name: row[name] for name in _COLUMNS[2:6]},
         "cost_usd": row["cost"] or 0, "unpriced": row["unpriced"]}
        for row in rows
    ]  # fmt: skip
