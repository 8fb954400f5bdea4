"""Tenant isolation: every URL of the site, called by tenant A with tenant B's ids, shows nothing
of B's, nor of A's own document that A's member and key may not read (search.access).

``ROUTES`` says, for every URL pattern of the project (the resolver's full list: the UI, the
REST API, the OpenAI-compatible API, health, the admin and its billing dashboards), how to call
it as A and what must come back: A's client key for the APIs, the session of A's member for the
UI, the same (non-staff) member for the admin. Object ids in the pattern are B's. A pattern
the table does not know fails ``test_every_url_pattern_is_classified``, so a new URL cannot be
added without saying how it keeps tenants apart.

What must come back: 404 for another workspace's ids in the APIs and the UI (as for ids that
never existed: a 403 would confirm them), 302 to the admin's login for a non-staff user, and
lists, search results, answers and usage that hold only A's objects. Every response of every
call is also checked for B's words (its texts, collection, question and member), after
removing what the request itself sent.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from django.contrib.auth.models import Group
from django.contrib.contenttypes.models import ContentType
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import translation
from rest_framework.test import APIClient

from ragsite.models import UserPreference
from search.models import Answer, Chunk, Collection, Document
from tests.frontdoors.api.test_usage import record
from tests.security.conftest import RESTRICTED_GROUP, SECRET_COLLECTION, SECRET_DOCUMENTS, SECRET_SENTENCE, Tenant

pytestmark = pytest.mark.django_db

# What would show B: words of its texts, its collection, its answer's question, its member; and
# A's restricted document, which A's member and key may not read either ("wombat").
B_MARKERS = ("zanzibar", "quokka", "marmalade", "saffron", "juniper", "pomegranate", "beta-member", "wombat")
B_MODEL = "openai:beta-private-embedder"  # given to B's collection by the OpenAI tests below


def url_patterns(patterns=None, prefix: str = "") -> list[tuple[str, URLPattern]]:
    """Every URL pattern of the project, as its full route (prefixes joined), depth first."""
    found = []
    for pattern in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(pattern, URLResolver):
            found += url_patterns(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            found.append((prefix + str(pattern.pattern), pattern))
    return found


@dataclass
class Caller:
    """Tenant A's callers, and what B has, for one test."""

    a: Tenant
    b: Tenant
    key: APIClient  # A's client key, every scope
    member: Client  # A's member (not staff), logged in
    calls: int = 0

    def call(self, client, method: str, path: str, data=None, *, sent: str = "", **kwargs):
        """The response, after checking that it shows nothing of B's (``sent``: text of the
        request that the response may echo, such as a query or a name, taken out first)."""
        response = getattr(client, method.lower())(path, data, **kwargs)
        self.calls += 1
        content = b"".join(response.streaming_content) if response.streaming else response.content
        text = content.decode(errors="replace")
        # What was sent, and a truncated echo of it (up to the next tag or quote), as written or
        # in a URL (the language switcher's "next" is the page's own address, query included).
        for echo in (sent, urllib.parse.quote_plus(sent)) if sent else ():
            text = re.sub(re.escape(echo[:20]) + r"[^<\"]*", "", text)
        shown = [marker for marker in B_MARKERS if marker in text.lower()]
        assert not shown, f"{method} {path} ({response.status_code}) shows B's {shown}: {text[:2000]}"
        response.text = text
        return response

    def b_ids(self) -> dict[str, str]:
        """B's value of each path parameter of the project's patterns."""
        return {
            "collection_id": str(self.b.collection.pk),
            "document_id": str(self.b.failed_document.pk),
            "answer_id": str(self.b.answer.pk),
            "conversation_id": str(self.b.answer.conversation_id),
            "chunk_id": str(self.b.chunk.pk),
            "model_id": B_MODEL,
            "id": str(self.b.user.pk),  # admin: a user's password form
            "content_type_id": str(ContentType.objects.get_for_model(Document).pk),
        }


