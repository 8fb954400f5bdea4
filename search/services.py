"""Writes for the search app (reads live in ``selectors.py``)."""

from __future__ import annotations

import hashlib
import logging
import unicodedata
from pathlib import PurePath

from celery import signature
from django.conf import settings
from django.core.files.base import ContentFile
from django.db import IntegrityError, transaction
from django.db.models import Sum

from ragsite.errors import DomainError
from ragsite.redis import Role, redis_client
from search import analysis
from search.access import OPERATOR, Reader
from search.embedders import DEFAULT_EMBEDDER, embedder_get
from search.ingest.chunk_writes import chunks_remove
from search.ingest.parsers import ParseError, sniff_media_type
from search.ingest.pipeline import interruptions_key
from search.ingest.status import status_set
from search.models import READERS_OPEN, Chunk, Collection, Document, Workspace
from search.vector_indexes import vector_index_ensure

logger = logging.getLogger(__name__)

# The longest name kept for an upload (as file systems allow), extension included.
SOURCE_NAME_MAX_CHARS = 255


class DocumentRejected(DomainError):
    """An upload refused before it is stored; the message says why."""

    code = "document_rejected"
    field = "files"


class DocumentTooLarge(DocumentRejected):
    """A file over ``DOCUMENT_MAX_BYTES``; the message names the limit."""

    code = "document_too_large"
    status = 413


class StorageQuotaExceeded(DocumentRejected):
    """Storing the file would take its workspace over ``WORKSPACE_STORAGE_MAX_BYTES``."""


class DocumentsRejected(DocumentRejected):
    """Several files of one upload refused: ``refusals`` holds each one's error, in order."""

    def __init__(self, refusals: list[DocumentRejected]):
        too_large = all(isinstance(refusal, DocumentTooLarge) for refusal in refusals)
        super().__init__(
            "; ".join(str(refusal) for refusal in refusals),
            code=DocumentTooLarge.code if too_large else None,
            status=DocumentTooLarge.status if too_large else None,
        )
        self.refusals = refusals


def workspace_create(*, name: str, slug: str) -> Workspace:
    workspace, _ = Workspace.objects.get_or_create(slug=slug, defaults={"name": name})
    return workspace


def collection_create(
    *,
    workspace: Workspace,
    name: str,
    description: str = "",
    embedding_model: str = DEFAULT_EMBEDDER,
    text_search_config: str = "search_english",
    language: str = analysis.AUTO,
) -> Collection:
    """Get or create a collection; a new one gets a vector index for its model's dimension.
    ``language``: what its chunks and queries are analysed in (``auto``: each its own; docs/search.md)."""
    if language not in analysis.LANGUAGES:
        raise ValueError(f"language must be one of {', '.join(analysis.LANGUAGES)}, got {language!r}")
    existing = Collection.objects.filter(workspace=workspace, name=name).first()
    if existing is not None:
        return existing
    dimensions = embedder_get(embedding_model).dimensions
    vector_index_ensure(dimensions)
    collection, _ = Collection.objects.get_or_create(
        workspace=workspace,
        name=name,
        defaults={
            "description": description,
            "embedding_model": embedding_model,
            "embedding_dimensions": dimensions,
            "text_search_config": text_search_config,
            "language": language,
        },
    )
    return collection


def source_name_clean(name: str) -> str:
    """The name an upload is known and shown by: its last path component (``/`` or ``\\``),
    in Unicode NFC, printable characters only (no control characters, no bidirectional overrides
    or other invisible formatting), at most ``SOURCE_NAME_MAX_CHARS`` with its extension kept;
    ``upload`` when nothing is left. It is never used as a path (see ``_storage_name``)."""
    name = _printable(str(name).replace("\\", "/").rsplit("/", 1)[-1])
    if name in ("", ".", ".."):
        return "upload"
    if len(name) > SOURCE_NAME_MAX_CHARS:
        suffix = PurePath(name).suffix[:16]
        name = name[: SOURCE_NAME_MAX_CHARS - len(suffix)] + suffix
    return name


def _printable(text: str) -> str:
    # NFC first: macOS hands file names over decomposed (が as か and a combining mark), which
    # looks the same but would compare, search and sort apart from the name as typed.
    return "".join(ch for ch in unicodedata.normalize("NFC", text) if ch.isprintable()).strip()


