"""Periodic billing jobs (queue ``default``)."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from billing import ledger


@shared_task(name="billing.tasks.ledger_drain", ignore_result=True)
def ledger_drain() -> int:
    """Beat, every 15 s: store the usage rows still queued, taking
    over those another drainer read ``LEDGER_CLAIM_IDLE_S`` ago and never stored."""
    return ledger.usage_records_store(claim_idle_ms=int(settings.LEDGER_CLAIM_IDLE_S * 1000))