@pytest.fixture
def caller(tenant_pair, db) -> Caller:
    a, b = tenant_pair
    key = APIClient()
    key.credentials(HTTP_AUTHORIZATION=f"Bearer {a.token}")
    member = Client()
    member.force_login(a.user)
    return Caller(a=a, b=b, key=key, member=member)


def fill(route: str, values: dict[str, str]) -> str:
    """``route`` with its ``<converter:name>`` parameters replaced by ``values``."""
    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", lambda match: values[match.group(1)], route)


def b_documents_unchanged(c: Caller) -> None:
    documents = Document.objects.filter(collection=c.b.collection)
    assert documents.count() == len(c.b.documents) + 1
    assert documents.get(pk=c.b.failed_document.pk).status == Document.Status.FAILED


def a_chunk_ids(c: Caller) -> set[int]:
    return set(c.a.collection.chunks.values_list("pk", flat=True))


# --------------------------------------------------------------------------- probes
# A probe calls one pattern as A, with B's ids, and checks what came back.

Probe = Callable[[Caller, str], None]


def api_not_found(*methods: str) -> Probe:
    """REST API with A's key: B's object is not found, exactly as a missing one."""

    def probe(c: Caller, route: str) -> None:
        for method in methods:
            response = c.call(c.key, method, fill(route, c.b_ids()))
            assert response.status_code == 404, (method, route, response.text)
            assert response.json()["error"]["code"] == "not_found"
        b_documents_unchanged(c)

    return probe


def ui_not_found(*methods: str) -> Probe:
    """Browser UI as A's member: B's object is a 404."""

    def probe(c: Caller, route: str) -> None:
        for method in methods:
            response = c.call(c.member, method, fill(route, c.b_ids()))
            assert response.status_code == 404, (method, route, response.status_code)
        b_documents_unchanged(c)

    return probe


def admin_refused(c: Caller, route: str) -> None:
    """Admin as A's member (not staff): sent to the admin's login, whatever the object."""
    values = {**c.b_ids(), "object_id": str(c.b.failed_document.pk)}
    path = fill(route, values)
    for method in ("GET", "POST"):
        response = c.call(c.member, method, path)
        assert response.status_code == 302, (method, path, response.status_code)
        # The admin's logout sends a non-staff user to the admin's index, which sends to the login.
        login = "/admin/" if route == "admin/logout/" else "/admin/login/?next="
        assert response["Location"].startswith(login), (method, path, response["Location"])
    b_documents_unchanged(c)


def admin_regex_refused(path: str) -> Probe:
    def probe(c: Caller, route: str) -> None:
        admin_refused(c, path.format(document=c.b.failed_document.pk).lstrip("/"))

    return probe


def public(method: str, path: str, *statuses: int) -> Probe:
    """A page without objects (health, login, schema, docs): answers, showing nothing of B's."""

    def probe(c: Caller, route: str) -> None:
        response = c.call(c.member, method, path)
        assert response.status_code in statuses, (path, response.status_code)

    return probe


def metrics_operators_only(c: Caller, route: str) -> None:
    """The operators' scrape endpoint sums every tenant: in production no tenant reads it, not
    with a session, nor with a client key in place of the metrics token."""
    from django.test import override_settings

    with override_settings(PRODUCTION=True, METRICS_TOKEN=""):
        assert c.call(c.member, "GET", "/metrics").status_code == 404
    with override_settings(PRODUCTION=True, METRICS_TOKEN="operators-only-token"):
        assert c.call(c.member, "GET", "/metrics").status_code == 401
        assert c.call(c.key, "GET", "/metrics").status_code == 401


def api_collections(c: Caller, route: str) -> None:
    listed = c.call(c.key, "GET", "/api/v1/collections").json()
    assert [item["id"] for item in listed["results"]] == [c.a.collection.pk] and listed["count"] == 1
    # B's collection name is free in A: no 409 that would tell B has it.
    created = c.call(c.key, "POST", "/api/v1/collections", {"name": SECRET_COLLECTION}, format="json", sent="Zanzibar")
    assert created.status_code == 201, created.text
    assert Collection.objects.get(pk=created.json()["id"]).workspace == c.a.workspace


