"""The write of documents' chunks: one transaction, all of a document's chunks or none.

The chunks come in by binary COPY (a staging table, then one insert that weighs them for
BM25: ``search.bm25``), the collection's term statistics are updated in the same
transaction, and the documents are marked indexed (``search.ingest.status``) before it
commits: a search sees a document entirely or not at all. Running the write twice for
the same document (a redelivered task) writes its chunks once: the write re-checks the
status under a row lock, and the ``(document, model, ordinal)`` constraint backs that up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from django.db import DataError, IntegrityError, connection, transaction
from django.utils import timezone

from ragsite import metrics
from search import analysis, bm25
from search.embedders import Embedder
from search.ingest.chunking import TextChunk
from search.ingest.status import IngestError, document_fail, status_set
from search.models import Collection, Document

logger = logging.getLogger(__name__)

STAGING_TABLE = "search_chunk_staging"


@dataclass
class Prepared:
    """A document ready to be written: its chunks, their vectors, what it will be stored as."""

    document: Document
    chunks: list[TextChunk]
    title: str
    text_sha256: str
    metadata: dict
    embedder: Embedder
    vectors: list[np.ndarray] = field(default_factory=list)
    # Per chunk, how it is indexed for keywords: (text-search configuration, pre-analysed
    # terms or None), by search.analysis; analysed before the write transaction takes its locks.
    analyses: list[tuple[str, str | None]] = field(default_factory=list)


def _register_vector_types() -> None:
    """pgvector's binary COPY support on Django's underlying psycopg connection (once each)."""
    raw = connection.connection
    if not getattr(raw, "_ragsite_vector_registered", False):
        from pgvector.psycopg import register_vector

        register_vector(raw)
        raw._ragsite_vector_registered = True


def chunks_write(
    *,
    document: Document,
    chunks: list[TextChunk],
    vectors: np.ndarray,
    embedder: Embedder,
    text_sha256: str,
    title: str,
    metadata: dict,
) -> bool:
    """Replace one document's chunks and mark it indexed, in one transaction.

    Returns False (and writes nothing) when another delivery of the same task already
    indexed the document while this one was embedding.
    """
    item = Prepared(
        document=document,
        chunks=chunks,
        title=title,
        text_sha256=text_sha256,
        metadata=metadata,
        embedder=embedder,
        vectors=[vectors],
    )
    return _write_one(item)


def _write_one(item: Prepared) -> bool:
    """One document's write in its own transaction; a duplicate text is an ``IngestError``."""
    try:
        return item.document.pk in _chunks_write([item])
    except IntegrityError as exc:
        if "document_unique_text" in str(exc):
            raise IngestError("same text as another document in this collection") from None
        raise


def chunks_write_batch(items: list[Prepared]) -> None:
    """Write the chunks of several documents in one transaction (one disk flush).

    Every document is still all-or-nothing: all its rows are in that transaction. If the
    batch fails on one document's data (a duplicate text, say), each document is written
    again in a transaction of its own, so the others are not held back by it.
    """
    if not items:
        return
    try:
        _chunks_write(items)
    except (IntegrityError, DataError):
        for item in items:
            try:
                _write_one(item)
            except IngestError as exc:
                document_fail(item.document, str(exc))


def _chunks_write(items: list[Prepared]) -> set[int]:
    """The write transaction; returns the ids of the documents it indexed."""
    started = time.perf_counter()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT d.id, d.status, EXISTS (SELECT 1 FROM search_chunk c WHERE c.document_id = d.id)"
            " FROM search_document d WHERE d.id = ANY(%s) ORDER BY d.id FOR UPDATE",
            [[item.document.pk for item in items]],
        )
        state = {pk: (status, has_chunks) for pk, status, has_chunks in cursor.fetchall()}
        # Another delivery of the same task may have finished first: skip those.
        items = [i for i in items if state.get(i.document.pk, ("gone",))[0] not in ("indexed", "gone")]
        if not items:
            return set()
        # The collection row lock serialises writers of one collection: its BM25 statistics
        # and term frequencies stay consistent, and no two writers deadlock on terms.
        by_collection: dict[int, list[Prepared]] = {}
        for item in items:
            by_collection.setdefault(item.document.collection_id, []).append(item)
        collections = {
            c.pk: c for c in Collection.objects.select_for_update().filter(pk__in=by_collection).order_by("pk")
        }
        for collection_id, group in sorted(by_collection.items()):
            collection = collections[collection_id]
            for item in group:
                if state[item.document.pk][1]:
                    chunks_remove(item.document.pk, collection)
            rows = [
                (item.document.pk, chunk, vector)
                for item in group
                for chunk, vector in zip(item.chunks, np.concatenate(item.vectors), strict=True)
            ]
            analyses = (
                [analysis for item in group for analysis in item.analyses]
                if all(len(item.analyses) == len(item.chunks) for item in group)
                else None
            )
            avgdl = chunks_insert(cursor, collection, rows, group[0].embedder, analyses=analyses)
            collection.chunk_count += len(rows)
            collection.lexeme_total += bm25.statistics_add(cursor, collection_id, [item.document.pk for item in group])
            if collection.bm25_avgdl <= 0:
                collection.bm25_avgdl = avgdl
            collection.save(update_fields=["chunk_count", "lexeme_total", "bm25_avgdl"])
        status_set(
            [item.document for item in items],
            Document.Status.INDEXED,
            cursor=cursor,
            error="",
            indexed_at=timezone.now(),
            per_document={
                item.document.pk: {
                    "sha256": item.text_sha256,
                    "title": item.title,
                    "metadata": item.metadata,
                    "chunks_total": len(item.chunks),
                    "chunks_embedded": len(item.chunks),
                }
                for item in items
            },
        )
    logger.info(
        "indexed %s documents, %s chunks; write %.0f ms",
        len(items),
        sum(len(item.chunks) for item in items),
        (time.perf_counter() - started) * 1000,
    )
    metrics.ingest_ended(indexed=len(items), chunks=sum(len(item.chunks) for item in items))
    return {item.document.pk for item in items}


