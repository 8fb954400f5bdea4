"""The ingestion pipeline: file -> text -> chunks -> embeddings -> one transaction.

Stages are written to ``Document.status`` as they start (queued -> parsing -> chunking
-> embedding -> indexed, or failed with the reason), with chunk counts for progress.
All chunks of a document become visible in a single transaction, so a search sees a
document entirely or not at all. Running the pipeline twice for the same document (a
redelivered task) writes its chunks once: the write re-checks the status under a row
lock and the ``(document, model, ordinal)`` constraint backs that up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np
from celery import signature
from django.conf import settings
from django.db import DataError, IntegrityError, connection, transaction
from django.utils import timezone

from billing import ledger
from ragsite import metrics
from search.embedders import Embedder, EmbedderError, embedder_get
from search.ingest.chunking import TextChunk, chunk_text
from search.ingest.parsers import ParsedDocument, ParseError, parse_document
from search.models import Collection, Document

logger = logging.getLogger(__name__)

# Texts per embedder call: large enough to sort by length and pad little.
EMBED_GROUP = 256
# Re-weigh a collection's BM25 vectors when its average chunk length has drifted this far
# from the one the stored weights were computed with.
AVGDL_DRIFT_LIMIT = 0.2


class IngestError(Exception):
    """A document that cannot be ingested; the message is shown to users as the reason."""


def _set_status(document: Document, status: str, **fields) -> None:
    """Write a stage change at once (autocommit), so the UI sees progress while we work."""
    fields["status"] = status
    fields["updated_at"] = timezone.now()
    Document.objects.filter(pk=document.pk).update(**fields)
    for name, value in fields.items():
        setattr(document, name, value)


def document_fail(document: Document, reason: str) -> None:
    _set_status(document, Document.Status.FAILED, error=reason[:2000], chunks_embedded=0)
    logger.info("document %s failed: %s", document.pk, reason)
    metrics.ingest_ended(failed=1)


@dataclass
class _Prepared:
    document: Document
    chunks: list[TextChunk]
    title: str
    text_sha256: str
    metadata: dict
    embedder: Embedder
    vectors: list[np.ndarray] = field(default_factory=list)


def document_ingest(*, document_id: int) -> Document:
    """Run the whole pipeline for one document; returns it with its final status."""
    return documents_ingest(document_ids=[document_id])[0]


def documents_ingest(*, document_ids: list[int], on_progress=None) -> list[Document]:
    """Ingest several documents; see ``documents_prepare`` and ``documents_write``."""
    documents, prepared = documents_prepare(document_ids=document_ids, on_progress=on_progress)
    documents_write(prepared)
    return [documents[pk] for pk in document_ids]


def documents_write(prepared: list[_Prepared]) -> None:
    """Write the prepared documents' chunks (one transaction) and schedule BM25 upkeep."""
    chunks_write_batch([item for item in prepared if item.document.status != Document.Status.FAILED])
    for collection_id in {item.document.collection_id for item in prepared}:
        _refresh_bm25_if_drifted(collection_id)


