"""Billing: client API keys, prices, the usage ledger and budget alerts.

The usage ledger has one row per generation (and embedding) call, never updated: every
generation ends in exactly one row, whatever happened (answered, failed, the client went
away), queued by the worker that ran it and stored by ``billing.ledger``. Its cost is
computed when it is stored, from the price in force at the row's time (``Price``), in exact
decimal arithmetic; a row whose model has no price keeps a NULL cost and is flagged, never
counted as 0. The canary analysis and the cost dashboards read the ledger.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.utils import timezone

# Costs are exact: a price has 6 decimals per million tokens, so a token costs at most 12
# decimals of a dollar; sums of such values stay exact (no rounding anywhere).
COST_DIGITS, COST_DECIMALS = 24, 12


class Price(models.Model):
    """What a model's tokens cost from ``effective_from`` on, until the model's next price.

    ``model`` is the model name the ledger records (the provider's ``model``). ``local`` is
    the internal price of the local GPU pool: it applies to any model served by a ``local``
    provider that has no price of its own. A new price is a new row: the past keeps the
    price it was computed with (each ledger row records which)."""

    LOCAL_POOL = "local"

    model = models.CharField(max_length=300, help_text="Model name as providers report it; 'local' for the GPU pool.")
    input_usd_per_million = models.DecimalField(max_digits=12, decimal_places=6)
    output_usd_per_million = models.DecimalField(max_digits=12, decimal_places=6)
    effective_from = models.DateTimeField(default=timezone.now, help_text="UTC; the price applies from then on.")
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["model", "effective_from"], name="price_model_from_unique"),
            models.CheckConstraint(
                condition=Q(input_usd_per_million__gte=0) & Q(output_usd_per_million__gte=0),
                name="price_non_negative",
            ),
        ]
        indexes = [models.Index(fields=["model", "-effective_from"], name="price_model_from")]

    def __str__(self) -> str:
        rates = f"${self.input_usd_per_million} in, ${self.output_usd_per_million} out per M tokens"
        return f"{self.model}: {rates} from {self.effective_from:%Y-%m-%d}"


class ClientKey(models.Model):
    """An API key of a client of our REST and OpenAI-compatible APIs.

    Shown once when created (``billing.client_keys.client_key_create``): ``rk_<prefix>_<secret>``.
    Stored: the prefix (the lookup id), the SHA-256 of the whole key and its last four
    characters; never the key. Limits: requests and tokens per minute (Redis, across web
    processes) and a monthly budget in USD (``billing.limits``); None is unlimited."""

    class Scope(models.TextChoices):
        SEARCH = "search", "Search"
        DOCUMENTS = "documents", "Documents"
        GENERATE = "generate", "Generate"
        ADMIN = "admin", "Admin"

    workspace = models.ForeignKey("search.Workspace", on_delete=models.CASCADE, related_name="client_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    last_four = models.CharField(max_length=4, editable=False)
    scopes = ArrayField(models.CharField(max_length=16, choices=Scope.choices), default=list, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Whose documents it reads (search.access.reader_of_key): a user's or a group's; neither,
    # only those open to the whole workspace. A deleted user or group leaves it the latter.
    acts_for_user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="It reads what this user may read (while a member of the key's workspace).",
    )
    acts_for_group = models.ForeignKey(
        "auth.Group",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="It reads what this group may read. Neither user nor group: what the whole workspace may read.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="UTC; empty: never.")
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_reason = models.CharField(max_length=200, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    monthly_budget_usd = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)

    class Meta:
        ordering = ["workspace", "name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(monthly_budget_usd__isnull=True) | Q(monthly_budget_usd__gte=0),
                name="client_key_budget_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(acts_for_user__isnull=True) | Q(acts_for_group__isnull=True),
                name="client_key_acts_for_one",
                violation_error_message="A key acts for a user or for a group, not both.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} (rk_{self.prefix}_…{self.last_four})"

    @property
    def masked(self) -> str:
        return f"rk_{self.prefix}_…{self.last_four}"


class BudgetAlert(models.Model):
    """A client key's month reached 80 % or 100 % of its budget (once per threshold and month)."""

    client_key = models.ForeignKey(ClientKey, on_delete=models.CASCADE, related_name="budget_alerts")
    month = models.DateField(help_text="The first day of the month (UTC).")
    threshold_percent = models.PositiveSmallIntegerField()
    spent_usd = models.DecimalField(max_digits=COST_DIGITS, decimal_places=COST_DECIMALS)
    budget_usd = models.DecimalField(max_digits=14, decimal_places=2)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["client_key", "month", "threshold_percent"], name="budget_alert_once"),
        ]

    def __str__(self) -> str:
        return f"{self.client_key}: {self.threshold_percent} % of {self.month:%Y-%m}"


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
    # The X-Request-ID of the web request that caused it (ragsite/logs.py), to find its log lines.
    trace_id = models.CharField(max_length=64, blank=True, db_index=True)
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
    client_key = models.ForeignKey(ClientKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
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
    # From ``price`` (in force at ``created_at``) when stored; NULL when the model has no price.
    cost_usd = models.DecimalField(max_digits=COST_DIGITS, decimal_places=COST_DECIMALS, null=True, blank=True)
    price = models.ForeignKey(Price, null=True, blank=True, on_delete=models.PROTECT, related_name="+")

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
            models.Index(fields=["client_key", "created_at"], name="usage_client_key_time"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.request_id} {self.status}"