def chunks_analysed(collection: Collection, chunks: list[TextChunk]) -> list[tuple[str, str | None]]:
    """How each chunk is indexed for keywords, in its own language under the collection's setting."""
    return [
        analysis.analysed(chunk.text, language=collection.language, config=collection.text_search_config)
        for chunk in chunks
    ]


def chunks_insert(
    cursor, collection: Collection, rows, embedder: Embedder, *, analyses: list[tuple[str, str | None]] | None = None
) -> float:
    """Binary-COPY ``(document_id, chunk, vector)`` rows into a staging table, then insert
    them with their BM25 weights. ``analyses``: each row's ``chunks_analysed``, analysed
    here when not given.

    Runs inside the caller's transaction; updates no statistics. Returns the average
    chunk length the BM25 weights were computed with.
    """
    # One staging table per connection, emptied at every commit; emptied here too, for
    # callers that write several times in one outer transaction (tests).
    cursor.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS {STAGING_TABLE} (document_id bigint, ordinal int, text text,"
        " start_offset int, end_offset int, token_count int, embedding vector, ts_config text, lexemes text)"
        " ON COMMIT DELETE ROWS"
    )
    cursor.execute(f"DELETE FROM {STAGING_TABLE}")
    _register_vector_types()
    # COPY goes to psycopg directly; wrap it so its errors become Django's. A new cursor:
    # psycopg copies type adapters into a cursor when it is created.
    with (
        connection.wrap_database_errors,
        connection.cursor() as copy_cursor,
        copy_cursor.copy(
            f"COPY {STAGING_TABLE} (document_id, ordinal, text, start_offset, end_offset, token_count,"
            " embedding, ts_config, lexemes) FROM STDIN WITH (FORMAT BINARY)"
        ) as copy,
    ):
        copy.set_types(["int8", "int4", "text", "int4", "int4", "int4", "vector", "text", "text"])
        for (document_id, chunk, vector), (config, lexemes) in _with_analyses(collection, rows, analyses):
            copy.write_row(
                (
                    document_id,
                    chunk.ordinal,
                    chunk.text,
                    chunk.start,
                    chunk.end,
                    chunk.token_count,
                    vector,
                    config,
                    lexemes,
                )
            )
    avgdl = collection.bm25_avgdl
    if avgdl <= 0:  # the collection's first documents set the length normalisation
        avgdl = bm25.staging_avgdl(cursor, STAGING_TABLE)
    # The documents' readers are copied onto their chunks: a change of readers
    # (search.services.document_readers_set) waits for this transaction, or this one for it.
    cursor.execute(
        f"SELECT 1 FROM search_document WHERE id IN (SELECT document_id FROM {STAGING_TABLE}) ORDER BY id FOR SHARE"
    )
    weights = bm25.WEIGHTS.format(tsvector="search_tsvector(s.ts_config::regconfig, coalesce(s.lexemes, s.text))")
    cursor.execute(
        f"""
        INSERT INTO search_chunk (document_id, collection_id, ordinal, text, start_offset, end_offset,
                                  token_count, embedding_model, embedding_dimensions, embedding, ts_config, lexemes,
                                  bm25, readers)
        SELECT s.document_id, %(collection)s, s.ordinal, s.text, s.start_offset, s.end_offset, s.token_count,
               %(model)s, %(dims)s, s.embedding, s.ts_config::regconfig, s.lexemes, {weights}, d.readers
        FROM {STAGING_TABLE} s
        JOIN search_document d ON d.id = s.document_id  -- its readers: the caller holds its row lock
        ORDER BY s.document_id, s.ordinal
        """,
        {
            "collection": collection.pk,
            "model": embedder.name,
            "dims": embedder.dimensions,
            **bm25.weights_params(avgdl),
        },
    )
    return avgdl


def _with_analyses(collection: Collection, rows, analyses):
    """Each row with its analysis: given, or made as the rows come (``rows`` may be a generator)."""
    if analyses is not None:
        yield from zip(rows, analyses, strict=True)
        return
    for row in rows:
        yield row, chunks_analysed(collection, [row[1]])[0]


def chunks_remove(document_id: int, collection: Collection) -> None:
    """Remove a document's chunks and their share of the collection's BM25 statistics.

    Runs inside the caller's transaction with the collection row locked.
    """
    with connection.cursor() as cursor:
        chunk_count, lexemes = bm25.statistics_remove(cursor, collection.pk, document_id, collection.embedding_model)
        # Every copy goes (a re-embedding in progress may have written the new model's too),
        # but only the current model's chunks are in the statistics.
        cursor.execute("DELETE FROM search_chunk WHERE document_id = %s", [document_id])
        if not chunk_count:
            return
        bm25.statistics_prune(cursor, collection.pk)
    collection.chunk_count = max(0, collection.chunk_count - int(chunk_count))
    collection.lexeme_total = max(0, collection.lexeme_total - int(lexemes))
    collection.save(update_fields=["chunk_count", "lexeme_total"])