def documents_prepare(*, document_ids: list[int], on_progress=None) -> tuple[dict[int, Document], list[_Prepared]]:
    """Parse, chunk and embed several documents; their chunks are embedded together in large calls.

    Each document fails on its own: bad input (unreadable files, duplicates, unknown
    embedders) ends as ``failed`` with a reason while the others go on. Infrastructure
    errors (database, broker) propagate so that the task is retried. Stage changes are
    written for the whole batch at once, one statement per stage; ``on_progress(chunks_done)``
    is called as embedding calls finish. ``documents_write`` then commits the result.
    """
    documents = {d.pk: d for d in Document.objects.select_related("collection").filter(pk__in=document_ids)}
    missing = [pk for pk in document_ids if pk not in documents]
    if missing:
        raise Document.DoesNotExist(f"documents {missing} do not exist")
    # An indexed document is a redelivered task after success: nothing to do.
    todo = [documents[pk] for pk in document_ids if documents[pk].status != Document.Status.INDEXED]
    _stage_update(todo, Document.Status.PARSING, attempts=True)

    parsed: list[tuple[Document, ParsedDocument, str]] = []
    for document in todo:
        try:
            result = parse_document(document_bytes(document), media_type=document.media_type)
            parsed.append((document, result, hashlib.sha256(result.text.encode()).hexdigest()))
        except (ParseError, IngestError) as exc:
            document_fail(document, str(exc))
        except Exception as exc:  # a library's unexpected error on hostile input fails the file, not the task
            logger.exception("document %s: the parser failed unexpectedly", document.pk)
            document_fail(
                document, f"the file could not be parsed: {type(exc).__name__} in the {document.media_type} parser"
            )
    duplicates = _duplicates_of([(document, digest) for document, _, digest in parsed])

    _stage_update([document for document, _, _ in parsed], Document.Status.CHUNKING)
    prepared: list[_Prepared] = []
    for document, result, digest in parsed:
        try:
            if document.pk in duplicates:
                raise IngestError(duplicates[document.pk])
            prepared.append(_prepare(document, result, digest))
        except (IngestError, EmbedderError) as exc:
            document_fail(document, str(exc))

    _stage_update([item.document for item in prepared], Document.Status.EMBEDDING, prepared=prepared)
    _embed_all(prepared, on_progress)
    return documents, prepared


def _stage_update(
    documents: list[Document], status: str, *, attempts: bool = False, prepared: list[_Prepared] | None = None
) -> None:
    """Move a batch of documents to a stage in one statement.

    Progress is information, not data: these commits skip the wait for the disk flush
    (``synchronous_commit = off``); a crash can lose one, never a chunk.
    """
    if not documents:
        return
    now = timezone.now()
    ids = [document.pk for document in documents]
    totals = {item.document.pk: len(item.chunks) for item in prepared or []}
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL synchronous_commit = off")
        cursor.execute(
            """
            UPDATE search_document d
            SET status = %(status)s, updated_at = %(now)s,
                attempts = d.attempts + %(attempt)s,
                error = CASE WHEN %(attempt)s = 1 THEN '' ELSE d.error END,
                chunks_total = coalesce(v.total, d.chunks_total),
                chunks_embedded = CASE WHEN v.total IS NULL THEN d.chunks_embedded ELSE 0 END
            FROM unnest(%(ids)s::bigint[], %(totals)s::int[]) AS v(id, total)
            WHERE d.id = v.id
            """,
            {
                "status": status,
                "now": now,
                "attempt": 1 if attempts else 0,
                "ids": ids,
                "totals": [totals.get(pk) for pk in ids],
            },
        )
    for document in documents:
        document.status = status
        document.updated_at = now
        if attempts:
            document.attempts += 1
            document.error = ""
        if document.pk in totals:
            document.chunks_total, document.chunks_embedded = totals[document.pk], 0


def _duplicates_of(items: list[tuple[Document, str]]) -> dict[int, str]:
    """Reasons for documents whose normalised text another document of the collection already has."""
    if not items:
        return {}
    existing = {}
    for pk, collection_id, digest, title in Document.objects.filter(
        sha256__in={digest for _, digest in items}
    ).values_list("pk", "collection_id", "sha256", "title"):
        existing.setdefault((collection_id, digest), (pk, title))
    reasons = {}
    for document, digest in items:
        match = existing.get((document.collection_id, digest))
        if match and match[0] != document.pk:
            reasons[document.pk] = f"same text as document {match[0]} ({match[1]}) in this collection"
    return reasons


def document_chunks(parsed: ParsedDocument, embedder: Embedder) -> list[TextChunk]:
    """A parsed document's chunks, sized in the embedder's own tokens."""
    return chunk_text(
        parsed.text,
        tokenize=embedder.token_offsets,
        max_tokens=embedder.max_tokens,
        overlap_tokens=settings.CHUNK_OVERLAP_TOKENS,
        headings=parsed.headings,
    )


