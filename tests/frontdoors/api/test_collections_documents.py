"""Collections and documents through the API: create and list collections; upload several
files in one multipart request, see them processed (status, progress), filter and page
through them, delete and retry."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlsplit

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from search.ingest import pipeline
from search.models import Chunk, Collection, Document
from search.services import document_create
from tests.frontdoors.api.conftest import DOCUMENTS

pytestmark = pytest.mark.django_db


def upload(client, collection_id, files: dict[str, bytes], **fields):
    parts = [SimpleUploadedFile(name, content) for name, content in files.items()]
    return client.post("/api/v1/documents", {"collection": collection_id, "files": parts, **fields}, format="multipart")


# --------------------------------------------------------------------------- collections


def test_collections_are_created_listed_and_read(admin_client, acme, handbook):
    created = admin_client.post(
        "/api/v1/collections", {"name": "Reports", "description": "Quarterly", "text_search_config": "simple"},
        format="json",
    )  # fmt: skip
    assert created.status_code == 201
    body = created.json()
    assert body["name"] == "Reports" and body["description"] == "Quarterly"
    assert (body["embedding_model"], body["embedding_dimensions"], body["text_search_config"]) == (
        "all-MiniLM-L6-v2", 384, "simple",
    )  # fmt: skip
    assert body["document_count"] == 0 and body["url"].endswith(f"/api/v1/collections/{body['id']}")
    assert body["language"] == "auto"  # each chunk and query in its own language
    assert Collection.objects.get(pk=body["id"]).workspace == acme
    japanese = admin_client.post("/api/v1/collections", {"name": "報告", "language": "ja"}, format="json")
    assert (japanese.status_code, japanese.json()["language"]) == (201, "ja")
    assert Collection.objects.get(pk=japanese.json()["id"]).language == "ja"
    Collection.objects.filter(name="報告").delete()

    listed = admin_client.get("/api/v1/collections").json()
    assert (listed["count"], [item["name"] for item in listed["results"]]) == (2, ["Handbook", "Reports"])
    assert admin_client.get(body["url"]).json() == body


@pytest.mark.parametrize(
    ("payload", "field", "status"),
    [
        ({"name": "Handbook"}, "name", 409),
        ({"name": "   "}, "name", 400),
        ({}, "name", 400),
        ({"name": "X", "embedding_model": "word2vec"}, "embedding_model", 400),
        ({"name": "X", "text_search_config": "klingon"}, "text_search_config", 400),
        ({"name": "X", "language": "fr"}, "language", 400),
        ({"name": "X" * 201}, "name", 400),
    ],
)
def test_a_bad_collection_is_refused_naming_the_field(admin_client, handbook, payload, field, status):
    response = admin_client.post("/api/v1/collections", payload, format="json")
    assert response.status_code == status
    assert response.json()["error"]["field"] == field
    assert Collection.objects.count() == 1


# --------------------------------------------------------------------------- upload and processing


def test_two_files_uploaded_in_one_request_are_queued_then_processed(
    admin_client, handbook, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks() as enqueued:
        response = upload(
            admin_client, handbook.pk, {name: text.encode() for name, text in DOCUMENTS.items()},
            metadata=json.dumps({"team": "ops"}),
        )  # fmt: skip
    assert response.status_code == 201
    documents = response.json()["documents"]
    assert [(d["source_name"], d["status"], d["created"]) for d in documents] == [
        ("wing.md", "queued", True),
        ("robot.md", "queued", True),
    ]
    assert documents[0]["title"] == "wing" and documents[0]["metadata"] == {"team": "ops"}
    assert documents[0]["progress"] == {"chunks_embedded": 0, "chunks_total": 0}
    assert len(enqueued) == 2  # one ingestion task per document, queued once both were stored

    # What the ingestion task runs (a worker process would; see tests/search/test_ingest_worker.py).
    pipeline.documents_ingest(document_ids=[d["id"] for d in documents])
    for document in documents:
        detail = admin_client.get(document["url"]).json()
        assert detail["status"] == "indexed" and detail["error"] == ""
        assert detail["progress"]["chunks_total"] == detail["progress"]["chunks_embedded"] > 0
        assert detail["progress"]["chunks_total"] == Chunk.objects.filter(document_id=document["id"]).count()
        assert detail["indexed_at"] is not None and detail["media_type"] == "text/markdown"

    # The same bytes again: the existing documents, nothing new.
    again = upload(admin_client, handbook.pk, {"copy.md": DOCUMENTS["wing.md"].encode()})
    assert again.status_code == 200
    [same] = again.json()["documents"]
    assert (same["id"], same["created"]) == (documents[0]["id"], False)


def test_an_upload_with_a_refused_file_stores_nothing(admin_client, handbook, settings):
    settings.DOCUMENT_MAX_BYTES = 100
    response = upload(admin_client, handbook.pk, {"small.txt": b"Small enough.", "large.txt": b"x" * 101})
    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("document_too_large", "files")
    assert "large.txt is 101 bytes, over the limit of 100 bytes" in error["message"]
    assert Document.objects.count() == 0
    media = settings.MEDIA_ROOT
    assert not media.exists() or not [path for path in media.rglob("*") if path.is_file()]  # small.txt's file too

    response = upload(admin_client, handbook.pk, {"fake.pdf": b"not a pdf at all"})
    assert response.status_code == 400 and "content is not a PDF" in response.json()["error"]["message"]

    # Every refused file is named, and nothing of the upload is kept.
    response = upload(admin_client, handbook.pk, {"a.txt": b"Fine.", "empty.txt": b"", "fake.pdf": b"not a pdf"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("document_rejected", "files")
    assert error["message"].startswith("empty.txt: the file is empty; fake.pdf: fake.pdf is named .pdf")
    assert Document.objects.count() == 0


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"files": {"a.txt": b"A"}, "collection": None}, "collection"),
        ({"files": {}, "collection": "handbook"}, "files"),
        ({"files": {"a.txt": b""}, "collection": "handbook"}, "files"),
        ({"files": {"a.txt": b"A", "b.txt": b"B"}, "collection": "handbook", "title": "One"}, "title"),
        ({"files": {"a.txt": b"A"}, "collection": "handbook", "metadata": "[1, 2]"}, "metadata"),
        ({"files": {"a.txt": b"A"}, "collection": "handbook", "metadata": "{not json"}, "metadata"),
        ({"files": {"a.txt": b"A"}, "collection": 10**12}, "collection"),
    ],
)
def test_a_bad_upload_is_refused_naming_the_field(admin_client, handbook, fields, field):
    collection = handbook.pk if fields["collection"] == "handbook" else fields["collection"]
    extra = {name: value for name, value in fields.items() if name not in ("files", "collection")}
    data = {"files": [SimpleUploadedFile(n, c) for n, c in fields["files"].items()], **extra}
    if collection is not None:
        data["collection"] = collection
    response = admin_client.post("/api/v1/documents", data, format="multipart")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["field"] == field
    assert Document.objects.count() == 0


def test_an_upload_must_be_multipart(admin_client, handbook):
    response = admin_client.post("/api/v1/documents", {"collection": handbook.pk}, format="json")
    assert response.status_code == 415


# --------------------------------------------------------------------------- list, pages, delete, retry


@pytest.fixture
def five_documents(handbook):
    return [
        document_create(collection=handbook, source_name=f"n{i}.txt", content=f"Note {i}.".encode(), enqueue=False)[0]
        for i in range(5)
    ]


def test_documents_are_listed_newest_first_filtered_and_paged(admin_client, handbook, acme, five_documents):
    from search.services import collection_create

    other_collection = collection_create(workspace=acme, name="Other notes")
    document_create(collection=other_collection, source_name="x.txt", content=b"Elsewhere.", enqueue=False)
    Document.objects.filter(pk=five_documents[0].pk).update(status=Document.Status.FAILED, error="unreadable")

    page = admin_client.get("/api/v1/documents", {"collection": handbook.pk, "limit": 2}).json()
    assert (page["count"], page["limit"], page["offset"]) == (5, 2, 0)
    assert [d["id"] for d in page["results"]] == [d.pk for d in reversed(five_documents)][:2]
    assert page["previous"] is None
    assert parse_qs(urlsplit(page["next"]).query)["offset"] == ["2"]
    last = admin_client.get("/api/v1/documents", {"collection": handbook.pk, "limit": 2, "offset": 4}).json()
    assert [d["id"] for d in last["results"]] == [five_documents[0].pk] and last["next"] is None

    assert admin_client.get("/api/v1/documents").json()["count"] == 6
    failed = admin_client.get("/api/v1/documents", {"status": "failed"}).json()["results"]
    assert [(d["id"], d["error"]) for d in failed] == [(five_documents[0].pk, "unreadable")]
    assert admin_client.get("/api/v1/documents", {"limit": 200}).json()["limit"] == 200


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 201}, "limit"),
        ({"limit": 0}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"offset": -1}, "offset"),
        ({"status": "lost"}, "status"),
        ({"status": ""}, "status"),
        ({"collection": "x"}, "collection"),
        ({"collection": ""}, "collection"),
    ],
)
def test_bad_list_parameters_are_refused_naming_them(admin_client, five_documents, params, field):
    response = admin_client.get("/api/v1/documents", params)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == field


def test_a_document_is_deleted_with_its_chunks(admin_client, handbook):
    from tests.search.files import ingest_texts as ingest

    [document_id] = ingest(handbook, {"wing.md": DOCUMENTS["wing.md"]})
    assert Chunk.objects.filter(document_id=document_id).exists()
    assert admin_client.delete(f"/api/v1/documents/{document_id}").status_code == 204
    assert not Document.objects.filter(pk=document_id).exists()
    assert not Chunk.objects.filter(document_id=document_id).exists()
    handbook.refresh_from_db()
    assert handbook.chunk_count == 0
    assert admin_client.delete(f"/api/v1/documents/{document_id}").status_code == 404


def test_only_a_failed_document_is_retried(admin_client, five_documents, django_capture_on_commit_callbacks):
    failed, queued = five_documents[0], five_documents[1]
    Document.objects.filter(pk=failed.pk).update(status=Document.Status.FAILED, error="unreadable")
    with django_capture_on_commit_callbacks() as enqueued:
        response = admin_client.post(f"/api/v1/documents/{failed.pk}/retry")
    assert response.status_code == 202
    assert (response.json()["status"], response.json()["error"]) == ("queued", "")
    assert len(enqueued) == 1
    refused = admin_client.post(f"/api/v1/documents/{queued.pk}/retry")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_failed"
    assert admin_client.get(f"/api/v1/documents/{failed.pk}/retry").status_code == 405
