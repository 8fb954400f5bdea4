"""Who may call what: API keys (missing, bad, expired, revoked, out of scope), members' sessions,
one workspace per caller (another workspace's ids are not found), the error shape of every
refusal, and the DRF throttle."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from billing import client_keys
from frontdoors.api import views
from search.models import Answer, Document, Membership
from search.services import document_create

pytestmark = pytest.mark.django_db


def error_of(response) -> dict:
    body = json.loads(response.content)
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]), body
    return body["error"]


@pytest.fixture
def their_objects(other, theirs):
    document, _ = document_create(collection=theirs, source_name="secret.txt", content=b"Theirs only.", enqueue=False)
    Document.objects.filter(pk=document.pk).update(status=Document.Status.FAILED, error="broken")
    answer = Answer.objects.create(workspace=other, question="What is theirs?", status=Answer.Status.DONE)
    return {"collection": theirs, "document": document, "answer": answer}


# --------------------------------------------------------------------------- keys


def test_a_request_without_a_key_is_401_with_www_authenticate(client_for, acme):
    response = client_for().get("/api/v1/collections")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="api"'
    assert error_of(response)["code"] == "missing_api_key"


@pytest.mark.parametrize(
    ("case", "code"),
    [("malformed", "invalid_api_key"), ("wrong", "invalid_api_key"), ("expired", "expired_api_key"),
     ("revoked", "revoked_api_key")],
)  # fmt: skip
def test_bad_expired_and_revoked_keys_are_401(case, code, acme, make_key, client_for):
    token = make_key("admin")
    if case == "malformed":
        token = "rk_nope"
    elif case == "wrong":
        token = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    elif case == "expired":
        token = make_key("admin", expires_at=timezone.now() - timedelta(seconds=1))
    else:
        key = client_keys.client_key_authenticate(token)
        client_keys.client_key_revoke(key)
    for method, path in [("get", "/api/v1/collections"), ("post", "/api/v1/answers"), ("get", "/api/v1/usage")]:
        response = getattr(client_for(token), method)(path, {"question": "x"} if method == "post" else None)
        assert response.status_code == 401, (path, response.content)
        assert response["WWW-Authenticate"] == 'Bearer realm="api"'
        assert error_of(response)["code"] == code


@pytest.mark.parametrize(
    ("scope", "method", "path", "body"),
    [
        ("documents", "get", "/api/v1/collections", None),
        ("search", "post", "/api/v1/collections", {"name": "New"}),
        ("search", "get", "/api/v1/documents", None),
        ("documents", "get", "/api/v1/search", {"query": "lift"}),
        ("search", "post", "/api/v1/answers", {"question": "How does lift change?"}),
        ("documents", "get", "/api/v1/answers/00000000-0000-0000-0000-000000000000", None),
    ],
)
def test_a_key_without_the_scope_is_403(scope, method, path, body, make_key, client_for, handbook):
    response = getattr(client_for(make_key(scope)), method)(path, body, format="json" if method == "post" else None)
    assert response.status_code == 403
    error = error_of(response)
    assert error["code"] == "insufficient_scope"
    assert "does not have the" in error["message"]


def test_each_scope_opens_its_endpoints_and_admin_opens_all(make_key, client_for, handbook):
    search = client_for(make_key("search"))
    assert search.get("/api/v1/collections").status_code == 200
    assert search.get("/api/v1/search", {"query": "lift"}).status_code == 200
    assert client_for(make_key("documents")).get("/api/v1/documents").status_code == 200
    assert (
        client_for(make_key("documents")).post("/api/v1/collections", {"name": "Docs"}, format="json").status_code
        == 201
    )
    generate = client_for(make_key("generate"))
    assert generate.post("/api/v1/answers", {"question": "Lift?"}, format="json").status_code == 202
    assert client_for(make_key()).get("/api/v1/usage").status_code == 200  # any valid key, even without scopes
    admin = client_for(make_key("admin"))
    for path in ("/api/v1/collections", "/api/v1/documents", "/api/v1/usage"):
        assert admin.get(path).status_code == 200


# --------------------------------------------------------------------------- one workspace


def test_another_workspaces_objects_are_not_found_and_not_changed(admin_client, their_objects):
    collection, document, answer = their_objects["collection"], their_objects["document"], their_objects["answer"]
    for method, path in [
        ("get", f"/api/v1/collections/{collection.pk}"),
        ("get", f"/api/v1/documents/{document.pk}"),
        ("delete", f"/api/v1/documents/{document.pk}"),
        ("post", f"/api/v1/documents/{document.pk}/retry"),
        ("get", f"/api/v1/answers/{answer.pk}"),
        ("get", f"/api/v1/answers/{answer.pk}/stream"),
    ]:
        response = getattr(admin_client, method)(path)
        assert response.status_code == 404, (method, path)
        assert error_of(response)["code"] == "not_found"
    assert Document.objects.get(pk=document.pk).status == Document.Status.FAILED  # neither deleted nor retried
    # Listings hold none of theirs; naming their collection in a request is refused like an unknown id.
    assert admin_client.get("/api/v1/collections").json()["results"] == []
    assert admin_client.get("/api/v1/documents").json()["results"] == []
    for method, path, body in [
        ("get", "/api/v1/documents", {"collection": collection.pk}),
        ("post", "/api/v1/search", {"query": "theirs", "collections": [collection.pk]}),
        ("post", "/api/v1/answers", {"question": "theirs?", "collections": [collection.pk]}),
    ]:
        response = getattr(admin_client, method)(path, body, format="json" if method == "post" else None)
        assert response.status_code == 400, path
        error = error_of(response)
        assert error["field"] in ("collection", "collections") and str(collection.pk) in error["message"]
    # A key's workspace is its own: naming another is not found.
    response = admin_client.get("/api/v1/collections", {"workspace": "other"})
    assert response.status_code == 404 and error_of(response)["code"] == "workspace_not_found"


# --------------------------------------------------------------------------- sessions


@pytest.fixture
def member(acme):
    user = get_user_model().objects.create_user("ann", password="pw-for-tests")
    Membership.objects.create(workspace=acme, user=user)
    return user


def test_a_member_uses_the_api_with_a_session_in_their_workspace(member, handbook, other):
    client = APIClient()
    client.force_login(member)
    listed = client.get("/api/v1/collections")
    assert listed.status_code == 200
    assert [item["name"] for item in listed.json()["results"]] == ["Handbook"]
    assert client.post("/api/v1/answers", {"question": "Lift?"}, format="json").status_code == 202
    usage = client.get("/api/v1/usage").json()
    assert usage["client_key"] is None and usage["requests"] == 0
    # Not a member of "other": not found, by parameter or header.
    assert client.get("/api/v1/collections", {"workspace": "other"}).status_code == 404
    assert client.get("/api/v1/collections", HTTP_X_WORKSPACE="other").status_code == 404
    # A member of two names one.
    Membership.objects.create(workspace=other, user=member)
    response = client.get("/api/v1/collections")
    assert response.status_code == 400 and error_of(response)["field"] == "workspace"
    assert client.get("/api/v1/collections", HTTP_X_WORKSPACE="other").json()["results"] == []
    assert client.get("/api/v1/collections", {"workspace": "acme"}).json()["count"] == 1
    assert client.get("/api/v1/collections", {"workspace": "not a slug"}).status_code == 400


def test_a_session_needs_membership_and_the_csrf_token(member, acme):
    outsider = get_user_model().objects.create_user("bob")
    client = APIClient()
    client.force_login(outsider)
    response = client.get("/api/v1/collections")
    assert response.status_code == 403 and error_of(response)["code"] == "no_workspace"

    strict = APIClient(enforce_csrf_checks=True)
    strict.force_login(member)
    assert strict.get("/api/v1/collections").status_code == 200
    refused = strict.post("/api/v1/collections", {"name": "New"}, format="json")
    assert refused.status_code == 403 and "CSRF" in error_of(refused)["message"]


def test_a_superuser_reads_the_same_workspaces_in_the_api_as_in_the_ui(acme, other, handbook):
    """One rule (``search.scoping.workspaces_visible_to``): a superuser with no membership has
    every workspace, in the browser UI and through the API with their session alike."""
    root = get_user_model().objects.create_superuser("root", "root@example.com", "pw-for-tests")
    client = APIClient()
    client.force_login(root)
    page = client.get("/")
    assert page.status_code == 200
    ui = {workspace.slug for workspace in page.context["request"].workspaces}
    assert ui == {"acme", "other"}
    api = {slug for slug in ui if client.get("/api/v1/collections", {"workspace": slug}).status_code == 200}
    assert api == ui
    assert [item["name"] for item in client.get("/api/v1/collections", {"workspace": "acme"}).json()["results"]] == [
        "Handbook"
    ]
    # Several workspaces, none named: the API asks which, as it does a member of several.
    response = client.get("/api/v1/collections")
    assert response.status_code == 400 and error_of(response)["code"] == "workspace_required"
    assert client.get("/api/v1/collections", {"workspace": "nowhere"}).status_code == 404


def test_a_bad_key_is_refused_even_with_a_session(member, acme):
    client = APIClient()
    client.force_login(member)
    client.credentials(HTTP_AUTHORIZATION="Bearer rk_nope")
    assert client.get("/api/v1/collections").status_code == 401


# --------------------------------------------------------------------------- errors and throttling


def test_unknown_paths_and_methods_answer_in_the_error_shape(admin_client):
    for path in ("/api/v1/nothing-here", "/api/v1/answers/not-a-uuid", "/api/v1/collections/"):
        response = admin_client.get(path)
        assert response.status_code == 404 and error_of(response)["code"] == "not_found", path
    response = admin_client.get(f"/api/v1/documents/{10**30}")  # beyond bigint: simply not found
    assert response.status_code == 404 and error_of(response)["code"] == "not_found"
    response = admin_client.put("/api/v1/collections", {}, format="json")
    assert response.status_code == 405 and error_of(response)["code"] == "method_not_allowed"
    assert "PUT" not in response["Allow"] and "POST" in response["Allow"]
    assert admin_client.options("/api/v1/collections").status_code == 405
    response = admin_client.post("/api/v1/collections", "{not json", content_type="application/json")
    assert response.status_code == 400 and error_of(response)["code"] == "parse_error"
    response = admin_client.post("/api/v1/collections", "name=x", content_type="application/x-www-form-urlencoded")
    assert response.status_code == 415 and error_of(response)["code"] == "unsupported_media_type"


def test_an_unexpected_failure_is_a_logged_500_in_the_error_shape(admin_client, handbook, monkeypatch, caplog):
    def broken(**kwargs):
        raise RuntimeError("the index is on fire")

    monkeypatch.setattr(views, "chunk_search", broken)
    response = admin_client.get("/api/v1/search", {"query": "lift"})
    assert response.status_code == 500
    assert error_of(response) == {
        "code": "server_error",
        "message": "The server failed to handle this request; the failure is logged.",
    }
    assert "the index is on fire" in caplog.text  # the traceback is logged, not shown


def test_the_drf_throttle_limits_each_key_but_not_answer_creation(make_key, client_for, settings, handbook):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"api": "2/minute"}}
    token = make_key("admin")
    client = client_for(token)
    assert [client.get("/api/v1/collections").status_code for _ in range(2)] == [200, 200]
    throttled = client.get("/api/v1/documents")
    assert throttled.status_code == 429
    assert error_of(throttled)["code"] == "rate_limited"
    assert 1 <= int(throttled["Retry-After"]) <= 60
    # Another key has its own budget of requests; creating answers is metered by billing.limits instead.
    assert client_for(make_key("search")).get("/api/v1/collections").status_code == 200
    for _ in range(3):
        assert client.post("/api/v1/answers", {"question": "Lift?"}, format="json").status_code == 202