def _title_from_name(source_name: str) -> str:
    stem = PurePath(source_name).stem.replace("-", " ").replace("_", " ").strip()
    return (stem or source_name)[:500]


def document_create(
    *,
    collection: Collection,
    source_name: str,
    content: bytes,
    title: str | None = None,
    metadata: dict | None = None,
    readers: list[str] | None = None,
    uploader: Reader = OPERATOR,
    enqueue: bool = True,
) -> tuple[Document, bool]:
    """Store an upload as a queued document and enqueue its ingestion; returns ``(document, created)``.

    ``readers``: who may read it (``search.access.readers_for``; default: its whole workspace).
    The same bytes uploaded twice to one collection return the existing document
    (``created`` is False), or, when the ``uploader`` may not read that one, are refused
    without naming it. Files that are empty, too large (``DocumentTooLarge``) or of an
    unsupported type, and files that would take the workspace over its storage quota
    (``StorageQuotaExceeded``), are refused with ``DocumentRejected`` before anything is
    stored. The name is cleaned (``source_name_clean``). ``enqueue=False`` leaves ingestion
    to the caller (bulk loads run the pipeline in-process).
    """
    source_name = source_name_clean(source_name)
    if len(content) > settings.DOCUMENT_MAX_BYTES:
        raise DocumentTooLarge(
            f"{source_name} is {len(content)} bytes, over the limit of {settings.DOCUMENT_MAX_BYTES} bytes"
        )
    try:
        media_type = sniff_media_type(content, source_name)
    except ParseError as exc:
        raise DocumentRejected(f"{source_name}: {exc}") from None
    except Exception as exc:  # a library's unexpected error on hostile bytes is a refusal, not a 500
        logger.exception("sniffing %r failed unexpectedly", source_name)
        raise DocumentRejected(
            f"{source_name}: the file's type could not be determined ({type(exc).__name__})"
        ) from None
    title = _printable(title or "")
    digest = hashlib.sha256(content).hexdigest()
    existing = Document.objects.filter(collection=collection, content_sha256=digest).first()
    if existing is not None:
        return _existing_for(existing, uploader, source_name), False
    metadata = dict(metadata or {})
    if title:
        metadata["title_from"] = "user"
    document = Document(
        collection=collection,
        title=(title or _title_from_name(source_name))[:500],
        source_name=source_name[:500],
        media_type=media_type,
        size_bytes=len(content),
        content_sha256=digest,
        metadata=metadata,
        readers=list(readers or READERS_OPEN),
    )
    try:
        with transaction.atomic():
            _storage_quota_check(collection, source_name, len(content))
            document.file.save(_storage_name(source_name, digest), ContentFile(content), save=False)
            document.save()
            if enqueue:
                transaction.on_commit(lambda: _enqueue_ingest(document.pk))
    except IntegrityError:
        # A concurrent upload of the same bytes won the race: keep theirs, drop our file.
        document.file.delete(save=False)
        existing = Document.objects.get(collection=collection, content_sha256=digest)
        return _existing_for(existing, uploader, source_name), False
    except BaseException:
        if document.file:  # the row is not stored: neither is its file
            document.file.delete(save=False)
        raise
    return document, True


def _existing_for(existing: Document, uploader: Reader, source_name: str) -> Document:
    """The document already holding an upload's bytes, if its uploader may read it; else a
    refusal that names neither it nor who may read it."""
    if not uploader.may_read(existing.readers):
        raise DocumentRejected(f"{source_name}: the same file is already in this collection, restricted to others")
    return existing


