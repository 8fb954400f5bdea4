"""The audit log in the admin console: read-only, for staff given ``ragsite.view_auditevent``
(an auditor's group), with its rows exported as CSV (the filter and search applied); and who
signs in through the identity provider, and which groups it provides."""

from __future__ import annotations

import csv
import json

from django.contrib import admin
from django.http import HttpResponse
from django.utils import timezone

from ragsite.models import AuditEvent, Identity, ProvidedGroup

CSV_FIELDS = ("at", "action", "actor", "actor_name", "workspace_id", "target", "outcome", "client_ip",
              "user_agent", "request_id", "detail")  # fmt: skip


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written by the system only (the audit log, the usage ledger): listed and read, never
    added, changed or deleted in the admin."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "action", "actor", "actor_name", "target", "outcome", "client_ip"]
    list_filter = ["action", "outcome", ("at", admin.DateFieldListFilter)]
    search_fields = ["actor", "actor_name", "target", "request_id"]
    # A table of a row per search: no date_hierarchy (a DISTINCT over all of it per page) and
    # no full count, as for the usage ledger.
    show_full_result_count = False
    actions = ["export_csv"]

    @admin.action(description="Export the selected events as CSV", permissions=["view"])
    def export_csv(self, request, queryset):
        response = HttpResponse(content_type="text/csv; charset=utf-8")
        stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
        response["Content-Disposition"] = f'attachment; filename="audit-{stamp}.csv"'
        response.write("\ufeff")  # Excel opens UTF-8 (Japanese names) only with the BOM
        writer = csv.writer(response)
        writer.writerow(CSV_FIELDS)
        for event in queryset.order_by("at", "id").iterator():
            row = {name: getattr(event, name) for name in CSV_FIELDS}
            row["at"] = event.at.isoformat()  # UTC, as stored
            row["detail"] = json.dumps(event.detail, ensure_ascii=False)
            writer.writerow(row.values())
        return response


@admin.register(Identity)
class IdentityAdmin(admin.ModelAdmin):
    """Made by sign-ins (ragsite.identity); deleting one unlinks the user from the provider's
    subject (their next sign-in makes a new user), which is why it is the only change allowed."""

    list_display = ["user", "subject", "issuer", "signed_in_at", "created_at"]
    search_fields = ["user__username", "subject"]
    readonly_fields = ["user", "issuer", "subject", "signed_in_at", "created_at"]

    def has_add_permission(self, request):
        return False


@admin.register(ProvidedGroup)
class ProvidedGroupAdmin(ReadOnlyAdmin):
    list_display = ["group", "issuer", "created_at"]
    search_fields = ["group__name"]
