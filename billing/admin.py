"""Billing in the admin: client API keys (shown once), prices, budget alerts, and the usage
ledger, read-only (the ledger is append-only; nothing here edits it)."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.template.response import TemplateResponse
from django.utils import timezone

from billing import client_keys
from billing.models import BudgetAlert, ClientKey, Price, UsageRecord
from ragsite.admin import ReadOnlyAdmin


class ClientKeyForm(forms.ModelForm):
    scopes = forms.MultipleChoiceField(
        choices=ClientKey.Scope.choices, widget=forms.CheckboxSelectMultiple, required=False
    )

    class Meta:
        model = ClientKey
        fields = [
            "workspace",
            "name",
            "scopes",
            "expires_at",
            "requests_per_minute",
            "tokens_per_minute",
            "monthly_budget_usd",
        ]


@admin.register(ClientKey)
class ClientKeyAdmin(admin.ModelAdmin):
    """Keys are made here and shown once, on the page after "Save"; the list shows only
    their prefix and last four characters."""

    form = ClientKeyForm
    list_display = [
        "name",
        "workspace",
        "masked",
        "scope_list",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "requests_per_minute",
        "tokens_per_minute",
        "monthly_budget_usd",
    ]
    list_filter = ["workspace", "revoked_at", "expires_at"]
    search_fields = ["name", "prefix"]
    readonly_fields = ["masked", "created_by", "created_at", "last_used_at", "revoked_at", "revoked_reason"]
    actions = ["revoke_keys"]

    @admin.display(description="key")
    def masked(self, key: ClientKey) -> str:
        return key.masked if key.prefix else "(shown once, after saving)"

    @admin.display(description="scopes")
    def scope_list(self, key: ClientKey) -> str:
        return ", ".join(key.scopes) or "none"

    def save_model(self, request, obj, form, change):
        if not change:
            obj.created_by = request.user
            # Held on the request only, for the next page; never stored or logged.
            request._new_client_key = client_keys.client_key_secret_issue(obj)
        super().save_model(request, obj, form, change)
        if not change:
            client_keys.key_created_audit(obj, request=request)

    def response_add(self, request, obj, post_url_continue=None):
        token = getattr(request, "_new_client_key", None)
        if token is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "key": obj,
            "token": token,
            "title": f"API key {obj.name} created",
        }
        # The admin's views already send Cache-Control: no-store (never_cache): the key stays in no cache.
        return TemplateResponse(request, "admin/billing/clientkey/created.html", context)

    @admin.action(description="Revoke the selected keys (refused from now on)")
    def revoke_keys(self, request, queryset):
        count = 0
        for key in queryset.filter(revoked_at__isnull=True):
            client_keys.client_key_revoke(
                key, reason=f"revoked in the admin by {request.user.get_username()}", by=request.user, request=request
            )
            count += 1
        self.message_user(request, f"{count} key(s) revoked.", messages.SUCCESS)


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    """Prices per model; a change is a new row with its own date (the past keeps its price).
    The list warns about models the ledger saw in the last 90 days that have no price."""

    list_display = ["model", "input_usd_per_million", "output_usd_per_million", "effective_from", "note"]
    list_filter = ["model"]
    search_fields = ["model", "note"]
    ordering = ["model", "-effective_from"]

    def get_readonly_fields(self, request, obj=None):
        # A price in use is history: change it by adding a row from a later date.
        if obj is not None and UsageRecord.objects.filter(price=obj).exists():
            return ["model", "input_usd_per_million", "output_usd_per_million", "effective_from"]
        return []

    def changelist_view(self, request, extra_context=None):
        since = timezone.now() - timedelta(days=90)
        unpriced = list(
            UsageRecord.objects.filter(created_at__gte=since, cost_usd__isnull=True)
            .exclude(model="")
            .values_list("model", flat=True)
            .distinct()[:20]
        )
        if unpriced:
            self.message_user(
                request,
                f"No price for {', '.join(sorted(unpriced))}: their usage has no cost until a price is added "
                "(from a date at or before that usage).",
                messages.WARNING,
            )
        return super().changelist_view(request, extra_context)


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin):
    list_display = ["created_at", "client_key", "month", "threshold_percent", "spent_usd", "budget_usd"]
    list_filter = ["threshold_percent", "month"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class PricedFilter(admin.SimpleListFilter):
    title = "price"
    parameter_name = "priced"

    def lookups(self, request, model_admin):
        return [("no", "No price (cost unknown)"), ("yes", "Priced")]

    def queryset(self, request, queryset):
        if self.value() == "no":
            return queryset.filter(cost_usd__isnull=True)
        if self.value() == "yes":
            return queryset.filter(cost_usd__isnull=False)
        return queryset


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "kind",
        "status",
        "route_name",
        "arm",
        "provider_name",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "attempts",
        "latency_ms",
        "ttft_ms",
        "error_class",
        "cost_usd",
    ]
    list_filter = [PricedFilter, "status", "arm", "kind", "route", "provider", "release", "client_key", "created_at"]
    list_select_related = False
    search_fields = ["request_id", "route_name", "provider_name", "model", "error_class"]
    # No date_hierarchy: its year/month links need a DISTINCT over the whole ledger on each
    # page load; the created_at filter uses fixed ranges instead.
    show_full_result_count = False