def _prepare(document: Document, parsed: ParsedDocument, text_sha256: str) -> _Prepared:
    """Chunk one parsed document with its collection's embedder's tokenizer."""
    embedder = embedder_get(document.collection.embedding_model)
    chunks = document_chunks(parsed, embedder)
    if not chunks:
        raise IngestError("no text to index after chunking")
    title = document.title
    if parsed.title and document.metadata.get("title_from") != "user":
        title = parsed.title[:500]
    return _Prepared(
        document=document,
        chunks=chunks,
        title=title,
        text_sha256=text_sha256,
        metadata={**document.metadata, **parsed.metadata},
        embedder=embedder,
    )


def _embed_all(prepared: list[_Prepared], on_progress) -> None:
    """Embed every chunk of every prepared document, EMBED_GROUP texts per model call.

    Large calls let the embedder sort texts by length and pad little; progress is
    written to each document as its chunks come back.
    """
    by_embedder: dict[str, list[tuple[_Prepared, TextChunk]]] = {}
    for item in prepared:
        for chunk in item.chunks:
            by_embedder.setdefault(item.embedder.name, []).append((item, chunk))
    done = 0
    usage = _EmbeddingUsage()
    for pairs in by_embedder.values():
        embedder = pairs[0][0].embedder
        for start in range(0, len(pairs), EMBED_GROUP):
            group = pairs[start : start + EMBED_GROUP]
            failed: set[int] = set()
            started = time.perf_counter()
            try:
                vectors = embedder.embed_documents([embedding_input(item.title, chunk) for item, chunk in group])
            except EmbedderError as exc:
                for item, _ in group:
                    if item.document.pk not in failed:
                        failed.add(item.document.pk)
                        document_fail(item.document, str(exc))
                continue
            usage.add(group, (time.perf_counter() - started) * 1000)
            if vectors.shape != (len(group), embedder.dimensions):
                raise IngestError(f"the embedder returned {vectors.shape} for {len(group)} chunks")
            touched: dict[int, _Prepared] = {}
            for (item, _chunk), vector in zip(group, vectors, strict=True):
                item.vectors.append(vector[None, :])
                touched[item.document.pk] = item
            _progress_update({pk: len(item.vectors) for pk, item in touched.items()})
            done += len(group)
            if on_progress:
                on_progress(done)
    usage.record()


class _EmbeddingUsage:
    """One ledger row per document for its embedding calls: its chunks' tokens, and its
    share of each call's time (by its chunks in the call). Recorded once the calls were
    made, whatever happens to the document next: the work was done."""

    def __init__(self):
        self.per_document: dict[int, list] = {}  # pk -> [item, tokens, ms]

    def add(self, group: list[tuple[_Prepared, TextChunk]], elapsed_ms: float) -> None:
        for item, chunk in group:
            entry = self.per_document.setdefault(item.document.pk, [item, 0, 0.0])
            entry[1] += chunk.token_count
            entry[2] += elapsed_ms / len(group)

    def record(self) -> None:
        rows = [
            ledger.embedding_row(
                model=item.embedder.name,
                tokens=tokens,
                latency_ms=ms,
                workspace_id=item.document.collection.workspace_id,
            )
            for item, tokens, ms in self.per_document.values()
        ]
        try:
            ledger.usage_records_queue(rows)
        except Exception:  # the index must not fail over its bookkeeping; say so loudly
            logger.exception("the embedding usage of %d documents could not be queued", len(rows))


