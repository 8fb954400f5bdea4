"""Writes for the search app (reads live in ``selectors.py``)."""

from __future__ import annotations

import hashlib
from pathlib import PurePath

from django.conf import settings
from django.core.files.base import ContentFile
from django.db import IntegrityError, transaction

from search.embedders import DEFAULT_EMBEDDER, embedder_get
from search.ingest.parsers import ParseError, sniff_media_type
from search.models import Collection, Document, Workspace
from search.vector_indexes import vector_index_ensure


class DocumentRejected(Exception):
    """An upload refused before it is stored; the message says why."""


def workspace_create(*, name: str, slug: str) -> Workspace:
    workspace, _ = Workspace.objects.get_or_create(slug=slug, defaults={"name": name})
    return workspace


def collection_create(
    *,
    workspace: Workspace,
    name: str,
    description: str = "",
    embedding_model: str = DEFAULT_EMBEDDER,
    text_search_config: str = "english",
) -> Collection:
    """Get or create a collection; a new one gets a vector index for its model's dimension."""
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
        },
    )
    return collection


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
    enqueue: bool = True,
) -> tuple[Document, bool]:
    """Store an upload as a queued document and enqueue its ingestion; returns ``(document, created)``.

    The same bytes uploaded twice to one collection return the existing document
    (``created`` is False). Files that are empty, too large or of an unsupported type
    are refused with ``DocumentRejected`` before anything is stored. ``enqueue=False``
    leaves ingestion to the caller (bulk loads run the pipeline in-process).
    """
    if len(content) > settings.DOCUMENT_MAX_BYTES:
        raise DocumentRejected(
            f"{source_name} is {len(content)} bytes, over the limit of {settings.DOCUMENT_MAX_BYTES} bytes"
        )
    try:
        media_type = sniff_media_type(content, source_name)
    except ParseError as exc:
        raise DocumentRejected(f"{source_name}: {exc}") from None
    digest = hashlib.sha256(content).hexdigest()
    existing = Document.objects.filter(collection=collection, content_sha256=digest).first()
    if existing is not None:
        return existing, False
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
    )
    try:
        with transaction.atomic():
            document.file.save(_storage_name(source_name, digest), ContentFile(content), save=False)
            document.save()
            if enqueue:
                transaction.on_commit(lambda: _enqueue_ingest(document.pk))
    except IntegrityError:
        # A concurrent upload of the same bytes won the race: keep theirs, drop our file.
        document.file.delete(save=False)
        return Document.objects.get(collection=collection, content_sha256=digest), False
    return document, True


def _storage_name(source_name: str, digest: str) -> str:
    """A safe file name for storage: the content hash plus a sanitised suffix.

    The user's file name is kept in ``source_name`` only; it never becomes a path, so
    names like ``../../etc/passwd`` or control characters cannot escape the storage folder.
    """
    suffix = "".join(ch for ch in PurePath(source_name).suffix.lower() if ch.isalnum() or ch == ".")[:10]
    return f"{digest[:32]}{suffix}"


def _enqueue_ingest(document_id: int) -> None:
    from search.tasks import document_ingest

    document_ingest.delay(document_id)


def document_retry(*, document: Document) -> Document:
    """Queue a failed document for another attempt."""
    if document.status != Document.Status.FAILED:
        return document
    Document.objects.filter(pk=document.pk).update(status=Document.Status.QUEUED, error="", chunks_embedded=0)
    document.refresh_from_db()
    transaction.on_commit(lambda: _enqueue_ingest(document.pk))
    return document


def document_delete(*, document: Document) -> None:
    """Delete a document, its chunks, its share of the BM25 statistics, and its file."""
    from search.ingest.pipeline import chunks_remove

    with transaction.atomic():
        collection = Collection.objects.select_for_update().get(pk=document.collection_id)
        chunks_remove(document.pk, collection)
        file = document.file
        document.delete()
        transaction.on_commit(lambda: file.delete(save=False))
