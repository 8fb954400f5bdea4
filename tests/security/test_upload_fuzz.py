"""Hostile uploads (GitHub issue 8, "Upload fuzzing").

Every hostile file gets a clear 4xx at upload (REST API with a client key, browser UI) or
ends as a ``failed`` document with a reason an operator can read; the Celery worker process
that met them serves the next good document; files land only inside the storage folder;
disk use is bounded (per file, per part being uploaded, per workspace). Everything runs on
the real parts: PostgreSQL, Redis, Django's multipart parser, a real worker process.
"""

from __future__ import annotations

import html
import time
from pathlib import Path

import psutil
import pytest
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.test import Client
from django.urls import reverse
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from billing import client_keys
from search.ingest import parsers, pipeline
from search.models import Chunk, Document, Membership
from search.services import (
    DocumentRejected,
    StorageQuotaExceeded,
    collection_create,
    document_create,
    document_delete,
    workspace_create,
)
from tests.search.files import SAMPLE_PDF, make_zip, seeded_bytes
from tests.security.files_hostile import (
    deflate_repeated,
    docx_with_bomb_member,
    docx_with_forged_sizes,
    encrypt_pdf,
    make_docx,
    make_pdf,
    pdf_with_streams,
    zip_with_many_members,
)

MIB = 1024 * 1024
HTMX = {"HTTP_HX_REQUEST": "true"}
BINARY = "unsupported file type: binary data that is not PDF, DOCX or text (detected by content)"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def media(settings, tmp_path) -> Path:
    settings.MEDIA_ROOT = tmp_path / "media"
    return settings.MEDIA_ROOT


@pytest.fixture
def collection(db, media):
    workspace = workspace_create(name="Acme", slug="acme")
    return collection_create(workspace=workspace, name="Handbook")