def documents_upload(
    *,
    collection: Collection,
    files: list,
    title: str | None = None,
    metadata: dict | None = None,
    readers: list[str] | None = None,
    uploader: Reader = OPERATOR,
) -> list[tuple[Document, bool]]:
    """Store uploaded files (Django's ``UploadedFile``: ``name``, ``size``, ``read()``) as queued
    documents, all or nothing; returns ``(document, created)`` per file, in order, as
    ``document_create`` does for one.

    A refused file (empty, over ``DOCUMENT_MAX_BYTES``, of an unsupported type, over the
    workspace's quota) stores none: every file is still checked, then the rows are rolled back,
    the files already written are deleted, and its ``DocumentRejected`` is raised (naming the
    file), or ``DocumentsRejected`` with each refusal when several files were refused. A file's
    size is checked before its bytes are read into memory. The ingestion tasks are queued once
    every document is stored (on commit).
    """
    if title and len(files) > 1:
        raise DocumentRejected("A title can be given for one file only.", code="invalid_request", field="title")
    results, written, refusals = [], [], []
    try:
        with transaction.atomic():
            for file in files:
                try:
                    if file.size > settings.DOCUMENT_MAX_BYTES:
                        raise DocumentTooLarge(
                            f"{source_name_clean(file.name)} is {file.size} bytes, over the limit of "
                            f"{settings.DOCUMENT_MAX_BYTES} bytes"
                        )
                    document, created = document_create(
                        collection=collection, source_name=file.name, content=file.read(), title=title,
                        metadata=metadata, readers=readers, uploader=uploader,
                    )  # fmt: skip
                except DocumentRejected as refusal:
                    refusals.append(refusal)
                    continue
                results.append((document, created))
                if created:
                    written.append(document.file)
            if refusals:
                raise refusals[0] if len(refusals) == 1 else DocumentsRejected(refusals)
    except BaseException:
        for stored in written:
            stored.delete(save=False)
        raise
    return results


def workspace_storage_used(workspace_id: int) -> int:
    """Bytes of uploaded files the workspace's documents keep in storage."""
    used = Document.objects.filter(collection__workspace_id=workspace_id).aggregate(total=Sum("size_bytes"))["total"]
    return int(used or 0)


def _storage_quota_check(collection: Collection, source_name: str, size: int) -> None:
    """Refuse a file that would take the workspace over ``WORKSPACE_STORAGE_MAX_BYTES``.

    Runs in the storing transaction with the workspace's row locked, so that concurrent
    uploads of one workspace are counted one after the other, never both against the same total.
    """
    quota = settings.WORKSPACE_STORAGE_MAX_BYTES
    Workspace.objects.select_for_update().filter(pk=collection.workspace_id).values_list("pk").first()
    used = workspace_storage_used(collection.workspace_id)
    if used + size > quota:
        raise StorageQuotaExceeded(
            f"{source_name} ({size} bytes) would take the workspace over its storage quota of {quota} bytes "
            f"({used} bytes used); delete documents to make room"
        )


def _storage_name(source_name: str, digest: str) -> str:
    """A safe file name for storage: the content hash plus a sanitised suffix.

    The user's file name is kept in ``source_name`` only; it never becomes a path, so
    names like ``../../etc/passwd`` or control characters cannot escape the storage folder.
    """
    suffix = "".join(ch for ch in PurePath(source_name).suffix.lower() if (ch.isascii() and ch.isalnum()) or ch == ".")
    suffix = suffix[:10] if len(suffix) > 1 else ""
    return f"{digest[:32]}{suffix}"


def _enqueue_ingest(document_id: int) -> None:
    # By the task's name: tasks sit above the services they call (docs/architecture.md).
    signature("search.tasks.document_ingest", args=(document_id,)).delay()


def document_retry(*, document: Document) -> Document:
    """Queue a failed document for another attempt."""
    if document.status != Document.Status.FAILED:
        return document
    status_set([document], Document.Status.QUEUED, error="", chunks_embedded=0)
    redis_client(Role.BROKER).delete(interruptions_key(document.pk))  # a retry starts a new count of cut-off runs
    transaction.on_commit(lambda: _enqueue_ingest(document.pk))
    return document


def document_delete(*, document: Document) -> None:
    """Delete a document, its chunks, its share of the BM25 statistics, and its file."""
    with transaction.atomic():
        collection = Collection.objects.select_for_update().get(pk=document.collection_id)
        chunks_remove(document.pk, collection)
        file = document.file
        document.delete()
        transaction.on_commit(lambda: file.delete(save=False))


def document_readers_set(*, document: Document, readers: list[str]) -> Document:
    """Set who may read a document (``search.access.readers_for``): on it and on its chunks,
    in one transaction, so that the next search sees the change and nothing is re-embedded.
    The document's row lock orders this against an ingestion writing its chunks."""
    readers = list(readers)
    with transaction.atomic():
        locked = Document.objects.select_for_update().get(pk=document.pk)
        locked.readers = readers
        locked.save(update_fields=["readers", "updated_at"])
        Chunk.objects.filter(document_id=document.pk).update(readers=readers)
    document.readers = readers
    return document
