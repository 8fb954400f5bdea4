"""A document's status: the one place that writes it (``status_set``), and its progress.

Every change of ``Document.status`` goes through ``status_set``: the pipeline's stages,
a failure with its reason, the write that marks documents indexed, a retry that queues one
again. One statement per call, however many documents, with the other fields each one
changes; the instances passed in are updated to match.
"""

from __future__ import annotations

import json
import logging

from django.db import connection, transaction
from django.utils import timezone

from ragsite import metrics
from search.models import Document

logger = logging.getLogger(__name__)

# The fields a status change may set besides the status, with their SQL types.
_FIELD_TYPES = {
    "error": "text",
    "chunks_total": "int",
    "chunks_embedded": "int",
    "sha256": "text",
    "title": "text",
    "metadata": "jsonb",
    "indexed_at": "timestamptz",
}
# The stages whose commits need not wait for the disk flush: progress is information, not
# data (a crash can lose one, never a chunk); queued, indexed and failed are kept.
_PROGRESS_STAGES = {Document.Status.PARSING, Document.Status.CHUNKING, Document.Status.EMBEDDING}


class IngestError(Exception):
    """A document that cannot be ingested; the message is shown to users as the reason."""


def status_set(
    documents: list[Document],
    status: str,
    *,
    attempt: bool = False,
    per_document: dict[int, dict] | None = None,
    cursor=None,
    **fields,
) -> None:
    """Move ``documents`` to ``status`` in one statement.

    ``fields``: set on every document (``error=""``); ``per_document``: a document's own
    (``{pk: {"chunks_total": 12}}``); ``attempt``: one more attempt counted. With ``cursor``
    the write joins the caller's transaction (the write that indexes the chunks); otherwise
    it commits at once, so that the UI sees the stage while the work goes on.
    """
    if not documents:
        return
    per_document = per_document or {}
    unknown = ({*fields} | {name for values in per_document.values() for name in values}) - set(_FIELD_TYPES)
    if unknown:
        raise ValueError(f"status_set cannot set {sorted(unknown)}")
    now = timezone.now()
    ids = [document.pk for document in documents]
    values = {pk: {**fields, **per_document.get(pk, {})} for pk in ids}
    columns = sorted({name for row in values.values() for name in row})
    arrays = {
        name: [_sql_value(name, values[pk][name]) if name in values[pk] else None for pk in ids] for name in columns
    }
    assignments = ["status = %(status)s", "updated_at = %(now)s"]
    if attempt:
        assignments.append("attempts = d.attempts + 1")
    # A field a document does not change keeps its value (NULL in its array: coalesce).
    assignments += [f"{name} = coalesce(v.{name}::{_FIELD_TYPES[name]}, d.{name})" for name in columns]
    unnested = ", ".join(["%(ids)s::bigint[]", *(f"%({name})s::text[]" for name in columns)])
    sql = (
        f"UPDATE search_document d SET {', '.join(assignments)}"
        f" FROM unnest({unnested}) AS v(id{''.join(', ' + name for name in columns)}) WHERE d.id = v.id"
    )
    params = {"status": status, "now": now, "ids": ids, **arrays}
    if cursor is not None:
        cursor.execute(sql, params)
    else:
        with transaction.atomic(), connection.cursor() as own:
            if status in _PROGRESS_STAGES:
                own.execute("SET LOCAL synchronous_commit = off")
            own.execute(sql, params)
    for document in documents:
        document.status, document.updated_at = status, now
        if attempt:
            document.attempts += 1
        for name, value in values[document.pk].items():
            setattr(document, name, value)


def _sql_value(name: str, value) -> str | None:
    """A field's value as the text its column casts from (NULL keeps the column's value, so
    a field set to None is refused rather than silently kept)."""
    if value is None:
        raise ValueError(f"status_set: {name} cannot be set to None")
    if name == "metadata":
        return json.dumps(value)
    if name == "indexed_at":
        return value.isoformat()
    return str(value)


def document_fail(document: Document, reason: str) -> None:
    """The document failed: its reason kept for users and operators, its progress emptied."""
    status_set([document], Document.Status.FAILED, error=reason[:2000], chunks_embedded=0)
    logger.info("document %s failed: %s", document.pk, reason)
    metrics.ingest_ended(failed=1)


def progress_set(embedded: dict[int, int]) -> None:
    """Chunks embedded so far, per document, in one statement (no wait for the disk flush);
    only while the document is still embedding."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL synchronous_commit = off")
        cursor.execute(
            "UPDATE search_document d SET chunks_embedded = v.n FROM unnest(%s::bigint[], %s::int[]) AS v(id, n)"
            " WHERE d.id = v.id AND d.status = 'embedding'",
            [list(embedded), list(embedded.values())],
        )