def _progress_update(embedded: dict[int, int]) -> None:
    """Chunks embedded so far, per document, in one statement (no wait for the disk flush)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL synchronous_commit = off")
        cursor.execute(
            "UPDATE search_document d SET chunks_embedded = v.n FROM unnest(%s::bigint[], %s::int[]) AS v(id, n)"
            " WHERE d.id = v.id AND d.status = 'embedding'",
            [list(embedded), list(embedded.values())],
        )


def document_bytes(document: Document) -> bytes:
    try:
        with document.file.open("rb") as handle:
            data = handle.read(settings.DOCUMENT_MAX_BYTES + 1)
    except FileNotFoundError:
        raise IngestError("the uploaded file is missing from storage") from None
    if len(data) > settings.DOCUMENT_MAX_BYTES:
        raise IngestError(f"the file is larger than the limit of {settings.DOCUMENT_MAX_BYTES} bytes")
    return data


def embedding_input(title: str, chunk: TextChunk) -> str:
    """What the embedder reads for a chunk: the document title, then the passage.

    A passage from the middle of a document often never names its subject; the title
    gives the vector that context. The stored chunk text stays an exact slice.
    """
    if not title or chunk.text.startswith(title):
        return chunk.text
    return f"{title}\n{chunk.text}"


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
    item = _Prepared(
        document=document,
        chunks=chunks,
        title=title,
        text_sha256=text_sha256,
        metadata=metadata,
        embedder=embedder,
        vectors=[vectors],
    )
    try:
        return document.pk in _chunks_write([item])
    except IntegrityError as exc:
        if "document_unique_text" in str(exc):
            raise IngestError("same text as another document in this collection") from None
        raise


def chunks_write_batch(items: list[_Prepared]) -> None:
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
                chunks_write(
                    document=item.document,
                    chunks=item.chunks,
                    vectors=np.concatenate(item.vectors),
                    embedder=item.embedder,
                    text_sha256=item.text_sha256,
                    title=item.title,
                    metadata=item.metadata,
                )
            except IngestError as exc:
                document_fail(item.document, str(exc))


def _chunks_write(items: list[_Prepared]) -> set[int]:
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
        by_collection: dict[int, list[_Prepared]] = {}
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
            avgdl = chunks_insert(cursor, collection, rows, group[0].embedder)
            cursor.execute(
                """
                WITH terms AS (
                    SELECT DISTINCT c.id, search_term_index(u.lexeme) AS term,
                           coalesce(array_length(u.positions, 1), 1) AS tf, u.lexeme
                    FROM search_chunk c, unnest(c.tsv) u
                    WHERE c.document_id = ANY(%(documents)s) AND search_bm25_lexeme(u.lexeme)
                ), added AS (
                    INSERT INTO search_termstat (collection_id, term, df)
                    SELECT %(collection)s, term, count(DISTINCT id) FROM terms GROUP BY term ORDER BY term
                    ON CONFLICT (collection_id, term) DO UPDATE SET df = search_termstat.df + EXCLUDED.df
                )
                SELECT coalesce(sum(tf), 0) FROM terms
                """,
                {"documents": [item.document.pk for item in group], "collection": collection_id},
            )
            collection.chunk_count += len(rows)
            collection.lexeme_total += int(cursor.fetchone()[0])
            if collection.bm25_avgdl <= 0:
                collection.bm25_avgdl = avgdl
            collection.save(update_fields=["chunk_count", "lexeme_total", "bm25_avgdl"])
        now = timezone.now()
        cursor.execute(
            """
            UPDATE search_document d
            SET status = 'indexed', error = '', sha256 = v.sha256, title = v.title, metadata = v.metadata::jsonb,
                chunks_total = v.chunks, chunks_embedded = v.chunks, indexed_at = %(now)s, updated_at = %(now)s
            FROM unnest(%(ids)s::bigint[], %(sha256)s::text[], %(titles)s::text[], %(metadata)s::text[],
                        %(chunks)s::int[]) AS v(id, sha256, title, metadata, chunks)
            WHERE d.id = v.id
            """,
            {
                "now": now,
                "ids": [item.document.pk for item in items],
                "sha256": [item.text_sha256 for item in items],
                "titles": [item.title for item in items],
                "metadata": [json.dumps(item.metadata) for item in items],
                "chunks": [len(item.chunks) for item in items],
            },
        )
    for item in items:
        document = item.document
        document.status, document.error, document.sha256 = Document.Status.INDEXED, "", item.text_sha256
        document.title, document.metadata, document.indexed_at = item.title, item.metadata, now
        document.chunks_total = document.chunks_embedded = len(item.chunks)
    logger.info(
        "indexed %s documents, %s chunks; write %.0f ms",
        len(items),
        sum(len(item.chunks) for item in items),
        (time.perf_counter() - started) * 1000,
    )
    metrics.ingest_ended(indexed=len(items), chunks=sum(len(item.chunks) for item in items))
    return {item.document.pk for item in items}


def chunks_insert(cursor, collection: Collection, rows, embedder: Embedder) -> float:
    """Binary-COPY ``(document_id, chunk, vector)`` rows into a staging table, then insert
    them with their BM25 weights.

    Runs inside the caller's transaction; updates no statistics. Returns the average
    chunk length the BM25 weights were computed with.
    """
    # One staging table per connection, emptied at every commit; emptied here too, for
    # callers that write several times in one outer transaction (tests).
    cursor.execute(
        "CREATE TEMP TABLE IF NOT EXISTS search_chunk_staging (document_id bigint, ordinal int, text text,"
        " start_offset int, end_offset int, token_count int, embedding vector) ON COMMIT DELETE ROWS"
    )
    cursor.execute("DELETE FROM search_chunk_staging")
    _register_vector_types()
    # COPY goes to psycopg directly; wrap it so its errors become Django's. A new cursor:
    # psycopg copies type adapters into a cursor when it is created.
    with (
        connection.wrap_database_errors,
        connection.cursor() as copy_cursor,
        copy_cursor.copy(
            "COPY search_chunk_staging (document_id, ordinal, text, start_offset, end_offset, token_count,"
            " embedding) FROM STDIN WITH (FORMAT BINARY)"
        ) as copy,
    ):
        copy.set_types(["int8", "int4", "text", "int4", "int4", "int4", "vector"])
        for document_id, chunk, vector in rows:
            copy.write_row((document_id, chunk.ordinal, chunk.text, chunk.start, chunk.end, chunk.token_count, vector))
    params = {
        "config": collection.text_search_config,
        "collection": collection.pk,
        "model": embedder.name,
        "dims": embedder.dimensions,
        "k1": settings.BM25_K1,
        "b": settings.BM25_B,
    }
    avgdl = collection.bm25_avgdl
    if avgdl <= 0:
        # The collection's first documents set the length normalisation.
        cursor.execute(
            "SELECT avg((SELECT sum(coalesce(array_length(u.positions, 1), 1))"
            " FROM unnest(search_tsvector(%(config)s::regconfig, s.text)) u"
            " WHERE search_bm25_lexeme(u.lexeme))) FROM search_chunk_staging s",
            params,
        )
        avgdl = float(cursor.fetchone()[0] or 1.0)
    params["avgdl"] = avgdl
    cursor.execute(
        """
        INSERT INTO search_chunk (document_id, collection_id, ordinal, text, start_offset, end_offset,
                                  token_count, embedding_model, embedding_dimensions, embedding, ts_config, bm25)
        SELECT s.document_id, %(collection)s, s.ordinal, s.text, s.start_offset, s.end_offset, s.token_count,
               %(model)s, %(dims)s, s.embedding, %(config)s::regconfig,
               search_bm25_document_vector(search_tsvector(%(config)s::regconfig, s.text), %(avgdl)s, %(k1)s, %(b)s)
        FROM search_chunk_staging s
        ORDER BY s.document_id, s.ordinal
        """,
        params,
    )
    return avgdl


def chunks_remove(document_id: int, collection: Collection) -> None:
    """Remove a document's chunks and their share of the collection's BM25 statistics.

    Runs inside the caller's transaction with the collection row locked.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH terms AS (
                SELECT DISTINCT c.id, search_term_index(u.lexeme) AS term,
                       coalesce(array_length(u.positions, 1), 1) AS tf, u.lexeme
                FROM search_chunk c, unnest(c.tsv) u
                WHERE c.document_id = %(document)s AND c.embedding_model = %(model)s
                  AND search_bm25_lexeme(u.lexeme)
            ), removed AS (
                UPDATE search_termstat t SET df = t.df - r.n
                FROM (SELECT term, count(DISTINCT id) AS n FROM terms GROUP BY term) r
                WHERE t.collection_id = %(collection)s AND t.term = r.term
            )
            SELECT (SELECT count(*) FROM search_chunk WHERE document_id = %(document)s AND embedding_model = %(model)s),
                   coalesce(sum(tf), 0)
            FROM terms
            """,
            {"document": document_id, "collection": collection.pk, "model": collection.embedding_model},
        )
        chunk_count, lexemes = cursor.fetchone()
        # Every copy goes (a re-embedding in progress may have written the new model's too),
        # but only the current model's chunks are in the statistics.
        cursor.execute("DELETE FROM search_chunk WHERE document_id = %s", [document_id])
        if not chunk_count:
            return
        cursor.execute("DELETE FROM search_termstat WHERE collection_id = %s AND df <= 0", [collection.pk])
    collection.chunk_count = max(0, collection.chunk_count - int(chunk_count))
    collection.lexeme_total = max(0, collection.lexeme_total - int(lexemes))
    collection.save(update_fields=["chunk_count", "lexeme_total"])


def collection_statistics_rebuild(cursor, collection_id: int) -> tuple[int, int]:
    """Recompute a collection's term frequencies from its chunks; returns (chunks, counted lexemes).

    For bulk loads and model switches, where counting once beats updating per document.
    Runs inside the caller's transaction.
    """
    cursor.execute("DELETE FROM search_termstat WHERE collection_id = %s", [collection_id])
    cursor.execute(
        """
        WITH terms AS (
            SELECT c.id, search_term_index(u.lexeme) AS term, coalesce(array_length(u.positions, 1), 1) AS tf
            FROM search_chunk c, unnest(c.tsv) u
            WHERE c.collection_id = %(collection)s AND search_bm25_lexeme(u.lexeme)
        ), added AS (
            INSERT INTO search_termstat (collection_id, term, df)
            SELECT %(collection)s, term, count(DISTINCT id) FROM terms GROUP BY term ORDER BY term
        )
        SELECT (SELECT count(*) FROM search_chunk WHERE collection_id = %(collection)s), coalesce(sum(tf), 0)
        FROM terms
        """,
        {"collection": collection_id},
    )
    chunks, lexemes = cursor.fetchone()
    return int(chunks), int(lexemes)


def interruptions_key(document_id: int) -> str:
    """The count of deliveries of a document's ingestion that were cut off (search.tasks)."""
    return f"ingest:interrupted:{document_id}"


