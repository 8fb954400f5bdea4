"""Analyse a collection's chunks again: after its language is changed, or after the analysis
itself has (a new dictionary, new rules in ``search.analysis``).

Keyword search ranks each chunk by the terms stored for it (``search_chunk.ts_config`` and, for
a Japanese chunk, ``lexemes``: docs/search.md, "Japanese"), computed once when it was written.
This computes them again from the chunk's text, in batches (each its own transaction, so that
searches keep working, each chunk ranked by its old or its new terms meanwhile), then counts the
collection's term statistics again and recomputes its BM25 weights. Texts and embeddings are
untouched: nothing is parsed or embedded again.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import connection, transaction

from search import analysis
from search.bm25 import collection_bm25_refresh, statistics_rebuild
from search.models import Chunk, Collection

BATCH = 500


def collection_reanalyze(
    *,
    collection_id: int,
    language: str | None = None,
    batch_size: int = BATCH,
    on_progress: Callable[[int, int], None] | None = None,
) -> Collection:
    """Analyse every chunk of the collection again in its language (``language``, when given,
    becomes the collection's first: auto, ja or en); returns the collection as it is after."""
    if language is not None and language not in analysis.LANGUAGES:
        raise ValueError(f"language must be one of {', '.join(analysis.LANGUAGES)}, got {language!r}")
    if language is not None:
        Collection.objects.filter(pk=collection_id).update(language=language)
    collection = Collection.objects.get(pk=collection_id)
    total = Chunk.objects.filter(collection=collection).count()
    done = last = 0
    # By id: chunks that ingestion writes meanwhile come after the last one read, and are read too.
    while rows := list(
        Chunk.objects.filter(collection=collection, pk__gt=last).order_by("pk").values_list("pk", "text")[:batch_size]
    ):
        analysed = [
            analysis.analysed(text, language=collection.language, config=collection.text_search_config)
            for _, text in rows
        ]
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "UPDATE search_chunk c SET ts_config = v.config::regconfig, lexemes = v.lexemes"
                " FROM unnest(%s::bigint[], %s::text[], %s::text[]) AS v(id, config, lexemes) WHERE c.id = v.id",
                [[pk for pk, _ in rows], [config for config, _ in analysed], [lexemes for _, lexemes in analysed]],
            )
        last = rows[-1][0]
        done += len(rows)
        if on_progress:
            on_progress(done, max(total, done))
    with transaction.atomic():
        # Locked as ingestion locks it: no chunk is counted twice or missed.
        collection = Collection.objects.select_for_update().get(pk=collection_id)
        with connection.cursor() as cursor:
            collection.chunk_count, collection.lexeme_total = statistics_rebuild(cursor, collection_id)
        collection.save(update_fields=["chunk_count", "lexeme_total"])
    collection_bm25_refresh(collection_id=collection_id)
    return Collection.objects.get(pk=collection_id)
