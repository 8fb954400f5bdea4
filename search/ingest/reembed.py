"""Move a collection to another embedding model without a moment of mixed vectors.

Blue/green: the new model's chunks are written beside the old ones (the chunk key is
document + model + ordinal) while searches keep using the old model, which is still the
collection's. When every document has its new chunks, one transaction switches the
collection to the new model, deletes the old chunks and recomputes the BM25 statistics.
An interrupted run resumes where it stopped: documents that already have chunks of the
new model are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import connection, transaction
from django.db.models import Count

from search.bm25 import collection_bm25_refresh, statistics_rebuild
from search.embedders import embedder_get
from search.ingest.chunk_writes import chunks_insert
from search.ingest.parsers import parse_document
from search.ingest.pipeline import document_bytes, document_chunks, embedding_input
from search.models import Chunk, Collection, Document
from search.vector_indexes import vector_index_ensure


def collection_reembed(
    *, collection_id: int, model: str, on_progress: Callable[[int, int], None] | None = None
) -> Collection:
    """Re-chunk and re-embed every indexed document of a collection with ``model``.

    ``on_progress(done, total)`` is called after each document.
    """
    embedder = embedder_get(model)
    vector_index_ensure(embedder.dimensions)
    collection = Collection.objects.get(pk=collection_id)
    documents = list(Document.objects.filter(collection=collection, status=Document.Status.INDEXED).order_by("pk"))
    done_ids = set(
        Chunk.objects.filter(collection=collection, embedding_model=model).values_list("document_id", flat=True)
    )
    if collection.embedding_model != model:
        for index, document in enumerate(documents, 1):
            if document.pk not in done_ids:
                parsed = parse_document(document_bytes(document), media_type=document.media_type)
                chunks = document_chunks(parsed, embedder)
                vectors = embedder.embed_documents([embedding_input(document.title, chunk) for chunk in chunks])
                with transaction.atomic(), connection.cursor() as cursor:
                    chunks_insert(
                        cursor,
                        collection,
                        [(document.pk, c, v) for c, v in zip(chunks, vectors, strict=True)],
                        embedder,
                    )
            if on_progress:
                on_progress(index, len(documents))
        _switch(collection.pk, model, embedder.dimensions)
    collection_bm25_refresh(collection_id=collection.pk)
    return Collection.objects.get(pk=collection.pk)


def _switch(collection_id: int, model: str, dimensions: int) -> None:
    with transaction.atomic():
        collection = Collection.objects.select_for_update().get(pk=collection_id)
        Chunk.objects.filter(collection=collection).exclude(embedding_model=model).delete()
        with connection.cursor() as cursor:
            chunk_count, lexemes = statistics_rebuild(cursor, collection_id)
        collection.embedding_model = model
        collection.embedding_dimensions = dimensions
        collection.chunk_count = chunk_count
        collection.lexeme_total = lexemes
        collection.save(update_fields=["embedding_model", "embedding_dimensions", "chunk_count", "lexeme_total"])
        counts = dict(
            Chunk.objects.filter(collection=collection)
            .values("document_id")
            .annotate(n=Count("id"))
            .values_list("document_id", "n")
        )
        for document_id, count in counts.items():
            Document.objects.filter(pk=document_id).update(chunks_total=count, chunks_embedded=count)