def api_documents(c: Caller, route: str) -> None:
    listed = c.call(c.key, "GET", "/api/v1/documents", {"limit": 200}).json()
    a_documents = {document.pk for document in c.a.documents} | {c.a.failed_document.pk}
    assert {item["id"] for item in listed["results"]} == a_documents and listed["count"] == len(a_documents)
    # Filtering by B's collection: refused as for a collection that never existed.
    for collection_id in (c.b.collection.pk, 10**12):
        refused = c.call(c.key, "GET", "/api/v1/documents", {"collection": collection_id})
        assert refused.status_code == 400
        assert refused.json()["error"] == {
            "code": "invalid_request",
            "message": f"No collection {collection_id} in this workspace.",
            "field": "collection",
        }
    upload = {"collection": c.b.collection.pk, "files": [SimpleUploadedFile("x.txt", b"Into B?")]}
    refused = c.call(c.key, "POST", "/api/v1/documents", upload, format="multipart")
    assert (refused.status_code, refused.json()["error"]["field"]) == (400, "collection")
    # B's very bytes uploaded into A's collection are a new document of A's, not B's.
    name, text = next(iter(SECRET_DOCUMENTS.items()))
    upload = {"collection": c.a.collection.pk, "files": [SimpleUploadedFile(name, text.encode())]}
    stored = c.call(c.key, "POST", "/api/v1/documents", upload, format="multipart", sent=name)
    [document] = stored.json()["documents"]
    assert (stored.status_code, document["created"], document["collection"]) == (201, True, c.a.collection.pk)
    b_documents_unchanged(c)


def api_search(c: Caller, route: str) -> None:
    for mode in ("hybrid", "keyword", "dense"):
        query = {"query": SECRET_SENTENCE, "mode": mode, "top_k": 50}
        for response in (
            c.call(c.key, "GET", "/api/v1/search", query, sent=SECRET_SENTENCE),
            c.call(c.key, "POST", "/api/v1/search", query, format="json", sent=SECRET_SENTENCE),
        ):
            assert response.status_code == 200, response.text
            found = {hit["chunk_id"] for hit in response.json()["results"]}
            assert found <= a_chunk_ids(c), mode
            assert found or mode == "keyword", mode  # A's nearest chunks; no word of B's is in A's
    named = {"query": SECRET_SENTENCE, "collections": [c.b.collection.pk]}
    refused = c.call(c.key, "POST", "/api/v1/search", named, format="json", sent=SECRET_SENTENCE)
    assert (refused.status_code, refused.json()["error"]["field"]) == (400, "collections")


def api_answers(c: Caller, route: str) -> None:
    asked = {"question": SECRET_SENTENCE, "top_k": 50}
    response = c.call(c.key, "POST", "/api/v1/answers?wait=5", asked, format="json", sent=SECRET_SENTENCE)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["collections"] == [c.a.collection.pk]
    assert {source["chunk_id"] for source in answer["sources"]} <= a_chunk_ids(c)
    assert Answer.objects.get(pk=answer["id"]).workspace == c.a.workspace
    named = {"question": SECRET_SENTENCE, "collections": [c.b.collection.pk]}
    refused = c.call(c.key, "POST", "/api/v1/answers", named, format="json", sent=SECRET_SENTENCE)
    assert (refused.status_code, refused.json()["error"]["field"]) == (400, "collections")


def api_conversations(c: Caller, route: str) -> None:
    listed = c.call(c.key, "GET", "/api/v1/conversations").json()
    assert [item["id"] for item in listed["results"]] == [str(c.a.answer.conversation_id)], listed
    created = c.call(c.key, "POST", "/api/v1/conversations", {}, format="json")
    assert created.status_code == 201, created.text
    # A question may not continue B's conversation: refused as one that never existed.
    for conversation in (c.b.answer.conversation_id, "00000000-0000-0000-0000-000000000000"):
        asked = {"question": SECRET_SENTENCE, "conversation": str(conversation)}
        refused = c.call(c.key, "POST", "/api/v1/answers", asked, format="json", sent=SECRET_SENTENCE)
        assert refused.json()["error"] == {
            "code": "invalid_request",
            "message": f"No conversation {conversation} of yours in this workspace.",
            "field": "conversation",
        }, refused.text
    assert c.b.answer.conversation.answers.count() == 1


