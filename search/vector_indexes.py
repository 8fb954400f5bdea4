"""One partial HNSW index per embedding dimension.

The ``embedding`` column has no fixed dimension because collections may use different
models. pgvector indexes need one, so each dimension in use gets a partial index over
``embedding::halfvec(N)`` restricted to ``embedding_dimensions = N``. Queries repeat the
same expression and predicate (see ``dense_distance_sql``) so the planner can use it.
halfvec halves the index size and build time; the recall cost is negligible for
normalised sentence embeddings (measured in benchmarks/search_scale.py).
"""

from __future__ import annotations

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
