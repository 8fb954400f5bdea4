"""Writes for the search app (reads live in ``selectors.py``)."""

from __future__ import annotations

import hashlib
import mimetypes
from pathlib import PurePath

from django.core.files.base import ContentFile
from django.db import IntegrityError, transaction

from search.models import Collection, Document, Workspace

MEDIA_TYPES_BY_SUFFIX = {
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".txt": "text/plain",
    ".html": "text/html",
    ".htm": "text/html",
    ".pdf": "application/pdf",
}


def media_type_guess(source_name: str) -> str:
    suffix = PurePath(source_name).suffix.lower()
    return MEDIA_TYPES_BY_SUFFIX.get(suffix) or mimetypes.guess_type(source_name)[0] or "application/octet-stream"


def workspace_create(*, name: str, slug: str) -> Workspace:
    workspace, _ = Workspace.objects.get_or_create(slug=slug, defaults={"name": name})
    return workspace


def collection_create(*, workspace: Workspace, name: str, description: str = "") -> Collection:
    collection, _ = Collection.objects.get_or_create(
        workspace=workspace, name=name, defaults={"description": description}
    )
    return collection


def document_create(
    *,
    collection: Collection,
    source_name: str,
    content: bytes,
    media_type: str | None = None,
    title: str | None = None,
    metadata: dict | None = None,
) -> tuple[Document, bool]:
    """Store an uploaded file as a queued document; returns ``(document, created)``.

    The same bytes uploaded twice to one collection return the existing document
    (``created`` is False) instead of a duplicate.
    """
    digest = hashlib.sha256(content).hexdigest()
    existing = Document.objects.filter(collection=collection, sha256=digest).first()
    if existing is not None:
        return existing, False
    document = Document(
        collection=collection,
        title=title or PurePath(source_name).stem.replace("-", " ").replace("_", " ").strip() or source_name,
        source_name=source_name,
        media_type=media_type or media_type_guess(source_name),
        size_bytes=len(content),
        sha256=digest,
        metadata=metadata or {},
    )
    try:
        with transaction.atomic():
            document.file.save(PurePath(source_name).name, ContentFile(content), save=False)
            document.save()
    except IntegrityError:
        # A concurrent upload of the same bytes won the race: keep theirs, drop our file.
        document.file.delete(save=False)
        return Document.objects.get(collection=collection, sha256=digest), False
    return document, True