def api_usage(c: Caller, route: str) -> None:
    record(c.a.key, tokens=(10, 5))
    record(c.b.key, tokens=(1000, 500))
    record(c.b.key, tokens=(1000, 500))
    usage = c.call(c.key, "GET", "/api/v1/usage").json()
    assert (usage["requests"], usage["total_tokens"], usage["client_key"]["id"]) == (1, 15, c.a.key.pk)


def api_unknown(c: Caller, route: str) -> None:
    response = c.call(c.key, "GET", f"/api/v1/collections/{c.b.collection.pk}/documents")
    assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")


def b_model(c: Caller) -> None:
    """B's collection gets an embedding model of its own (in this test's transaction)."""
    Collection.objects.filter(pk=c.b.collection.pk).update(embedding_model=B_MODEL)


def openai_models(c: Caller, route: str) -> None:
    b_model(c)
    models = c.call(c.key, "GET", "/v1/models").json()
    assert B_MODEL not in {model["id"] for model in models["data"]}, models


def openai_model(c: Caller, route: str) -> None:
    b_model(c)
    response = c.call(c.key, "GET", fill(route, c.b_ids()), sent=B_MODEL)
    assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")


def openai_chat(c: Caller, route: str) -> None:
    body = {"model": "extractive", "messages": [{"role": "user", "content": SECRET_SENTENCE}]}
    # The response echoes the question as what was retrieved for (retrieval_query): A's own words.
    response = c.call(c.key, "POST", "/v1/chat/completions", body, format="json", sent=SECRET_SENTENCE)
    assert response.status_code == 200, response.text
    completion = response.json()
    a_documents = {document.pk for document in c.a.documents}
    assert completion["citations"] and {citation["document_id"] for citation in completion["citations"]} <= a_documents
    answer = Answer.objects.get(pk=completion["id"].removeprefix("chatcmpl-"))
    assert answer.workspace == c.a.workspace
    assert {source["chunk_id"] for source in answer.sources} <= a_chunk_ids(c)


def openai_embeddings(c: Caller, route: str) -> None:
    b_model(c)
    body = {"model": B_MODEL, "input": "lift"}
    response = c.call(c.key, "POST", "/v1/embeddings", body, format="json", sent=B_MODEL)
    assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")


def openai_unknown(c: Caller, route: str) -> None:
    response = c.call(c.key, "GET", f"/v1/collections/{c.b.collection.pk}")
    assert (response.status_code, response.json()["error"]["code"]) == (404, "unknown_url")


def ui_search(c: Caller, route: str) -> None:
    page = c.call(c.member, "GET", "/", {"q": SECRET_SENTENCE}, sent=SECRET_SENTENCE)
    assert page.status_code == 200
    shown = {int(pk) for pk in re.findall(r'href="/passages/(\d+)/"', page.text)}
    assert shown and shown <= a_chunk_ids(c)  # A's passages, nearest in meaning; none of B's
    chosen = c.call(c.member, "GET", "/", {"q": SECRET_SENTENCE, "collection": c.b.collection.pk}, sent=SECRET_SENTENCE)
    assert chosen.status_code == 200 and "Select a valid choice" in chosen.text


