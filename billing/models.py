"""The usage ledger: one row per generation (and, later, embedding) call, never updated.

Every generation ends in exactly one row, whatever happened (answered, failed, the client
went away), written by the worker that ran it. The canary analysis reads the ledger; the
cost dashboards will too. Cost columns are filled from prices in force at write time.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class UsageRecord(models.Model):
    class Kind(models.TextChoices):
        GENERATION = "generation", "Generation"
        EMBEDDING = "embedding", "Embedding"

    class Status(models.TextChoices):
        OK = "ok", "OK"
        ERROR = "error", "Error"
        CANCELLED = "cancelled", "Cancelled"

    id = models.BigAutoField(primary_key=True)
    request_id = models.UUIDField(default=uuid.uuid4, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.GENERATION)
    # Who: references are kept loose (SET_NULL) so deleting a workspace or user never deletes
    # what was spent; the ledger stays append-only.
    workspace = models.ForeignKey(
        "search.Workspace", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Where it went.
    route = models.ForeignKey("inference.Route", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    route_name = models.CharField(max_length=100, blank=True)
    release = models.ForeignKey(
        "inference.CanaryRelease", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    arm = models.CharField(max_length=8, blank=True, help_text="stable or canary when a release applied.")
    provider = models.ForeignKey(
        "inference.Provider", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    provider_name = models.CharField(max_length=100, blank=True)
    model = models.CharField(max_length=300, blank=True)
    upstream_key = models.ForeignKey(
        "inference.UpstreamKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # What it took.
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    draft_tokens_proposed = models.PositiveIntegerField(default=0)
    draft_tokens_accepted = models.PositiveIntegerField(default=0)
    usage_source = models.CharField(max_length=16, blank=True, help_text="upstream, counted or engine.")
    attempts = models.PositiveSmallIntegerField(default=1)
    latency_ms = models.FloatField(default=0.0)
    ttft_ms = models.FloatField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices)
    error_class = models.CharField(max_length=32, blank=True)
    cost_usd = models.DecimalField(max_digits=14, decimal_places=8, null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(prompt_tokens__gte=0)
                & Q(completion_tokens__gte=0)
                & Q(draft_tokens_proposed__gte=0)
                & Q(draft_tokens_accepted__gte=0),
                name="usage_tokens_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(cost_usd__isnull=True) | Q(cost_usd__gte=0), name="usage_cost_non_negative"
            ),
            models.CheckConstraint(
                condition=Q(latency_ms__gte=0) & (Q(ttft_ms__isnull=True) | Q(ttft_ms__gte=0)),
                name="usage_times_non_negative",
            ),
        ]
        indexes = [
            models.Index(fields=["created_at"], name="usage_created"),
            models.Index(fields=["release", "arm", "created_at"], name="usage_release_arm_time"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.request_id} {self.status}"
