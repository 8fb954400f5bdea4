from django.contrib import admin

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