def ui_ask(c: Caller, route: str) -> None:
    answers = Answer.objects.filter(workspace=c.a.workspace)
    before = answers.count()
    response = c.call(c.member, "POST", "/ask/", {"q": SECRET_SENTENCE}, sent=SECRET_SENTENCE)
    assert response.status_code == 302
    answer = answers.order_by("-created_at").first()
    assert answers.count() == before + 1 and response["Location"] == f"/answers/{answer.pk}/"
    assert {source["chunk_id"] for source in answer.sources} <= a_chunk_ids(c)
    page = c.call(c.member, "GET", response["Location"], sent=SECRET_SENTENCE)
    assert page.status_code == 200
    refused = c.call(c.member, "POST", "/ask/", {"q": SECRET_SENTENCE, "collection": c.b.collection.pk})
    assert refused.status_code == 302 and answers.count() == before + 1
    fixtures = (c.b.answer.pk, c.b.member_answer.pk)
    assert not Answer.objects.filter(collections=c.b.collection).exclude(pk__in=fixtures).exists()


def ui_list(path: str, shown: Callable[[Tenant], str]) -> Probe:
    """A list of the current workspace (questions, documents): A's ``shown``, nothing of B's."""

    def probe(c: Caller, route: str) -> None:
        response = c.call(c.member, "GET", path)
        assert response.status_code == 200
        assert shown(c.a) in response.text

    return probe


def ui_upload(c: Caller, route: str) -> None:
    data = {"collection": c.b.collection.pk, "files": [SimpleUploadedFile("x.txt", b"Into B?")]}
    response = c.call(c.member, "POST", "/documents/upload/", data, HTTP_HX_REQUEST="true")
    assert response.status_code == 422 and "Select a valid choice" in response.text
    b_documents_unchanged(c)


def ui_workspace(c: Caller, route: str) -> None:
    response = c.call(c.member, "POST", "/workspace/", {"workspace": c.b.workspace.slug})
    assert response.status_code == 404
    assert c.call(c.member, "GET", "/documents/").status_code == 200


def ui_language(c: Caller, route: str) -> None:
    """The language switcher saves the caller's own choice only, and sends them back to the site."""
    response = c.call(c.member, "POST", "/language/", {"language": "ja", "next": "https://evil.example/"})
    assert (response.status_code, response["Location"]) == (302, "/")
    assert UserPreference.objects.get(user=c.a.user).language == "ja"
    assert not UserPreference.objects.filter(user=c.b.user).exists()
    assert c.call(c.member, "GET", "/documents/").status_code == 200
    translation.deactivate()  # the page activated Japanese in this thread: not for the tests after


def logout(c: Caller, route: str) -> None:
    other = Client()
    other.force_login(c.a.user)
    response = c.call(other, "POST", "/accounts/logout/")
    assert (response.status_code, response["Location"]) == (302, "/accounts/login/")


def session_api_workspace(c: Caller, route: str) -> None:
    """(Not a pattern.) Naming B's workspace: 404 for A's member's session and for A's key."""
    for client in (c.member, c.key):
        response = c.call(client, "GET", "/api/v1/collections", {"workspace": c.b.workspace.slug})
        assert (response.status_code, response.json()["error"]["code"]) == (404, "workspace_not_found")


# --------------------------------------------------------------------------- the table

