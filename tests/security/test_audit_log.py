"""The audit log (ragsite.audit): a row for every sign-in (and refused one), sign-out, search,
question, document opened or downloaded, change of readers, key created or revoked, with its
time, actor, client and outcome; append-only in the database itself; read and exported by
auditors in the admin console, and nobody else."""

from __future__ import annotations

import csv
import io
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from billing import client_keys
from ragsite.audit import Action, audit_purge, audit_record
from ragsite.models import AuditEvent
from search.access import readers_for
from search.models import Chunk, Document, Membership
from search.services import collection_create, document_readers_set, workspace_create
from tests.search.files import ingest_texts

pytestmark = pytest.mark.django_db

BROWSER = "Mozilla/5.0 (audit test)"


@pytest.fixture
def site(db, settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "media"
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    (document,) = ingest_texts(collection, {"badges.md": "# Badges\n\nA lost badge is replaced for 3,000 yen."})
    (secret,) = ingest_texts(collection, {"pay.md": "# Pay\n\nPay day is the 25th of each month."})
    document, secret = Document.objects.get(pk=document), Document.objects.get(pk=secret)
    user = get_user_model().objects.create_user("ann", password="pw-ann-123")
    Membership.objects.create(workspace=workspace, user=user)
    document_readers_set(document=secret, readers=readers_for(users=[get_user_model().objects.create_user("hr").pk]))
    return workspace, collection, document, secret, user


@pytest.fixture
def since(db) -> int:
    """The id of this test's first event: earlier tests may have committed theirs (tenants
    set up once per module), which are not this test's."""
    return (AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0) + 1


def events(since: int, **filters) -> list[tuple]:
    return list(
        AuditEvent.objects.filter(id__gte=since, **filters)
        .order_by("id")
        .values_list("action", "actor", "target", "outcome", "client_ip", "user_agent")
    )


def test_signing_in_and_out_and_a_refused_sign_in_are_recorded(since, site):
    *_, user = site
    client = Client(HTTP_USER_AGENT=BROWSER, REMOTE_ADDR="203.0.113.7")
    refused = client.post("/accounts/login/", {"username": "ann", "password": "wrong"})
    assert refused.status_code == 200
    assert client.post("/accounts/login/", {"username": "ann", "password": "pw-ann-123"}).status_code == 302
    assert client.post("/accounts/logout/").status_code == 302
    actor = f"user:{user.pk}"
    assert events(since) == [
        ("sign_in_failed", "anonymous", "", "refused", "203.0.113.7", BROWSER),
        ("sign_in", actor, "", "ok", "203.0.113.7", BROWSER),
        ("sign_out", actor, "", "ok", "203.0.113.7", BROWSER),
    ]
    failed = AuditEvent.objects.get(action="sign_in_failed", id__gte=since)
    assert failed.detail == {"username": "ann"} and "wrong" not in str(failed.detail)
    assert AuditEvent.objects.get(action="sign_in", id__gte=since).actor_name == "ann"


def test_searches_questions_and_documents_opened_in_the_ui_are_recorded(since, site):
    workspace, _, document, secret, user = site
    client = Client(HTTP_USER_AGENT=BROWSER)
    client.force_login(user)
    client.get("/", {"q": "lost badge"})
    client.post("/ask/", {"q": "How much is a lost badge?"})
    chunk = Chunk.objects.filter(document=document).first()
    client.get(f"/passages/{chunk.pk}/")
    client.get(f"/documents/{document.pk}/file/")
    assert client.get(f"/documents/{secret.pk}/file/").status_code == 404
    actor = f"user:{user.pk}"
    recorded = [event for event in events(since, actor=actor) if event[0] != "sign_in"]  # force_login signs in too
    answer_target = recorded[1][2]
    assert recorded == [
        ("search", actor, "", "ok", "127.0.0.1", BROWSER),
        ("ask", actor, answer_target, "ok", "127.0.0.1", BROWSER),
        ("document_open", actor, f"document:{document.pk}", "ok", "127.0.0.1", BROWSER),
        ("document_download", actor, f"document:{document.pk}", "ok", "127.0.0.1", BROWSER),
        ("document_download", actor, f"document:{secret.pk}", "not_found", "127.0.0.1", BROWSER),
    ]
    assert answer_target.startswith("answer:")
    searched = AuditEvent.objects.filter(id__gte=since, actor=actor, action__in=["search", "ask"])
    details = dict(searched.values_list("action", "detail"))
    assert details == {
        "search": {"query": "lost badge", "mode": "hybrid"},
        "ask": {"question": "How much is a lost badge?"},
    }
    assert set(searched.values_list("workspace_id", flat=True)) == {workspace.pk}


def test_the_api_records_its_keys_searches_questions_downloads_and_changes_of_readers(since, site):
    workspace, _, document, secret, user = site
    key, token = client_keys.client_key_create(workspace, "ci key", scopes=["admin"], created_by=user)
    api = APIClient(HTTP_USER_AGENT=BROWSER)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    api.post("/api/v1/search", {"query": "badge"}, format="json")
    api.post("/api/v1/answers", {"question": "How much is a lost badge?"}, format="json")
    api.get(f"/api/v1/documents/{document.pk}")
    api.get(f"/api/v1/documents/{document.pk}/file")
    api.get(f"/api/v1/documents/{secret.pk}/file")
    api.post(f"/api/v1/documents/{document.pk}/readers", {"users": ["ann"]}, format="json")
    body = {"model": "extractive", "messages": [{"role": "user", "content": "Pay day?"}]}
    assert api.post("/v1/chat/completions", body, format="json").status_code == 200
    client_keys.client_key_revoke(key, reason="rotated", by=user)
    k = f"key:{key.pk}"
    recorded = [(action, actor, target, outcome) for action, actor, target, outcome, *_ in events(since)]
    assert [row for row in recorded if row[0] != "ask"] == [
        ("key_create", f"user:{user.pk}", k, "ok"),
        ("search", k, "", "ok"),
        ("document_open", k, f"document:{document.pk}", "ok"),
        ("document_download", k, f"document:{document.pk}", "ok"),
        ("document_download", k, f"document:{secret.pk}", "not_found"),
        ("readers_change", k, f"document:{document.pk}", "ok"),
        ("key_revoke", f"user:{user.pk}", k, "ok"),
    ]
    asked = AuditEvent.objects.filter(action="ask", id__gte=since).order_by("id")
    assert [event.detail["question"] for event in asked] == ["How much is a lost badge?", "Pay day?"]
    assert all(event.actor == k and event.target.startswith("answer:") for event in asked)
    change = AuditEvent.objects.get(action="readers_change", id__gte=since)
    assert change.detail == {"title": "Badges", "before": ["*"], "after": [f"u:{user.pk}"]}
    created = AuditEvent.objects.get(action="key_create", id__gte=since)
    assert created.detail == {"name": "ci key", "scopes": ["admin"], "acts_for_user": None, "acts_for_group": None}
    assert token not in str(list(AuditEvent.objects.filter(id__gte=since).values_list("detail", flat=True)))


def test_the_database_refuses_to_change_or_delete_an_event(site):
    event = audit_record("search", actor="operator", detail={"query": "x"})
    for statement in (
        "UPDATE ragsite_auditevent SET outcome = 'forged' WHERE id = %s",
        "DELETE FROM ragsite_auditevent WHERE id = %s",
    ):
        with pytest.raises(DatabaseError, match="the audit log is append-only"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(statement, [event.pk])
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(pk=event.pk).update(actor="someone else")
    assert AuditEvent.objects.get(pk=event.pk).outcome == "ok"


def test_events_past_their_retention_are_purged_and_no_younger_one(since, site, settings):
    settings.AUDIT_RETENTION_DAYS = 400
    old = audit_record("search", actor="operator")
    young = audit_record("search", actor="operator")
    # Inserted as they would have been 401 days ago (an INSERT is all the table allows).
    AuditEvent.objects.create(at=timezone.now() - timedelta(days=401), action="search", actor="operator")
    assert audit_purge() == 1
    assert set(AuditEvent.objects.filter(id__gte=since).values_list("pk", flat=True)) == {old.pk, young.pk}
    assert not AuditEvent.objects.filter(at__lt=timezone.now() - timedelta(days=400)).exists()


def test_auditors_read_and_export_the_log_and_members_do_not(site):
    *_, user = site
    searched = audit_record("search", user=user, detail={"query": "給与 規程"})
    auditor = get_user_model().objects.create_user("audra", is_staff=True)
    auditors = Group.objects.create(name="auditors")
    auditors.permissions.add(Permission.objects.get(codename="view_auditevent"))
    auditor.groups.add(auditors)
    client = Client()
    client.force_login(auditor)
    page = client.get("/admin/ragsite/auditevent/")
    assert page.status_code == 200 and f"user:{user.pk}" in page.content.decode()
    exported = client.post("/admin/ragsite/auditevent/", {"action": "export_csv", "_selected_action": [searched.pk]})
    assert exported.status_code == 200 and exported["Content-Type"] == "text/csv; charset=utf-8"
    rows = list(csv.reader(io.StringIO(exported.content.decode("utf-8-sig"))))
    assert rows[0][:3] == ["at", "action", "actor"]
    assert [row[1:3] for row in rows[1:]] == [["search", f"user:{user.pk}"]]
    assert rows[1][-1] == '{"query": "給与 規程"}'
    # No add, change or delete, even for the auditor.
    assert client.post(f"/admin/ragsite/auditevent/{searched.pk}/delete/", {"post": "yes"}).status_code == 403
    member = Client()
    member.force_login(user)
    assert member.get("/admin/ragsite/auditevent/").status_code == 302  # to the admin's login


def test_staff_opening_a_restricted_document_in_the_admin_is_recorded(since, site):
    _, _, document, secret, _ = site
    operator = get_user_model().objects.create_superuser("ops", password="pw-ops-123")
    client = Client(HTTP_USER_AGENT=BROWSER)
    client.force_login(operator)

    assert client.get(f"/admin/search/document/{document.pk}/change/").status_code == 200  # open to all: not logged
    assert client.get(f"/admin/search/document/{secret.pk}/change/").status_code == 200

    opened = AuditEvent.objects.filter(id__gte=since, action=Action.DOCUMENT_OPEN)
    assert [(event.actor, event.target, event.detail["via"], event.detail["readers"]) for event in opened] == [
        (f"user:{operator.pk}", f"document:{secret.pk}", "admin", list(secret.readers))
    ]