def _refresh_bm25_if_drifted(collection_id: int) -> None:
    collection = Collection.objects.get(pk=collection_id)
    if not collection.chunk_count or collection.bm25_avgdl <= 0:
        return
    current = collection.lexeme_total / collection.chunk_count
    if abs(current - collection.bm25_avgdl) / collection.bm25_avgdl > AVGDL_DRIFT_LIMIT:
        # By the task's name: tasks sit above the pipeline they run (docs/architecture.md).
        transaction.on_commit(lambda: signature("search.tasks.collection_bm25_refresh", args=(collection_id,)).delay())


def collection_bm25_refresh(*, collection_id: int, batch_size: int = 5000) -> float:
    """Recompute every chunk's BM25 weights with the collection's current average length.

    Runs in batches (each its own transaction) so that searches keep working; returns the
    new average length.
    """
    collection = Collection.objects.get(pk=collection_id)
    avgdl = collection.lexeme_total / collection.chunk_count if collection.chunk_count else 0.0
    if avgdl <= 0:
        return 0.0
    last_id = 0
    while True:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                """
                WITH batch AS (
                    SELECT id FROM search_chunk WHERE collection_id = %(collection)s AND id > %(last)s
                    ORDER BY id LIMIT %(size)s
                )
                UPDATE search_chunk c
                SET bm25 = search_bm25_document_vector(c.tsv, %(avgdl)s, %(k1)s, %(b)s)
                FROM batch WHERE c.id = batch.id
                RETURNING c.id
                """,
                {
                    "collection": collection_id,
                    "last": last_id,
                    "size": batch_size,
                    "avgdl": avgdl,
                    "k1": settings.BM25_K1,
                    "b": settings.BM25_B,
                },
            )
            ids = [row[0] for row in cursor.fetchall()]
        if not ids:
            break
        last_id = max(ids)
    Collection.objects.filter(pk=collection_id).update(bm25_avgdl=avgdl)
    return avgdl