ROUTES: dict[str, Probe] = {
    # Browser UI: session of A's member.
    "": ui_search,
    "ask/": ui_ask,
    "answers/": ui_list("/answers/", lambda tenant: tenant.member_answer.question),
    "conversations/<uuid:conversation_id>/rename/": ui_not_found("POST"),
    "conversations/<uuid:conversation_id>/delete/": ui_not_found("POST"),
    "answers/<uuid:answer_id>/": ui_not_found("GET"),
    "answers/<uuid:answer_id>/events/": ui_not_found("GET"),
    "passages/<int:chunk_id>/": ui_not_found("GET"),
    "documents/": ui_list("/documents/", lambda tenant: tenant.documents[0].title),
    "documents/list/": ui_list("/documents/list/", lambda tenant: tenant.documents[0].title),
    "documents/upload/": ui_upload,
    "documents/<int:document_id>/file/": ui_not_found("GET"),
    "documents/<int:document_id>/retry/": ui_not_found("POST"),
    "documents/<int:document_id>/readers/": ui_not_found("GET", "POST"),
    "documents/<int:document_id>/delete/": ui_not_found("POST"),
    "workspace/": ui_workspace,
    "language/": ui_language,
    "accounts/login/": public("GET", "/accounts/login/", 200),
    "accounts/logout/": logout,
    # Single sign-on is not set up here (tests/security/test_single_sign_on.py sets it up).
    "accounts/oidc/start/": public("GET", "/accounts/oidc/start/", 404),
    "accounts/oidc/callback/": public("GET", "/accounts/oidc/callback/", 404),
    # Health and the like: no objects.
    "healthz": public("GET", "/healthz", 200),
    "readyz": public("GET", "/readyz", 200, 503),
    "favicon.ico": public("GET", "/favicon.ico", 301),
    "metrics": metrics_operators_only,
    # REST API v1: A's client key.
    "api/v1/collections": api_collections,
    "api/v1/collections/<int:collection_id>": api_not_found("GET"),
    "api/v1/documents": api_documents,
    "api/v1/documents/<int:document_id>": api_not_found("GET", "DELETE"),
    "api/v1/documents/<int:document_id>/retry": api_not_found("POST"),
    "api/v1/documents/<int:document_id>/readers": api_not_found("POST"),
    "api/v1/documents/<int:document_id>/file": api_not_found("GET"),
    "api/v1/search": api_search,
    "api/v1/answers": api_answers,
    "api/v1/answers/<uuid:answer_id>": api_not_found("GET"),
    "api/v1/answers/<uuid:answer_id>/stream": api_not_found("GET"),
    "api/v1/conversations": api_conversations,
    "api/v1/conversations/<uuid:conversation_id>": api_not_found("GET", "PATCH", "DELETE"),
    "api/v1/usage": api_usage,
    "api/^v1/": api_unknown,
    "api/schema/": public("GET", "/api/schema/", 200),
    "api/docs/": public("GET", "/api/docs/", 200),
    # OpenAI-compatible API: A's client key.
    "v1/models": openai_models,
    "v1/models/<path:model_id>": openai_model,
    "v1/chat/completions": openai_chat,
    "v1/embeddings": openai_embeddings,
    "v1/^.*$": openai_unknown,
    # Admin and its billing dashboards: A's member, not staff.
    "admin/login/": public("GET", "/admin/login/", 302),  # to the site's sign-in page
    "admin/billing/dashboard/": admin_refused,
    "admin/billing/dashboard/cost.csv": admin_refused,
    "admin/billing/dashboard/charts/": admin_refused,
    "admin/billing/dashboard/compare/": admin_refused,
    "admin/": admin_refused,
    "admin/logout/": admin_refused,
    "admin/password_change/": admin_refused,
    "admin/password_change/done/": admin_refused,
    "admin/autocomplete/": admin_refused,
    "admin/jsi18n/": admin_refused,
    "admin/r/<path:content_type_id>/<path:object_id>/": admin_refused,
    "admin/auth/user/<id>/password/": admin_refused,
    "admin/^(?P<app_label>auth|ragsite|search|inference|billing)/$": admin_regex_refused("/admin/search/"),
    "admin/(?P<url>.*)$": admin_regex_refused("/admin/search/document/{document}/unknown/"),
}
# Every model the admin registers: its six pages, each refused (object ids: B's document's).
ADMIN_MODELS = (
    "auth/group", "auth/user", "search/workspace", "search/collection", "search/document", "inference/provider",
    "inference/upstreamkey", "inference/route", "inference/canaryrelease", "billing/clientkey", "billing/price",
    "billing/budgetalert", "billing/usagerecord", "ragsite/auditevent", "ragsite/identity", "ragsite/providedgroup",
)  # fmt: skip
for _model in ADMIN_MODELS:
    for _page in ("", "add/", "<path:object_id>/history/", "<path:object_id>/delete/", "<path:object_id>/change/",
                  "<path:object_id>/"):  # fmt: skip
        ROUTES[f"admin/{_model}/{_page}"] = admin_refused

PATTERNS = url_patterns()


