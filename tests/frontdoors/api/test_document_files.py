"""A document's original file through the API: a Japanese name survives upload, listing and
download (RFC 6266 ``filename*=utf-8''...``), the bytes come back as uploaded, and the file is
reachable only from its own workspace, as the document is."""

from __future__ import annotations

import asyncio
import unicodedata
import warnings

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connections
from django.test import AsyncClient
from rest_framework.test import APIClient

from search.ingest import pipeline
from search.models import Chunk, Document, Membership

pytestmark = pytest.mark.django_db

NAME = "経費精算規程.txt"
# 経費精算規程 in percent-encoded UTF-8, as RFC 5987 writes a name that is not ASCII.
DISPOSITION = "attachment; filename*=utf-8''%E7%B5%8C%E8%B2%BB%E7%B2%BE%E7%AE%97%E8%A6%8F%E7%A8%8B.txt"
TEXT = (
    "経費精算規程\n\n第1条（目的）この規程は、従業員が業務のために立て替えた経費の精算について定める。\n"
    "第2条 領収書は「経理部」へ提出し、金額は￥1,200のように記す。"
)
CONTENT = TEXT.encode("cp932")  # as Windows saves it


@pytest.fixture(autouse=True)
def _media_in_tmp(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "media"


def upload(client, collection_id: int, name: str, content: bytes):
    part = SimpleUploadedFile(name, content)
    return client.post("/api/v1/documents", {"collection": collection_id, "files": [part]}, format="multipart")


def body_of(response) -> bytes:
    assert response.streaming
    return b"".join(response.streaming_content)


def test_a_japanese_named_shift_jis_file_is_listed_and_downloaded_as_uploaded(admin_client, handbook):
    uploaded = upload(admin_client, handbook.pk, NAME, CONTENT)
    assert uploaded.status_code == 201, uploaded.content
    [document] = uploaded.json()["documents"]
    assert (document["source_name"], document["title"], document["media_type"], document["size_bytes"]) == (
        NAME, "経費精算規程", "text/plain", len(CONTENT),
    )  # fmt: skip
    pipeline.document_ingest(document_id=document["id"])

    listed = admin_client.get("/api/v1/documents").json()["results"]
    assert [(item["source_name"], item["title"], item["status"]) for item in listed] == [
        (NAME, "経費精算規程", "indexed")
    ]
    assert list(Chunk.objects.filter(document_id=document["id"]).values_list("text", flat=True)) == [TEXT]

    response = admin_client.get(f"/api/v1/documents/{document['id']}/file")
    assert response.status_code == 200
    assert response["Content-Disposition"] == DISPOSITION
    assert response["Content-Type"] == "application/octet-stream"
    assert response["Content-Length"] == str(len(CONTENT))
    assert body_of(response) == CONTENT


def test_an_ascii_name_is_a_plain_quoted_filename(admin_client, handbook):
    [document] = upload(admin_client, handbook.pk, 'policy "v2".md', b"# Policy\n\nText.").json()["documents"]
    response = admin_client.get(f"/api/v1/documents/{document['id']}/file")
    assert response["Content-Disposition"] == 'attachment; filename="policy \\"v2\\".md"'
    assert body_of(response) == b"# Policy\n\nText."


def test_a_name_decomposed_by_macos_is_stored_composed(admin_client, handbook):
    # macOS hands file names over in NFD: ガ as カ and a combining voiced mark.
    composed = "ガイドライン.md"
    decomposed = unicodedata.normalize("NFD", composed)
    assert decomposed != composed
    [document] = upload(admin_client, handbook.pk, decomposed, "# ガイド\n\n本文。".encode()).json()["documents"]
    assert (document["source_name"], document["title"]) == (composed, "ガイドライン")
    response = admin_client.get(f"/api/v1/documents/{document['id']}/file")
    assert response["Content-Disposition"] == (
        "attachment; filename*=utf-8''%E3%82%AC%E3%82%A4%E3%83%89%E3%83%A9%E3%82%A4%E3%83%B3.md"
    )


def test_the_file_is_found_only_in_its_own_workspace(make_key, client_for, handbook, other, acme):
    [document] = upload(client_for(make_key("documents")), handbook.pk, NAME, CONTENT).json()["documents"]
    path = f"/api/v1/documents/{document['id']}/file"

    theirs = client_for(make_key("admin", workspace=other)).get(path)
    assert theirs.status_code == 404
    assert theirs.json() == {
        "error": {"code": "not_found", "message": f"No document {document['id']} in this workspace."}
    }

    outsider = get_user_model().objects.create_user("bob")
    Membership.objects.create(workspace=other, user=outsider)
    session = APIClient()
    session.force_login(outsider)
    assert session.get(path).status_code == 404

    member = get_user_model().objects.create_user("ann")
    Membership.objects.create(workspace=acme, user=member)
    session.force_login(member)
    response = session.get(path)
    assert (response.status_code, response["Content-Disposition"], body_of(response)) == (200, DISPOSITION, CONTENT)

    refused = client_for(make_key("search")).get(path)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
    assert client_for().get(path).status_code == 401
    assert client_for(make_key("documents")).get("/api/v1/documents/999999/file").status_code == 404


def test_errors_are_json_whatever_the_client_accepts(make_key, client_for, handbook):
    client = client_for(make_key("documents"))
    [document] = upload(client, handbook.pk, NAME, CONTENT).json()["documents"]
    path = f"/api/v1/documents/{document['id']}/file"
    assert body_of(client.get(path, HTTP_ACCEPT="application/octet-stream")) == CONTENT
    missing = client.get("/api/v1/documents/999999/file", HTTP_ACCEPT="application/octet-stream")
    assert (missing.status_code, missing["Content-Type"]) == (404, "application/json")


def test_a_file_missing_from_storage_is_a_404_that_says_so(admin_client, handbook):
    [document] = upload(admin_client, handbook.pk, NAME, CONTENT).json()["documents"]
    Document.objects.get(pk=document["id"]).file.delete(save=False)
    response = admin_client.get(f"/api/v1/documents/{document['id']}/file")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "code": "not_found",
        "message": f"The file of document {document['id']} is missing from storage.",
    }


def test_an_undecodable_text_file_is_refused_at_upload_naming_it(admin_client, handbook):
    response = upload(admin_client, handbook.pk, NAME, CONTENT[:-1])  # cut in its last character
    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "document_rejected",
        "field": "files",
        "message": f"{NAME}: the text could not be decoded: it reads as Shift_JIS (CP932) but byte 155 (0x81) "
        "is not valid Shift_JIS (CP932); save the file as UTF-8 and upload it again",
    }
    assert not Document.objects.exists()


@pytest.mark.django_db(transaction=True)  # the view's queries run on another thread's connection
def test_under_asgi_the_file_streams_from_an_async_iterator(make_key, client_for, handbook):
    token = make_key("documents")
    [document] = upload(client_for(token), handbook.pk, NAME, CONTENT).json()["documents"]

    async def download():
        response = await AsyncClient().get(
            f"/api/v1/documents/{document['id']}/file", headers={"Authorization": f"Bearer {token}"}
        )
        # As Django's ASGI handler sends it.
        body = b"".join([block async for block in response])
        await sync_to_async(connections.close_all)()
        return response, body

    with warnings.catch_warnings():
        # Django warns when it has to read a synchronous iterator whole to serve it under ASGI.
        warnings.filterwarnings("error", "StreamingHttpResponse must consume synchronous iterators")
        response, body = asyncio.run(download())
    assert (response.status_code, response.is_async, response["Content-Disposition"]) == (200, True, DISPOSITION)
    assert body == CONTENT
