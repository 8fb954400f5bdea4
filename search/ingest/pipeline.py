"""The ingestion pipeline's stages: file -> text -> chunks -> embeddings -> the write.

Each stage is written to ``Document.status`` as it starts (queued -> parsing -> chunking
-> embedding -> indexed, or failed with the reason: ``search.ingest.status``), with chunk
counts for progress. The embedding calls are billed, one ledger row per document. The
write (``search.ingest.chunk_writes``) makes all chunks of a document visible in one
transaction, so a search sees a document entirely or not at all; it keeps the BM25
statistics (``search.bm25``), whose weights are refreshed when the collection's average
chunk length drifts.
"""

from __future__ import annotations

import hashlib
import logging
import time

from celery import signature
from django.conf import settings
from django.db import transaction

from billing import ledger
from search import analysis, bm25
from search.embedders import DEFAULT_EMBEDDER, Embedder, EmbedderError, embedder_get
from search.ingest.chunk_writes import Prepared, chunks_analysed, chunks_write_batch
from search.ingest.chunking import TextChunk, chunk_text
from search.ingest.parsers import ParsedDocument, ParseError, parse_document
from search.ingest.status import IngestError, document_fail, progress_set, status_set
from search.models import Collection, Document
from search.vector_indexes import vector_index_ensure

logger = logging.getLogger(__name__)

# Texts per embedder call: large enough to sort by length and pad little.
EMBED_GROUP = 256


def document_ingest(*, document_id: int) -> Document:
    """Run the whole pipeline for one document; returns it with its final status."""
    return documents_ingest(document_ids=[document_id])[0]


def documents_ingest(*, document_ids: list[int], on_progress=None) -> list[Document]:
    """Ingest several documents; see ``documents_prepare`` and ``documents_write``."""
    documents, prepared = documents_prepare(document_ids=document_ids, on_progress=on_progress)
    documents_write(prepared)
    return [documents[pk] for pk in document_ids]


def documents_write(prepared: list[Prepared]) -> None:
    """Write the prepared documents' chunks (one transaction) and schedule BM25 upkeep."""
    chunks_write_batch([item for item in prepared if item.document.status != Document.Status.FAILED])
    collection_ids = {item.document.collection_id for item in prepared}
    for collection in Collection.objects.filter(pk__in=collection_ids).order_by("pk"):
        if bm25.avgdl_drifted(collection):
            # By the task's name: tasks sit above the pipeline they run (docs/architecture.md).
            refresh = signature("search.tasks.collection_bm25_refresh", args=(collection.pk,))
            transaction.on_commit(refresh.delay)


def documents_prepare(*, document_ids: list[int], on_progress=None) -> tuple[dict[int, Document], list[Prepared]]:
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
    status_set(todo, Document.Status.PARSING, attempt=True, error="")

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

    status_set([document for document, _, _ in parsed], Document.Status.CHUNKING)
    prepared: list[Prepared] = []
    # One instance of each collection for the batch: its embedder is settled once, by its first document.
    collections: dict[int, Collection] = {}
    for document, result, digest in parsed:
        try:
            if document.pk in duplicates:
                raise IngestError(duplicates[document.pk])
            if document.collection_id not in collections:
                collection_embedder_settle(document.collection, result.text)  # an EmbedderError: the next tries
                collections[document.collection_id] = document.collection
            document.collection = collections[document.collection_id]
            prepared.append(_prepare(document, result, digest))
        except (IngestError, EmbedderError) as exc:
            document_fail(document, str(exc))

    status_set(
        [item.document for item in prepared],
        Document.Status.EMBEDDING,
        per_document={item.document.pk: {"chunks_total": len(item.chunks), "chunks_embedded": 0} for item in prepared},
    )
    _embed_all(prepared, on_progress)
    return documents, prepared


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


def collection_embedder_settle(collection: Collection, text: str) -> None:
    """A new collection's embedder, chosen by its first document's language: a collection
    that reads Japanese (``auto`` or ``ja``) and holds nothing yet moves from the default,
    English-only embedder to ``EMBEDDING_MODEL_JAPANESE``. Called once per collection and batch
    (``documents_prepare``). One conditional UPDATE: of two workers preparing a new collection's
    first documents, the first decides for both."""
    if collection.chunk_count:
        return
    # Another worker's batch may have decided already.
    collection.refresh_from_db(fields=["embedding_model", "embedding_dimensions"])
    if (
        collection.embedding_model != DEFAULT_EMBEDDER
        or settings.EMBEDDING_MODEL_JAPANESE == DEFAULT_EMBEDDER
        or analysis.language_resolved(collection.language, text) != analysis.JAPANESE
    ):
        return
    embedder = embedder_get(settings.EMBEDDING_MODEL_JAPANESE)
    vector_index_ensure(embedder.dimensions)  # an API model's dimensions may have no index yet
    Collection.objects.filter(
        pk=collection.pk, chunk_count=0, embedding_model=DEFAULT_EMBEDDER, chunks__isnull=True
    ).update(embedding_model=embedder.name, embedding_dimensions=embedder.dimensions)
    collection.refresh_from_db(fields=["embedding_model", "embedding_dimensions"])


def _prepare(document: Document, parsed: ParsedDocument, text_sha256: str) -> Prepared:
    """Chunk one parsed document with its collection's embedder's tokenizer."""
    embedder = embedder_get(document.collection.embedding_model)
    chunks = document_chunks(parsed, embedder)
    if not chunks:
        raise IngestError("no text to index after chunking")
    title = document.title
    if parsed.title and document.metadata.get("title_from") != "user":
        title = parsed.title[:500]
    return Prepared(
        document=document,
        chunks=chunks,
        title=title,
        text_sha256=text_sha256,
        metadata={**document.metadata, **parsed.metadata},
        embedder=embedder,
        analyses=chunks_analysed(document.collection, chunks),
    )


def _embed_all(prepared: list[Prepared], on_progress) -> None:
    """Embed every chunk of every prepared document, EMBED_GROUP texts per model call.

    Large calls let the embedder sort texts by length and pad little; progress is
    written to each document as its chunks come back.
    """
    by_embedder: dict[str, list[tuple[Prepared, TextChunk]]] = {}
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
            touched: dict[int, Prepared] = {}
            for (item, _chunk), vector in zip(group, vectors, strict=True):
                item.vectors.append(vector[None, :])
                touched[item.document.pk] = item
            progress_set({pk: len(item.vectors) for pk, item in touched.items()})
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

    def add(self, group: list[tuple[Prepared, TextChunk]], elapsed_ms: float) -> None:
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


def interruptions_key(document_id: int) -> str:
    """The count of deliveries of a document's ingestion that were cut off (search.tasks)."""
    return f"ingest:interrupted:{document_id}"
