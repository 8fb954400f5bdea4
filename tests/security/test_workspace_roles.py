"""Workspace roles (viewer, editor, admin), given to a user or to a whole group: a viewer
searches and reads, an editor also changes documents, in the browser UI and the REST API alike,
and a key acting for a viewer changes nothing either (search.access.role_in)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from rest_framework.test import APIClient

from billing import client_keys
from search.access import role_in
from search.models import Document, Membership, Role, WorkspaceGroup
from search.scoping import workspaces_visible_to
from search.services import collection_create, workspace_create
from tests.search.files import ingest_texts

pytestmark = pytest.mark.django_db


@pytest.fixture
def acme(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "media"
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    (handbook,) = ingest_texts(collection, {"handbook.md": "# Handbook\n\nThe office opens at nine."})
    users = get_user_model().objects
    viewer, editor = users.create_user("vera", password="pw-vera-1"), users.create_user("eddie", password="pw-eddie-1")
    Membership.objects.create(workspace=workspace, user=viewer, role=Role.VIEWER)
    Membership.objects.create(workspace=workspace, user=editor, role=Role.EDITOR)
    return type("Acme", (), {"workspace": workspace, "collection": collection, "viewer": viewer, "editor": editor,
                             "handbook": Document.objects.get(pk=handbook)})  # fmt: skip


def browser_of(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def api_of(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def upload(client, collection) -> int:
    return client.post(
        "/documents/upload/", {"collection": collection.pk, "files": [SimpleUploadedFile("new.md", b"# New\n\nText.")]}
    ).status_code


def test_a_viewer_reads_in_the_browser_but_changes_nothing(acme):
    viewer = browser_of(acme.viewer)
    page = viewer.get("/documents/").content.decode()
    assert "handbook.md" in page and 'id="viewer-notice"' in page
    assert 'action="/documents/upload/"' not in page and f'id="delete-{acme.handbook.pk}"' not in page
    assert viewer.get("/", {"q": "office"}).status_code == 200

    assert upload(viewer, acme.collection) == 403
    assert viewer.post(f"/documents/{acme.handbook.pk}/delete/").status_code == 403
    assert viewer.post(f"/documents/{acme.handbook.pk}/retry/").status_code == 403
    assert list(Document.objects.values_list("source_name", flat=True)) == ["handbook.md"]

    editor = browser_of(acme.editor)
    assert f'id="delete-{acme.handbook.pk}"' in editor.get("/documents/").content.decode()
    assert upload(editor, acme.collection) == 302
    assert editor.post(f"/documents/{acme.handbook.pk}/delete/").status_code == 302
    assert list(Document.objects.values_list("source_name", flat=True)) == ["new.md"]


def test_a_viewer_reads_through_the_rest_api_but_changes_nothing(acme):
    viewer, editor = api_of(acme.viewer), api_of(acme.editor)
    assert viewer.get("/api/v1/documents").json()["results"][0]["id"] == acme.handbook.pk
    body = {"collection": acme.collection.pk, "files": [SimpleUploadedFile("new.md", b"# New\n\nText.")]}

    refused = viewer.post("/api/v1/documents", body, format="multipart")
    readers = viewer.post(f"/api/v1/documents/{acme.handbook.pk}/readers", {"users": ["vera"]}, format="json")
    deleted = viewer.delete(f"/api/v1/documents/{acme.handbook.pk}")

    assert (refused.status_code, readers.status_code, deleted.status_code) == (403, 403, 403)
    assert refused.json()["error"]["code"] == "insufficient_role"
    assert refused.json()["error"]["message"] == (
        "vera's role in workspace 'acme' is viewer: uploading, retrying and deleting documents and setting "
        "their readers need the editor or admin role."
    )
    assert viewer.post("/api/v1/search", {"query": "office"}, format="json").status_code == 200
    body["files"] = [SimpleUploadedFile("new.md", b"# New\n\nText.")]
    assert editor.post("/api/v1/documents", body, format="multipart").status_code == 201


def test_a_key_acting_for_a_viewer_changes_nothing_and_a_workspace_key_keeps_its_scopes(acme):
    _, for_viewer = client_keys.client_key_create(acme.workspace, "vera's", scopes=["admin"], acts_for_user=acme.viewer)
    _, for_workspace = client_keys.client_key_create(acme.workspace, "ingest", scopes=["documents"])
    statuses = []
    for token in (for_viewer, for_workspace):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        body = {"collection": acme.collection.pk, "files": [SimpleUploadedFile(f"{token[-4:]}.md", token.encode())]}
        statuses.append(client.post("/api/v1/documents", body, format="multipart").status_code)
    assert statuses == [403, 201]


def test_a_group_makes_its_members_members_and_the_highest_role_holds(acme):
    users = get_user_model().objects
    finance = Group.objects.create(name="finance")
    gina = users.create_user("gina", password="pw-gina-1")
    assert role_in(gina, acme.workspace) is None and not workspaces_visible_to(gina).exists()

    gina.groups.add(finance)
    WorkspaceGroup.objects.create(workspace=acme.workspace, group=finance, role=Role.VIEWER)
    assert role_in(gina, acme.workspace) == Role.VIEWER
    assert list(workspaces_visible_to(gina)) == [acme.workspace]
    assert "handbook.md" in browser_of(gina).get("/documents/").content.decode()
    assert upload(browser_of(gina), acme.collection) == 403

    Membership.objects.create(workspace=acme.workspace, user=gina, role=Role.EDITOR)  # direct and by group: listed once
    assert role_in(gina, acme.workspace) == Role.EDITOR and list(workspaces_visible_to(gina)) == [acme.workspace]
    WorkspaceGroup.objects.filter(group=finance).update(role=Role.ADMIN)
    assert role_in(gina, acme.workspace) == Role.ADMIN
    gina.is_active = False
    assert role_in(gina, acme.workspace) is None
    root = users.create_superuser("root", password="pw-root-1")
    assert role_in(root, acme.workspace) == Role.ADMIN


def test_an_editor_sets_who_may_read_a_document_in_the_browser(acme):
    from ragsite.audit import Action
    from ragsite.models import AuditEvent

    finance, other_tenants = Group.objects.create(name="finance"), Group.objects.create(name="elsewhere")
    WorkspaceGroup.objects.create(workspace=acme.workspace, group=finance)
    editor, viewer = browser_of(acme.editor), browser_of(acme.viewer)
    url = f"/documents/{acme.handbook.pk}/readers/"
    assert f'href="{url}"' in editor.get("/documents/").content.decode()
    page = editor.get(url).content.decode()
    assert f'value="{finance.pk}"' in page and f'value="{other_tenants.pk}"' not in page
    assert (viewer.get(url).status_code, viewer.post(url, {"groups": [finance.pk]}).status_code) == (403, 403)

    restricted = editor.post(url, {"groups": [finance.pk]})
    acme.handbook.refresh_from_db()
    assert (restricted.status_code, acme.handbook.readers) == (302, [f"u:{acme.editor.pk}", f"g:{finance.pk}"])
    assert "handbook.md" not in viewer.get("/documents/").content.decode()  # vera is not in finance
    refused = editor.post(url, {"groups": [other_tenants.pk]})
    assert refused.status_code == 200 and 'role="alert"' in refused.content.decode()
    assert editor.post(url, {}).status_code == 302
    acme.handbook.refresh_from_db()
    assert acme.handbook.readers == ["*"]
    changes = AuditEvent.objects.filter(action=Action.READERS_CHANGE).order_by("id")
    assert [(event.detail["before"], event.detail["after"]) for event in changes] == [
        (["*"], [f"u:{acme.editor.pk}", f"g:{finance.pk}"]),
        ([f"u:{acme.editor.pk}", f"g:{finance.pk}"], ["*"]),
    ]
