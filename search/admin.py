from django.contrib import admin

from ragsite.audit import Action, audit_record
from search.models import Collection, Document, Membership, Workspace, WorkspaceGroup


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class WorkspaceGroupInline(admin.TabularInline):
    """Whole groups as members (the identity provider's, or made by hand), each in a role."""

    model = WorkspaceGroup
    extra = 0
    autocomplete_fields = ["group"]
    verbose_name = "group member"


@admin.register(Workspace)
class WorkspaceAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "created_at"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline, WorkspaceGroupInline]


@admin.register(Collection)
class CollectionAdmin(admin.ModelAdmin):
    list_display = ["name", "workspace", "created_at"]
    list_filter = ["workspace"]
    search_fields = ["name"]


@admin.register(Document)
class DocumentAdmin(admin.ModelAdmin):
    list_display = ["title", "collection", "status", "media_type", "size_bytes", "updated_at"]
    list_filter = ["status", "collection__workspace", "media_type"]
    search_fields = ["title", "source_name", "sha256"]
    # Readers are changed through search.services.document_readers_set (REST, ingest), which
    # changes the chunks' copy with them: a field edited here would leave the chunks behind.
    readonly_fields = ["sha256", "size_bytes", "readers", "created_at", "updated_at"]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """Staff see a document's metadata here whoever its readers are: the one place that
        passes over them, so opening a restricted one is in the audit log, as opened "via admin"."""
        response = super().change_view(request, object_id, form_url, extra_context)
        document = self.get_object(request, object_id)
        if response.status_code == 200 and document is not None and "*" not in document.readers:
            audit_record(
                Action.DOCUMENT_OPEN,
                user=request.user,
                request=request,
                workspace_id=document.collection.workspace_id,
                target=f"document:{document.pk}",
                detail={"title": document.title, "via": "admin", "readers": list(document.readers)},
            )
        return response
