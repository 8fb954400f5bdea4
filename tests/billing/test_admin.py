"""Prices and the ledger in the admin: a model without a price is flagged, a price already
used is history (read-only), and the ledger filters the rows without a cost."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from billing.models import Price, UsageRecord

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client):
    client.force_login(get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-for-tests"))
    return client


def test_models_used_without_a_price_are_flagged_on_the_price_list(staff_client):
    UsageRecord.objects.create(status="ok", model="mystery-70b", created_at=timezone.now())
    UsageRecord.objects.create(status="ok", model="gpt-4.1", cost_usd=Decimal("0.01"), created_at=timezone.now())

    page = staff_client.get("/admin/billing/price/").content.decode()

    assert "No price for mystery-70b: their usage has no cost until a price is added" in page
    assert "gpt-4.1" not in page.split("No price for")[1].split("</li>")[0]


def test_a_price_in_use_is_read_only_and_an_unused_one_editable(staff_client):
    used = Price.objects.create(
        model="m-used",
        input_usd_per_million=1,
        output_usd_per_million=2,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    )
    unused = Price.objects.create(
        model="m-new",
        input_usd_per_million=1,
        output_usd_per_million=2,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    )
    UsageRecord.objects.create(status="ok", model="m-used", price=used, cost_usd=Decimal("0.000003"))

    used_page = staff_client.get(f"/admin/billing/price/{used.id}/change/").content.decode()
    unused_page = staff_client.get(f"/admin/billing/price/{unused.id}/change/").content.decode()

    assert 'name="output_usd_per_million"' not in used_page
    assert 'name="output_usd_per_million"' in unused_page


def test_the_ledger_lists_rows_without_a_cost(staff_client):
    unpriced = UsageRecord.objects.create(status="ok", model="mystery-70b", request_id=uuid.uuid4())
    priced = UsageRecord.objects.create(status="ok", model="gpt-4.1", cost_usd=Decimal("0.5"), request_id=uuid.uuid4())

    page = staff_client.get("/admin/billing/usagerecord/?priced=no").content.decode()

    assert f"/admin/billing/usagerecord/{unpriced.id}/" in page
    assert f"/admin/billing/usagerecord/{priced.id}/" not in page
