"""One partial HNSW index per embedding dimension.

The ``embedding`` column has no fixed dimension because collections may use different
models. pgvector indexes need one, so each dimension in use gets a partial index over
``embedding::halfvec(N)`` restricted to ``embedding_dimensions = N``. Queries repeat the
same expression and predicate (see ``dense_distance_sql``) so the planner can use it.
halfvec halves the index size and build time; the recall cost is negligible for
normalised sentence embeddings (measured in benchmarks/search_scale.py).
"""

from __future__ import annotations

import time

from django.db import connection

HNSW_M = 16
HNSW_EF_CONSTRUCTION = 64
MAX_INDEXED_DIMENSIONS = 4000  # pgvector's HNSW limit for halfvec


def index_name(dimensions: int) -> str:
    return f"chunk_embedding_{int(dimensions)}_hnsw"


def create_index_sql(dimensions: int, *, concurrently: bool = False) -> str:
    dimensions = int(dimensions)
    if not 0 < dimensions <= MAX_INDEXED_DIMENSIONS:
        raise ValueError(
            f"cannot index {dimensions}-dimensional embeddings (HNSW supports 1..{MAX_INDEXED_DIMENSIONS})"
        )
    return (
        f"CREATE INDEX {'CONCURRENTLY ' if concurrently else ''}IF NOT EXISTS {index_name(dimensions)} "
        f"ON search_chunk USING hnsw ((embedding::halfvec({dimensions})) halfvec_cosine_ops) "
        f"WITH (m = {HNSW_M}, ef_construction = {HNSW_EF_CONSTRUCTION}) "
        f"WHERE embedding_dimensions = {dimensions}"
    )


def dense_distance_sql(dimensions: int, query_param: str = "%(query_vector)s") -> str:
    """The cosine-distance expression that matches the partial index for ``dimensions``."""
    dimensions = int(dimensions)
    return f"(c.embedding::halfvec({dimensions}) <=> {query_param}::halfvec({dimensions}))"


def vector_index_ensure(dimensions: int) -> None:
    """Create the index for a dimension if missing (called when a collection adopts a model)."""
    with connection.cursor() as cursor:
        cursor.execute(create_index_sql(dimensions))


# BM25 vectors get an HNSW index too (inner product on sparse vectors), but only once the
# chunk table is large. An exact keyword ranking scores every chunk holding any query word:
# for common words that is half of a large collection (120 ms at 100,000 chunks), and the
# index finds the best inner products in a few milliseconds instead. Maintaining it costs
# about 4 ms per inserted chunk here (a fifth of embedding it), which small installations
# should not pay: `search_indexes_maintain` creates it when the table passes the threshold.
# pgvector indexes sparse vectors of at most 1000 non-zero elements (see the BM25 function).
BM25_INDEX_NAME = "chunk_bm25_hnsw"
_bm25_index_seen: tuple[float, bool] = (0.0, False)


def create_bm25_index_sql(*, concurrently: bool = False) -> str:
    return (
        f"CREATE INDEX {'CONCURRENTLY ' if concurrently else ''}IF NOT EXISTS {BM25_INDEX_NAME} "
        f"ON search_chunk USING hnsw (bm25 sparsevec_ip_ops) "
        f"WITH (m = {HNSW_M}, ef_construction = {HNSW_EF_CONSTRUCTION})"
    )


def bm25_index_exists() -> bool:
    """Whether the BM25 HNSW index exists and is valid (looked up at most once a minute)."""
    global _bm25_index_seen
    checked_at, exists = _bm25_index_seen
    if time.monotonic() - checked_at < 60:
        return exists
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid"
            " WHERE c.relname = %s AND c.relkind = 'i'",
            [BM25_INDEX_NAME],
        )
        row = cursor.fetchone()
    exists = bool(row and row[0])
    _bm25_index_seen = (time.monotonic(), exists)
    return exists


def bm25_index_forget() -> None:
    """Look the index up again on the next search (after creating or dropping it)."""
    global _bm25_index_seen
    _bm25_index_seen = (0.0, False)


def search_indexes_maintain(*, min_chunks: int) -> str | None:
    """Create the BM25 index once the chunk table holds ``min_chunks`` rows; returns what was done.

    Concurrently, so ingestion and searches go on while it builds. Must not run inside a
    transaction.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE relname = 'search_chunk'")
        estimate = max(0, int(cursor.fetchone()[0]))
        if estimate < min_chunks:
            cursor.execute("SELECT count(*) FROM search_chunk")
            estimate = int(cursor.fetchone()[0])
        if estimate < min_chunks:
            return None
        cursor.execute(
            "SELECT i.indisvalid FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid WHERE c.relname = %s",
            [BM25_INDEX_NAME],
        )
        row = cursor.fetchone()
        if row and row[0]:
            return None
        if row:  # an interrupted concurrent build leaves an invalid index behind
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {BM25_INDEX_NAME}")
        cursor.execute(create_bm25_index_sql(concurrently=True))
    bm25_index_forget()
    return f"created {BM25_INDEX_NAME} (the table holds about {estimate} chunks)"
