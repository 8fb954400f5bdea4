"""The usage ledger in the admin: read-only (the ledger is append-only; nothing here edits it)."""

from __future__ import annotations

from django.contrib import admin

from billing.models import UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
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
    list_filter = ["status", "arm", "kind", "route", "provider", "release", "created_at"]
    list_select_related = False
    search_fields = ["request_id", "route_name", "provider_name", "model", "error_class"]
    # No date_hierarchy: its year/month links need a DISTINCT over the whole ledger on each
    # page load; the created_at filter uses fixed ranges instead.
    show_full_result_count = False

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
