"""Search through the API: hybrid, dense and keyword modes over the workspace's collections,
results with highlighted snippets and links to their documents, by GET or POST."""

from __future__ import annotations

import pytest

from search.models import Document
from search.services import collection_create
from tests.frontdoors.api.conftest import DOCUMENTS
from tests.search.files import ingest_texts as ingest

pytestmark = pytest.mark.django_db


@pytest.fixture
def corpus(acme, handbook, theirs):
    manuals = collection_create(workspace=acme, name="Manuals")
    ingest(handbook, DOCUMENTS)
    ingest(manuals, {"pump.md": "# Pump\n\nThe pump must be primed before charging the line with water."})
    ingest(theirs, {"secret.md": "# Secret\n\nCharging takes 90 minutes in the other workspace too."})
    return handbook, manuals


@pytest.mark.parametrize("mode", ["hybrid", "dense", "keyword"])
def test_a_search_returns_ranked_highlighted_passages_with_links(client_for, make_key, corpus, mode):
    handbook, _ = corpus
    client = client_for(make_key("search"))
    response = client.post("/api/v1/search", {"query": "How long does charging take?", "mode": mode}, format="json")
    assert response.status_code == 200
    body = response.json()
    assert (body["query"], body["mode"]) == ("How long does charging take?", mode)
    results = body["results"]
    robot = Document.objects.get(source_name="robot.md")
    top = results[0]
    assert (top["rank"], top["document_id"], top["document_title"]) == (1, robot.pk, "Atlas-7 robot")
    assert top["collection_id"] == handbook.pk and "Charging takes 90 minutes." in top["text"]
    assert top["document_url"] == f"http://testserver/api/v1/documents/{robot.pk}"
    assert client_for(make_key("documents")).get(top["document_url"]).json()["id"] == robot.pk
    if mode != "dense":
        assert "<mark>Charging</mark>" in top["snippet_html"] and top["keyword_rank"] == 1
    assert [hit["rank"] for hit in results] == list(range(1, len(results) + 1))
    assert [hit["score"] for hit in results] == sorted((hit["score"] for hit in results), reverse=True)
    assert "Secret" not in {hit["document_title"] for hit in results}  # never another workspace's


def test_a_search_by_get_with_collections_and_top_k(admin_client, corpus):
    handbook, manuals = corpus
    both = admin_client.get("/api/v1/search", {"query": "charging", "mode": "keyword"}).json()["results"]
    assert {hit["collection_id"] for hit in both} == {handbook.pk, manuals.pk}
    only = admin_client.get(
        "/api/v1/search", {"query": "charging", "mode": "keyword", "collections": [manuals.pk], "top_k": 1}
    ).json()["results"]
    assert [(hit["collection_id"], hit["document_title"]) for hit in only] == [(manuals.pk, "Pump")]
    per_document = admin_client.get("/api/v1/search", {"query": "wing lift", "per_document": "true"}).json()
    assert len({hit["document_id"] for hit in per_document["results"]}) == len(per_document["results"])


def test_typed_syntax_filters_and_a_question_does_not(admin_client, corpus):
    handbook, _ = corpus
    wing = Document.objects.get(source_name="wing.md")
    robot = Document.objects.get(source_name="robot.md")

    def search(query, **params):
        params = {"query": query, "mode": "keyword", "collections": [handbook.pk], **params}
        body = admin_client.post("/api/v1/search", params, "json").json()
        return body["syntax"], [hit["document_id"] for hit in body["results"]]

    # A search box: the quoted phrase must appear; the plain word only ranks.
    assert search('"propeller slipstream" charging') == ("search", [wing.pk])
    assert search("charging lift -propeller") == ("search", [robot.pk])
    # Read as a sentence (a question mark, or 8 words and more): quotes quote, every word ranks.
    syntax, found = search('Does "propeller slipstream" matter for charging?')
    assert syntax == "question" and set(found) == {wing.pk, robot.pk}
    assert search('how long is "propeller slipstream" charging', syntax="question")[0] == "question"
    # Asked for explicitly, typed syntax holds even for a sentence.
    assert search('Does "propeller slipstream" matter for charging?', syntax="search") == ("search", [wing.pk])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"query": "  "}, "query"),
        ({}, "query"),
        ({"query": "lift", "mode": "fuzzy"}, "mode"),
        ({"query": "lift", "top_k": 0}, "top_k"),
        ({"query": "lift", "top_k": 51}, "top_k"),
        ({"query": "lift", "collections": [10**12]}, "collections"),
        ({"query": "lift", "collections": ["one"]}, "collections"),
        ({"query": "x" * 1001}, "query"),
        ({"query": "lift", "top_k": ""}, "top_k"),
        ({"query": "lift", "syntax": "regex"}, "syntax"),
    ],
)
def test_a_bad_search_is_refused_naming_the_field(admin_client, handbook, params, field):
    for response in (admin_client.get("/api/v1/search", params), admin_client.post("/api/v1/search", params, "json")):
        assert response.status_code == 400, response.content
        error = response.json()["error"]
        assert (error["code"], error["field"]) == ("invalid_request", field)