def test_every_url_pattern_is_classified():
    routes = [route for route, _ in PATTERNS]
    assert len(routes) == len(set(routes))
    unknown = sorted(set(routes) - set(ROUTES))
    assert not unknown, f"URL patterns this test does not know how to call as another tenant: {unknown}"
    assert not sorted(set(ROUTES) - set(routes)), "patterns in ROUTES the project no longer has"


@pytest.mark.parametrize("route", [route for route, _ in PATTERNS])
def test_a_tenant_sees_nothing_of_another_tenants_through(route, caller):
    probe = ROUTES.get(route)
    assert probe is not None, f"unclassified URL pattern {route!r}: add it to ROUTES"
    probe(caller, route)
    assert caller.calls > 0


def test_naming_another_workspace_is_not_found(caller):
    session_api_workspace(caller, "")


def test_front_doors_read_tenant_rows_only_through_their_workspace_path():
    """The views of the REST API, the OpenAI-compatible API and the UI never query a tenant model
    directly: every tenant queryset comes from ``search.scoping.in_workspaces`` (``ApiView.scoped``),
    which filters by the model's declared ``workspace_path``, so no view can forget the filter."""
    from django.apps import apps

    from tests.conftest import PROJECT_ROOT

    tenant_models = sorted(model.__name__ for model in apps.get_models() if hasattr(model, "workspace_path"))
    assert tenant_models == ["Answer", "Chunk", "Collection", "Conversation", "Document"]
    models = "|".join(tenant_models)
    # A manager (``Answer.objects``), or a shortcut given the model itself, which queries its
    # default manager (``get_object_or_404(Answer, ...)``): both read rows of every tenant.
    direct = re.compile(
        rf"\b({models})\.(objects|_default_manager)\b(?!\.none\(\))"
        rf"|\ba?get_(object|list)_or_404\(\s*({models})\b"
    )
    doors = sorted((PROJECT_ROOT / "frontdoors").rglob("*.py"))  # every door, the operators' dashboards too
    found = [
        f"{path.relative_to(PROJECT_ROOT)}:{number}: {line.strip()}"
        for path in doors
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert found == []


# Every pattern that names a document or a passage, and how A's callers call it.
RESTRICTED_ROUTES = {
    "passages/<int:chunk_id>/": ("member", ["GET"]),
    "documents/<int:document_id>/file/": ("member", ["GET"]),
    "documents/<int:document_id>/retry/": ("member", ["POST"]),
    "documents/<int:document_id>/readers/": ("member", ["GET", "POST"]),
    "documents/<int:document_id>/delete/": ("member", ["POST"]),
    "api/v1/documents/<int:document_id>": ("key", ["GET", "DELETE"]),
    "api/v1/documents/<int:document_id>/retry": ("key", ["POST"]),
    "api/v1/documents/<int:document_id>/file": ("key", ["GET"]),
    "api/v1/documents/<int:document_id>/readers": ("key", ["POST"]),
}


def test_every_pattern_naming_a_document_or_passage_is_walked_with_a_restricted_one():
    naming = {route for route, _ in PATTERNS if "<int:document_id>" in route or "<int:chunk_id>" in route}
    assert naming == set(RESTRICTED_ROUTES)


@pytest.mark.parametrize("route", sorted(RESTRICTED_ROUTES))
def test_a_document_its_workspace_may_not_read_is_not_found_there(route, caller):
    """A's own restricted document, by its real ids: as missing as one that never existed."""
    restricted = caller.a.restricted
    ids = {"document_id": str(restricted.pk), "chunk_id": str(Chunk.objects.filter(document=restricted).first().pk)}
    who, methods = RESTRICTED_ROUTES[route]
    client = caller.key if who == "key" else caller.member
    for method in methods:
        response = caller.call(client, method, fill(route, ids))
        assert response.status_code == 404, (method, route, response.text[:500])
    restricted.refresh_from_db()
    assert restricted.readers == [f"g:{Group.objects.get(name=RESTRICTED_GROUP).pk}"]
    assert Document.objects.get(pk=restricted.pk).status == Document.Status.INDEXED
