"""Usage through the API: the calling key's requests, tokens and exact cost per model in a
month, from the usage ledger; nobody else's."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from billing import client_keys
from billing.models import UsageRecord
from search.models import Membership

pytestmark = pytest.mark.django_db


def record(
    key=None, *, model="gpt-4.1", cost="0.000125", status="ok", at=None, user=None, workspace=None, tokens=(10, 5)
):
    return UsageRecord.objects.create(
        client_key=key, user=user, workspace=workspace or (key.workspace if key else None), model=model,
        provider_name="openai", prompt_tokens=tokens[0], completion_tokens=tokens[1], status=status,
        cost_usd=None if cost is None else Decimal(cost), created_at=at or timezone.now(),
    )  # fmt: skip


def test_usage_is_the_calling_keys_month_per_model_with_exact_costs(acme, other, client_for):
    key, token = client_keys.client_key_create(acme, "ci", scopes=["search"], requests_per_minute=60)
    neighbour, _ = client_keys.client_key_create(acme, "neighbour", scopes=["admin"])
    stranger, _ = client_keys.client_key_create(other, "stranger", scopes=["admin"])
    now = timezone.now()
    last_month = now.replace(day=1) - timedelta(days=1)
    record(key, cost="0.000125")
    record(key, cost="0.000000000001", tokens=(1, 0))
    record(key, cost="0.000050", status="error", tokens=(7, 0))
    record(key, model="mystery-model", cost=None, tokens=(3, 4))
    record(key, cost="1.5", at=last_month)
    record(neighbour, cost="9")
    record(stranger, cost="9")

    body = client_for(token).get("/api/v1/usage").json()

    assert body["month"] == f"{now:%Y-%m}"
    assert body["client_key"] == {
        "id": key.pk, "name": "ci", "masked": key.masked, "requests_per_minute": 60, "tokens_per_minute": None,
        "monthly_budget_usd": None,
    }  # fmt: skip
    assert (body["requests"], body["errors"], body["unpriced_requests"]) == (4, 1, 1)
    assert (body["prompt_tokens"], body["completion_tokens"], body["total_tokens"]) == (21, 9, 30)
    assert body["cost_usd"] == "0.000175000001"  # exact: no float on the way
    assert body["models"] == [
        {"model": "gpt-4.1", "provider": "openai", "requests": 3, "errors": 1, "prompt_tokens": 18,
         "completion_tokens": 5, "total_tokens": 23, "cost_usd": "0.000175000001", "unpriced_requests": 0},
        {"model": "mystery-model", "provider": "openai", "requests": 1, "errors": 0, "prompt_tokens": 3,
         "completion_tokens": 4, "total_tokens": 7, "cost_usd": "0.000000000000", "unpriced_requests": 1},
    ]  # fmt: skip

    previous = client_for(token).get("/api/v1/usage", {"month": f"{last_month:%Y-%m}"}).json()
    assert (previous["requests"], previous["cost_usd"]) == (1, "1.500000000000")
    empty = client_for(token).get("/api/v1/usage", {"month": "2001-01"}).json()
    assert (empty["requests"], empty["cost_usd"], empty["models"]) == (0, "0.000000000000", [])


@pytest.mark.parametrize("month", ["2025-13", "2025-1", "25-01", "0999-01", "2025-01-01", "last", ""])
def test_a_bad_month_is_refused(admin_client, month):
    response = admin_client.get("/api/v1/usage", {"month": month})
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "month"


def test_a_session_sees_its_users_usage_in_the_workspace(acme, other):
    user = get_user_model().objects.create_user("ann")
    Membership.objects.create(workspace=acme, user=user)
    record(user=user, workspace=acme, cost="0.25")
    record(user=user, workspace=other, cost="4")
    record(user=get_user_model().objects.create_user("bob"), workspace=acme, cost="8")
    client = APIClient()
    client.force_login(user)
    body = client.get("/api/v1/usage").json()
    assert (body["client_key"], body["requests"], body["cost_usd"]) == (None, 1, "0.250000000000")