@pytest.fixture
def api(collection) -> APIClient:
    _, token = client_keys.client_key_create(collection.workspace, "fuzz key", scopes=["documents"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def member_client(client, collection):
    user = get_user_model().objects.create_user("ann", password="x" * 12)
    Membership.objects.create(workspace=collection.workspace, user=user)
    client.force_login(user)
    return client


def api_upload(api: APIClient, collection, name: str, content: bytes, content_type: str = "application/octet-stream"):
    part = SimpleUploadedFile(name, content, content_type=content_type)
    return api.post("/api/v1/documents", {"collection": collection.pk, "files": [part]}, format="multipart")


def stored_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file()) if root.exists() else []


# --------------------------------------------------------------------------- refused at upload

RANDOM = seeded_bytes(8, 4096)  # holds NUL bytes, as binary data does
EXE = b"MZ\x90\x00\x03\x00\x00\x00\x04\x00\x00\x00\xff\xff" + seeded_bytes(9, 2048)

REFUSED_AT_UPLOAD = [
    # (file name, declared content type, bytes, reason after "<name>: ")
    ("r.pdf", "application/pdf", RANDOM, "r.pdf is named .pdf but its content is not a PDF"),
    ("r.docx", parsers.DOCX_MEDIA_TYPE, RANDOM, "r.docx is named .docx but its content is not a Word document"),
    ("r.txt", "text/plain", RANDOM, f"{BINARY}: it contains NUL bytes"),
    ("r.md", "text/markdown", RANDOM, f"{BINARY}: it contains NUL bytes"),
    ("r.html", "text/html", RANDOM, f"{BINARY}: it contains NUL bytes"),
    ("r.htm", "text/html", RANDOM, f"{BINARY}: it contains NUL bytes"),
    ("r.csv", "text/csv", RANDOM, f"{BINARY}: it contains NUL bytes"),
    ("r.rst", "text/plain", RANDOM, f"{BINARY}: it contains NUL bytes"),
    ("setup.exe", "application/x-msdownload", EXE, f"{BINARY}: it contains NUL bytes"),
    ("invoice.pdf", "application/pdf", make_zip({"a.txt": b"hello"}),
     "invoice.pdf is a ZIP archive but not a Word document (.docx); only .docx archives are supported"),
    ("page.pdf", "application/pdf", b"<!doctype html><p>not a pdf</p>",
     "page.pdf is named .pdf but its content is not a PDF"),
    ("many.docx", parsers.DOCX_MEDIA_TYPE, zip_with_many_members(12_000),
     "many.docx (a ZIP archive) has 12,001 members, more than the 10,000 allowed"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content_type", "content", "reason"), REFUSED_AT_UPLOAD, ids=lambda v: "")
def test_a_hostile_file_is_refused_by_the_api_with_its_reason_and_nothing_is_stored(
    api, collection, media, name, content_type, content, reason
):
    response = api_upload(api, collection, name, content, content_type)
    assert response.status_code == 400, response.content
    assert response.json()["error"] == {"code": "document_rejected", "message": f"{name}: {reason}", "field": "files"}
    assert not Document.objects.exists() and stored_files(media) == []


def test_hostile_files_are_refused_by_the_browser_upload_with_422_and_their_reasons(member_client, collection, media):
    files = [SimpleUploadedFile(name, content, content_type=ct) for name, ct, content, _ in REFUSED_AT_UPLOAD]
    files.append(SimpleUploadedFile("empty.txt", b""))
    response = member_client.post(reverse("ui:upload"), {"collection": collection.pk, "files": files}, **HTMX)
    assert response.status_code == 422
    report = html.unescape(response.content.decode())
    for name, _, _, reason in REFUSED_AT_UPLOAD:
        assert f"{name}: {reason}" in report, name
    assert "empty.txt: the file is empty" in report
    assert "Nothing was stored: remove or fix those files and upload again." in report
    assert not Document.objects.exists() and stored_files(media) == []
    # One good file among them: all or nothing, as in the API: the bad one is named, the good one
    # (written before the bad one was read) is not kept either.
    mixed = [SimpleUploadedFile("good.txt", b"Receipts are due in 30 days."), SimpleUploadedFile("r.pdf", RANDOM)]
    response = member_client.post(reverse("ui:upload"), {"collection": collection.pk, "files": mixed}, **HTMX)
    report = html.unescape(response.content.decode())
    assert response.status_code == 422
    assert "r.pdf: r.pdf is named .pdf but its content is not a PDF" in report and "good.txt" not in report
    assert "Nothing was stored: remove or fix that file and upload again." in report
    assert not Document.objects.exists() and stored_files(media) == []


def test_an_empty_file_is_refused_by_the_api(api, collection, media):
    response = api_upload(api, collection, "empty.txt", b"")
    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "document_rejected",
        "message": "empty.txt: the file is empty",
        "field": "files",
    }
    with pytest.raises(DocumentRejected, match=r"^empty\.txt: the file is empty$"):
        document_create(collection=collection, source_name="empty.txt", content=b"", enqueue=False)
    assert stored_files(media) == []


class RecordingTemporaryFileUploadHandler(TemporaryFileUploadHandler):
    """Django's own storing handler, recording the bytes it was given to store."""

    stored: list[int] = []
    received: list[int] = [0]

    def receive_data_chunk(self, raw_data, start):
        type(self).received[0] += len(raw_data)
        return super().receive_data_chunk(raw_data, start)

    def file_complete(self, file_size):
        type(self).stored.append(file_size)
        return super().file_complete(file_size)


def test_a_file_over_the_limit_is_a_413_naming_the_limit_and_is_not_kept_whole(api, collection, media, settings):
    settings.DOCUMENT_MAX_BYTES = 1 * MIB
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 64 * 1024  # larger parts go to a temporary file
    settings.FILE_UPLOAD_HANDLERS = [
        "search.ingest.uploads.DocumentSizeLimitHandler",
        "django.core.files.uploadhandler.MemoryFileUploadHandler",
        f"{__name__}.RecordingTemporaryFileUploadHandler",
    ]
    RecordingTemporaryFileUploadHandler.stored.clear()
    RecordingTemporaryFileUploadHandler.received[0] = 0
    big = 8 * MIB + 5
    response = api_upload(api, collection, "big.txt", b"a" * big)
    assert response.status_code == 413
    assert response.json()["error"] == {
        "code": "document_too_large",
        "message": f"big.txt is {big} bytes, over the limit of {MIB} bytes",
        "field": "files",
    }
    # The storing handler saw at most the limit: the remaining 7 MiB were read and dropped.
    assert RecordingTemporaryFileUploadHandler.received[0] <= MIB
    assert RecordingTemporaryFileUploadHandler.stored == []  # never completed: the size handler answered
    assert not Document.objects.exists() and stored_files(media) == []
    # Exactly at the limit is accepted, and stored through the same handlers.
    response = api_upload(api, collection, "limit.txt", b"b" * MIB)
    assert response.status_code == 201 and RecordingTemporaryFileUploadHandler.stored == [MIB]
    # The browser upload says the same, as a 422 its page shows.
    user = get_user_model().objects.create_user("ann", password="x" * 12)
    Membership.objects.create(workspace=collection.workspace, user=user)
    member_client = Client()
    member_client.force_login(user)
    page = member_client.post(
        reverse("ui:upload"),
        {"collection": collection.pk, "files": [SimpleUploadedFile("big.txt", b"a" * big)]},
        **HTMX,
    )
    assert page.status_code == 422
    assert f"big.txt is {big} bytes, over the limit of {MIB} bytes" in page.content.decode()


def test_the_workspace_storage_quota_bounds_disk_use(api, member_client, collection, media, settings):
    settings.WORKSPACE_STORAGE_MAX_BYTES = 100
    first = api_upload(api, collection, "a.txt", b"a" * 60)
    assert first.status_code == 201
    refused = api_upload(api, collection, "b.txt", b"b" * 50)
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "code": "document_rejected",
        "message": "b.txt (50 bytes) would take the workspace over its storage quota of 100 bytes "
        "(60 bytes used); delete documents to make room",
        "field": "files",
    }
    page = member_client.post(
        reverse("ui:upload"), {"collection": collection.pk, "files": [SimpleUploadedFile("b.txt", b"b" * 50)]}, **HTMX
    )
    assert page.status_code == 422 and "would take the workspace over its storage quota of 100 bytes" in (
        page.content.decode()
    )
    with pytest.raises(StorageQuotaExceeded):
        document_create(collection=collection, source_name="b.txt", content=b"b" * 41, enqueue=False)
    assert document_create(collection=collection, source_name="c.txt", content=b"c" * 40, enqueue=False)[1]
    assert len(stored_files(media)) == 2
    # Deleting makes room again.
    document_delete(document=Document.objects.get(source_name="a.txt"))
    assert api_upload(api, collection, "b.txt", b"b" * 50).status_code == 201


# --------------------------------------------------------------------------- names

HOSTILE_NAMES = [
    ("../../etc/passwd", "passwd"),
    ("/etc/passwd.txt", "passwd.txt"),
    ("..\\..\\windows\\system32\\evil.txt", "evil.txt"),
    ("C:\\Users\\x\\notes.md", "notes.md"),
    ("nul\x00byte.txt", "nulbyte.txt"),
    ("ctl\x01\x1b[31m\x7f\x85.txt", "ctl[31m.txt"),
    ("line\nbreak\r.txt", "linebreak.txt"),
    ("invoice\u202egpj.exe", "invoicegpj.exe"),  # shown as "invoiceexe.jpg" with the override
    ("zero\u200bwidth\u2066.txt", "zerowidth.txt"),
    ("..", "upload"),
    ("\x00\x01", "upload"),
    ("n" * 1000 + ".txt", "n" * 251 + ".txt"),
]


@pytest.mark.parametrize(("raw", "shown"), HOSTILE_NAMES, ids=lambda v: "")
def test_a_hostile_file_name_is_cleaned_and_never_becomes_a_path(collection, media, raw, shown):
    content = f"Text uploaded as {raw!r}.".encode()
    document, created = document_create(collection=collection, source_name=raw, content=content, enqueue=False)
    assert created and document.source_name == shown
    stored = Path(document.file.path).resolve()
    assert stored.is_relative_to(media.resolve()) and stored.read_bytes() == content
    assert stored.name == document.content_sha256[:32] + stored.suffix
    assert all(ch.isprintable() for ch in document.title) and len(document.title) <= 500
    assert stored_files(media.parent) == [stored]  # nothing anywhere else under the test's folder


def raw_multipart(collection_id: int, file_name: str, content: bytes) -> tuple[bytes, str]:
    """A multipart body carrying ``file_name`` byte for byte (UTF-8), as a hostile client sends it."""
    boundary = "fuzzboundary7MA4YWxkTrZu0gW"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="collection"\r\n\r\n{collection_id}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{file_name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode("utf-8", "surrogatepass")
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


# Through HTTP, Django's multipart parser cleans first (it keeps the last path component and
# printable characters, and drops parts whose name is then empty or ".."); ours cleans again.
API_NAME_REFUSALS = {
    "..": (400, "invalid_request", "This field is required."),
    "\x00\x01": (400, "invalid_request", "This field is required."),
    "n" * 1000 + ".txt": (400, "parse_error", "Multipart form parse error - Request max total header size exceeded."),
}


def test_hostile_names_through_the_api_are_cleaned_and_stored_inside_the_storage_folder(api, collection, media):
    cases = [*HOSTILE_NAMES, ("m" * 600 + ".txt", "m" * 251 + ".txt")]
    for index, (raw, shown) in enumerate(cases):
        body, content_type = raw_multipart(collection.pk, raw, f"Upload number {index}.".encode())
        response = api.generic("POST", "/api/v1/documents", body, content_type=content_type)
        if raw in API_NAME_REFUSALS:
            status, code, message = API_NAME_REFUSALS[raw]
            assert response.status_code == status, raw
            assert (response.json()["error"]["code"], response.json()["error"]["message"]) == (code, message), raw
            continue
        assert response.status_code == 201, (raw, response.content)
        [document] = response.json()["documents"]
        assert document["source_name"] == shown, raw
    files = stored_files(media.parent)
    assert len(files) == Document.objects.count() == len(cases) - len(API_NAME_REFUSALS)
    for document in Document.objects.all():
        stored = Path(document.file.path).resolve()
        assert stored.is_relative_to(media.resolve()) and stored.name.startswith(document.content_sha256[:32])


# --------------------------------------------------------------------------- parsing bounds (in process)


def test_a_pdf_decompression_bomb_stops_at_the_bound_with_a_reason():
    one_gib_stream = pdf_with_streams([deflate_repeated(b" ", 1024 * MIB)])
    assert len(one_gib_stream) < 1.1 * MIB
    with pytest.raises(parsers.ParseError) as excinfo:
        parsers.parse_document(one_gib_stream, media_type="application/pdf")
    assert str(excinfo.value) == (
        "the PDF has a stream that expands to more than 33,554,432 bytes when decompressed, more than allowed "
        "(it looks like a decompression bomb)"
    )
    # Many streams each under the per-stream bound: their total is bounded too.
    many = pdf_with_streams([deflate_repeated(b" ", 16 * MIB) for _ in range(12)])
    with pytest.raises(parsers.ParseError) as excinfo:
        parsers.parse_document(many, media_type="application/pdf")
    assert str(excinfo.value) == (
        "the PDF expands to more than 134,217,728 bytes when decompressed, more than allowed "
        "(it looks like a decompression bomb)"
    )


def test_a_docx_bomb_is_refused_from_its_directory_before_anything_inflates():
    cases = [
        (docx_with_bomb_member(1024 * MIB), "the Word document would expand to 1,074,"),
        (docx_with_forged_sizes(2**32 - 2), "the Word document would expand to 4,295,"),
        (zip_with_many_members(12_000), "the Word document has 12,001 members, more than the 10,000 allowed"),
    ]
    for data, reason in cases:
        with pytest.raises(parsers.ParseError) as excinfo:
            parsers.parse_document(data, media_type=parsers.DOCX_MEDIA_TYPE)
        assert str(excinfo.value).startswith(reason)
    # A member that inflates 2,000:1 under the total bound: refused by its ratio.
    with pytest.raises(parsers.ParseError, match=r"compressed \d+:1, more than the 100:1 allowed"):
        parsers.parse_document(docx_with_bomb_member(64 * MIB), media_type=parsers.DOCX_MEDIA_TYPE)


# --------------------------------------------------------------------------- through a real worker


def vm_status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def settle(document_id: int, timeout: float = 120) -> Document:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        document = Document.objects.get(pk=document_id)
        if document.status in (Document.Status.INDEXED, Document.Status.FAILED):
            return document
        time.sleep(0.1)
    raise AssertionError(f"document {document_id} never finished: {Document.objects.get(pk=document_id).status}")


WORKER_CASES = [
    # (name, a builder of its bytes, final status, reason: exact, or a prefix ending in "...")
    ("truncated.pdf", lambda: SAMPLE_PDF[: len(SAMPLE_PDF) // 3], "failed", "the PDF could not be read: ..."),
    ("locked.pdf", lambda: encrypt_pdf(SAMPLE_PDF, user_password="secret"), "failed",
     "the PDF is encrypted with a password"),
    ("owner-only.pdf",
     lambda: encrypt_pdf(make_pdf([["Readable without a password."]]), user_password="", owner_password="o"),
     "indexed", ""),
    ("bomb.pdf", lambda: pdf_with_streams([deflate_repeated(b" ", 1024 * MIB)]), "failed",
     "the PDF has a stream that expands to more than 33,554,432 bytes when decompressed, more than allowed "
     "(it looks like a decompression bomb)"),
    ("bombs.pdf", lambda: pdf_with_streams([deflate_repeated(b" ", 16 * MIB) for _ in range(12)]), "failed",
     "the PDF expands to more than 134,217,728 bytes when decompressed, more than allowed "
     "(it looks like a decompression bomb)"),
    ("bomb.docx", lambda: docx_with_bomb_member(1024 * MIB), "failed", "the Word document would expand to 1,074,..."),
    ("forged.docx", lambda: docx_with_forged_sizes(2**32 - 2), "failed", "the Word document would expand to 4,295,..."),
    ("deep.html", lambda: (f"<html><body>{'<div>' * 50_000}deep text{'</div>' * 50_000}</body></html>").encode(),
     "indexed", ""),
    ("script-only.html", lambda: b"<html><head><title>T</title><script>var x = 1;</script></head><body> </body></html>",
     "failed", "no text found in the document"),
    ("blank.txt", lambda: b"   \n\t\n  \x0c  ", "failed", "no text found in the document"),
    ("images-only.pdf", lambda: make_pdf([[]]), "failed",
     "the PDF has no extractable text (scanned images need OCR, which is not supported)"),
]  # fmt: skip


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_worker_fails_hostile_documents_with_reasons_bounded_in_memory_and_serves_the_next(start_worker, media):
    collection = collection_create(workspace=workspace_create(name="Acme", slug="acme"), name="Handbook")
    with start_worker(["ingest"], env={"MEDIA_ROOT": str(media)}) as worker:
        warm, _ = document_create(collection=collection, source_name="warm.txt", content=b"The first good document.")
        assert settle(warm.pk).status == "indexed"
        [pool] = psutil.Process(worker.process.pid).children()
        Path(f"/proc/{pool.pid}/clear_refs").write_text("5")  # resets the peak resident size (VmHWM)
        before = vm_status(pool.pid)

        outcomes = {}
        for name, build, _, _ in WORKER_CASES:
            document, created = document_create(collection=collection, source_name=name, content=build())
            assert created, name
            final = settle(document.pk)
            outcomes[name] = (final.status, final.error)
            if final.status == "failed":
                assert not Chunk.objects.filter(document=final).exists(), name
        after = vm_status(pool.pid)

        good, _ = document_create(collection=collection, source_name="next.txt", content=b"The next good document.")
        assert settle(good.pk).status == "indexed"
        assert psutil.Process(worker.process.pid).children() == [pool]  # the same pool process served it
        assert worker.process.poll() is None

    for name, _, status, reason in WORKER_CASES:
        got_status, error = outcomes[name]
        assert got_status == status, (name, error)
        if reason.endswith("..."):
            assert error.startswith(reason[:-3]), (name, error)
        else:
            assert error == reason, (name, error)
    assert Chunk.objects.get(document=good).text == "The next good document."
    # The bombs declared 3.3 GiB between them; the pool process's peak grew by less than 256 MiB.
    grown = after["VmHWM"] - before["VmRSS"]
    print(f"pool process peak RSS {after['VmHWM'] / MIB:.0f} MiB, {grown / MIB:.0f} MiB over its resident size before")
    assert grown < 256 * MIB
    assert all(
        path.resolve().is_relative_to(media.resolve()) for path in stored_files(media.parent) if "media" in path.parts
    )


# --------------------------------------------------------------------------- property: anything in, clean outcome out

MAGIC = [
    b"",
    b"%PDF-1.7\n",
    b"PK\x03\x04",
    b"PK\x05\x06",
    b"<!doctype html><html>",
    b"\xef\xbb\xbf",
    b"\xff\xfe",
    b"<html>",
]
SUFFIXES = ["", ".pdf", ".docx", ".txt", ".md", ".html", ".htm", ".exe", ".PDF", "/", "\\", "\x00"]


@st.composite
def uploads(draw):
    body = draw(
        st.one_of(
            st.binary(max_size=1500),
            st.text(max_size=400).map(lambda text: text.encode("utf-8", "surrogatepass")),
            st.sampled_from([SAMPLE_PDF, make_docx(), SAMPLE_PDF[:200], make_docx()[:-40]]),
        )
    )
    content = draw(st.sampled_from(MAGIC)) + body
    name = draw(st.text(max_size=40)) + draw(st.sampled_from(SUFFIXES))
    return name, content


@pytest.mark.django_db(transaction=True)
@hypothesis_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(upload=uploads())
def test_any_bytes_under_any_name_end_as_a_clean_refusal_or_a_finished_document(upload, media, collection_factory):
    name, content = upload
    collection = collection_factory()
    rows_before, files_before = Document.objects.count(), set(stored_files(media))
    try:
        document, created = document_create(collection=collection, source_name=name, content=content, enqueue=False)
    except DocumentRejected as exc:
        assert str(exc)
        assert Document.objects.count() == rows_before and set(stored_files(media)) == files_before
        return
    if created:
        document = pipeline.document_ingest(document_id=document.pk)
    document.refresh_from_db()
    assert document.status in (Document.Status.INDEXED, Document.Status.FAILED)
    chunks = Chunk.objects.filter(document=document).count()
    if document.status == Document.Status.FAILED:
        assert document.error.strip() and chunks == 0
    else:
        assert document.error == "" and chunks == document.chunks_total > 0
    path = Path(document.file.path).resolve()
    assert path.is_file() and path.is_relative_to(media.resolve())
    # Rows and files match one for one: no file without its row, no row without its file.
    assert {Path(d.file.path).resolve() for d in Document.objects.all()} == {p.resolve() for p in stored_files(media)}


@pytest.fixture
def collection_factory(db):
    def make():
        workspace = workspace_create(name="Fuzz", slug="fuzz")
        return collection_create(workspace=workspace, name="Fuzz")

    return make
