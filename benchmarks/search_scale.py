"""Search at scale: HNSW recall and search latency on a large collection.

    python -m benchmarks.search_scale [--n 100000] [--queries 225] [--keep] [--explain]

Method
------
Database. Everything happens in a dedicated database, ``ragsite_bench_scale``, on the
PostgreSQL server the project uses (``DATABASE_URL``, else the embedded server under
``var/``), so that the HNSW index can be dropped and rebuilt freely. It is created fresh
(dropped first if a previous ``--keep`` run left it), migrated, and dropped again at the
end unless ``--keep``.

Vectors. Uniform random vectors make every neighbour equally far away and say nothing
about a real index. Instead the Cranfield corpus is split into passages of 2-3 sentences
(a few thousand "base" passages), embedded with the project's embedder
(all-MiniLM-L6-v2, exactly as the pipeline does: title, then passage). Row ``i`` of the
collection is ``normalise(base[j] + noise)`` with ``j`` drawn at random and Gaussian
noise scaled so that a row's cosine to its base is about 0.875 (the measured mean is
reported as ``perturbation_cosine``): the data keeps the cluster structure of real
sentence embeddings, with near-duplicates around each passage. Each row's text is its
base passage, so BM25 statistics (document frequencies, lengths) are realistic. The
random seed is fixed.

Load. One workspace and collection (all-MiniLM-L6-v2, 384 dimensions) and documents of
100 chunks each. The HNSW index is dropped, then all chunks are written as the ingestion
pipeline writes them (binary COPY into a staging table, then ``INSERT ... SELECT``
computing the BM25 document vectors in SQL with the collection's average length), the
term statistics are filled in one statement and the collection's BM25 statistics set.
After ``VACUUM ANALYZE`` the HNSW index is built once (``load_s`` and ``index_build_s``
are timed separately).

Queries. The Cranfield queries, their embeddings pre-warmed in the Redis cache. After
one untimed pass, each query is run through ``chunk_search`` (top 10, snippets on) in
the hybrid, dense and keyword modes; the latency of a query is the service's
``total`` minus its ``embed`` time (the query embedding is excluded). p50/p99 per mode.

Recall. For each query, the dense search's top 10 is compared with an exact scan
(``ORDER BY embedding <=> q`` in fp32 over the stored vectors, index and bitmap scans
disabled): ``recall@10`` is the mean share of the exact top 10 that the index found.
The exact scan is timed too (the statement alone), and ``speedup_vs_exact`` =
exact p50 / dense p50, both measured in this run.

Where recall goes. ``recall@10_by_ef_search`` repeats the dense search at larger
``ef_search`` (loss in the graph search), and ``halfvec_exact_recall@10`` compares an
exact search over the half-precision vectors the index stores with the fp32 one, in
NumPy (loss from the quantisation: the best any halfvec index can do). ``--explain``
prints EXPLAIN ANALYZE of the slowest hybrid query and of one exact scan.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import time

import numpy as np
from tqdm import tqdm

from benchmarks.common import CRANFIELD, django_setup, report, server_url, with_database

DATABASE = "ragsite_bench_scale"
MODEL = "all-MiniLM-L6-v2"
DIMENSIONS = 384
CHUNKS_PER_DOCUMENT = 100
TARGET_COSINE = 0.875  # a perturbed row's cosine to its base passage
SEED = 20240611
MODES = ("hybrid", "dense", "keyword")
# The reference: exact fp32 cosine over the stored vectors, by a sequential scan.
EXACT_SQL = "SELECT id FROM search_chunk WHERE collection_id = %s ORDER BY embedding <=> %s::vector LIMIT 10"
EXACT_SESSION = "SET LOCAL enable_indexscan = off; SET LOCAL enable_bitmapscan = off"
# Cranfield sentences end in " ." (tokenised text).
_SENTENCE_END = re.compile(r"(?<=\s\.)\s+")


# --------------------------------------------------------------------------- database


def database_recreate(url: str) -> None:
    """Create the benchmark database, dropping a leftover of an earlier --keep run first."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DATABASE)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))


def database_drop(url: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DATABASE)))


# --------------------------------------------------------------------------- data


def passages_read(limit: int) -> list[tuple[str, str]]:
    """(title, passage) pairs: each Cranfield document split into passages of 2-3 sentences."""
    from search.beir import corpus_read

    passages = []
    for doc in corpus_read(CRANFIELD):
        sentences = [s.strip() for s in _SENTENCE_END.split(doc.text.strip()) if s.strip()]
        if not sentences:
            continue
        groups = math.ceil(len(sentences) / 3)
        for part in np.array_split(np.arange(len(sentences)), groups):
            passages.append((doc.title.strip(), " ".join(sentences[i] for i in part)))
    return passages[:limit]


def base_embed(passages: list[tuple[str, str]]) -> tuple[np.ndarray, list[int]]:
    """Embed each passage as the pipeline would (title + passage); also count its tokens."""
    from search.embedders import embedder_get
    from search.ingest.chunking import TextChunk
    from search.ingest.pipeline import EMBED_GROUP, embedding_input

    embedder = embedder_get(MODEL)
    inputs = [embedding_input(title, TextChunk(0, text, 0, len(text), 0)) for title, text in passages]
    vectors = []
    with tqdm(total=len(inputs), desc="embed base passages", unit="text") as bar:
        for start in range(0, len(inputs), EMBED_GROUP):
            vectors.append(embedder.embed_documents(inputs[start : start + EMBED_GROUP]))
            bar.update(len(inputs[start : start + EMBED_GROUP]))
    tokens = [len(embedder.token_offsets(text)) for _, text in passages]
    return np.concatenate(vectors).astype(np.float32), tokens


def rows_make(base: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """N perturbed copies of random base vectors: (base index per row, unit vectors, mean cosine).

    For unit b and noise ~ N(0, s^2 I) in d dimensions, cos(b + noise, b) ~ 1 / sqrt(1 + d s^2),
    so s = sqrt((1 / c^2 - 1) / d) aims at cosine c.
    """
    dims = base.shape[1]
    sigma = math.sqrt((1 / TARGET_COSINE**2 - 1) / dims)
    picks = rng.integers(0, len(base), size=n)
    vectors = base[picks] + rng.standard_normal((n, dims), dtype=np.float32) * np.float32(sigma)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = float(np.mean(np.einsum("ij,ij->i", vectors, base[picks])))
    return picks, vectors, cosine


# --------------------------------------------------------------------------- load


def collection_load(collection, passages, tokens, picks, vectors) -> dict[str, float]:
    """Write documents and chunks the way the pipeline does, in bulk; returns the timings of each step."""
    from django.db import connection, transaction
    from django.utils import timezone

    from search.bm25 import statistics_rebuild
    from search.embedders import embedder_get
    from search.ingest.chunk_writes import chunks_insert
    from search.ingest.chunking import TextChunk
    from search.models import Collection, Document
    from search.vector_indexes import BM25_INDEX_NAME, index_name

    steps: dict[str, float] = {}
    n = len(picks)
    started = time.perf_counter()
    now = timezone.now()
    spans = [(start, min(start + CHUNKS_PER_DOCUMENT, n)) for start in range(0, n, CHUNKS_PER_DOCUMENT)]
    documents = []
    for number, (start, end) in enumerate(spans):
        digest = hashlib.sha256(f"{DATABASE}:{collection.pk}:{number}".encode()).hexdigest()
        documents.append(
            Document(
                collection=collection,
                title=f"Synthetic document {number}",
                source_name=f"scale-{number:06d}.txt",
                media_type="text/plain",
                file=f"bench/scale-{number:06d}.txt",
                size_bytes=sum(len(passages[j][1]) + 1 for j in picks[start:end]),
                content_sha256=digest,
                sha256=digest,
                status=Document.Status.INDEXED,
                chunks_total=end - start,
                chunks_embedded=end - start,
                attempts=1,
                indexed_at=now,
            )
        )
    documents = Document.objects.bulk_create(documents, batch_size=1000)
    steps["documents"] = time.perf_counter() - started

    def rows():
        """``(document_id, chunk, vector)`` in document order, as the pipeline writes them."""
        with tqdm(total=n, desc="copy chunks", unit="row") as bar:
            for document, (start, end) in zip(documents, spans, strict=True):
                offset = 0
                for ordinal, row in enumerate(range(start, end)):
                    j = picks[row]
                    text = passages[j][1]
                    yield document.pk, TextChunk(ordinal, text, offset, offset + len(text), tokens[j]), vectors[row]
                    offset += len(text) + 1
                bar.update(end - start)

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"DROP INDEX IF EXISTS {index_name(DIMENSIONS)}")
        cursor.execute(f"DROP INDEX IF EXISTS {BM25_INDEX_NAME}")
        cursor.execute("SET LOCAL work_mem = '256MB'")
        # The pipeline's own write: binary COPY, then BM25 weights computed in SQL.
        begun = time.perf_counter()
        avgdl = chunks_insert(cursor, collection, rows(), embedder_get(MODEL))
        steps["insert"] = time.perf_counter() - begun
        # Document frequencies and lengths counted once for the whole load.
        begun = time.perf_counter()
        chunk_count, lexemes = statistics_rebuild(cursor, collection.pk)
        Collection.objects.filter(pk=collection.pk).update(
            chunk_count=chunk_count, lexeme_total=lexemes, bm25_avgdl=avgdl
        )
        steps["termstat"] = time.perf_counter() - begun

    begun = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE search_chunk")
        cursor.execute("ANALYZE search_termstat")
        cursor.execute("ANALYZE search_document")
    steps["vacuum_analyze"] = time.perf_counter() - begun
    steps["avgdl"] = avgdl
    return steps


def index_build() -> tuple[float, float]:
    """Build the HNSW indexes (embeddings, then BM25 vectors) over the loaded rows; returns seconds each."""
    from django.db import connection

    from search.vector_indexes import bm25_index_forget, create_bm25_index_sql, create_index_sql

    with connection.cursor() as cursor:
        cursor.execute("SET maintenance_work_mem = '1GB'")
        cursor.execute("SET max_parallel_maintenance_workers = 1")
        started = time.perf_counter()
        cursor.execute(create_index_sql(DIMENSIONS))
        seconds = time.perf_counter() - started
        started = time.perf_counter()
        cursor.execute(create_bm25_index_sql())
        bm25_seconds = time.perf_counter() - started
    bm25_index_forget()
    with connection.cursor() as cursor:
        cursor.execute("RESET maintenance_work_mem")
        cursor.execute("RESET max_parallel_maintenance_workers")
    return seconds, bm25_seconds


# --------------------------------------------------------------------------- measurements


def vector_literal(vector: np.ndarray) -> str:
    return "[" + ",".join(f"{x:.9g}" for x in vector) + "]"


def percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


class StatementCapture:
    """A Django execute wrapper keeping the last search statement (for EXPLAIN of slow queries)."""

    def __init__(self):
        self.last: tuple[str, object] | None = None

    def __call__(self, execute, sql, params, many, context):
        if sql.lstrip().startswith("WITH"):
            self.last = (sql, params)
        return execute(sql, params, many, context)


def searches_time(queries, workspace, collection, capture) -> dict[str, dict]:
    """Per mode: latencies (ms, embedding excluded), the hit ids and the statement of each query."""
    from django.db import connection

    from search.selectors import chunk_search

    measured: dict[str, dict] = {}
    for mode in MODES:
        for text in tqdm(queries, desc=f"warm-up {mode}", unit="query", leave=False):
            chunk_search(query=text, workspace=workspace, collection_ids=[collection.pk], mode=mode, top_k=10)
        latencies, hits, statements, paths = [], [], [], []
        with connection.execute_wrapper(capture):
            for text in tqdm(queries, desc=f"search {mode}", unit="query"):
                result = chunk_search(
                    query=text, workspace=workspace, collection_ids=[collection.pk], mode=mode, top_k=10, snippets=True
                )
                latencies.append(result.timings_ms["total"] - result.timings_ms.get("embed", 0.0))
                hits.append([hit.chunk_id for hit in result.hits])
                statements.append(capture.last)
                paths.append(result.keyword_path)
        measured[mode] = {"latencies": latencies, "hits": hits, "statements": statements, "paths": paths}
    return measured


def keyword_exact_agreement(queries, workspace, collection, indexed_hits: list[list[int]]) -> float:
    """Mean overlap of the keyword top 10 as served with the exact BM25 top 10 (every match scored)."""
    from django.test.utils import override_settings

    from search.selectors import chunk_search

    overlaps = []
    with override_settings(SEARCH_KEYWORD_EXACT_MAX_ROWS=10**12):
        for text, served in zip(queries, indexed_hits, strict=True):
            exact = chunk_search(
                query=text, workspace=workspace, collection_ids=[collection.pk], mode="keyword", top_k=10
            )
            exact_ids = [hit.chunk_id for hit in exact.hits]
            if exact_ids:
                overlaps.append(len(set(exact_ids) & set(served)) / len(exact_ids))
    return float(np.mean(overlaps)) if overlaps else 1.0


def exact_search(collection, vectors: list[np.ndarray]) -> tuple[list[list[int]], list[float]]:
    """The exact fp32 cosine top 10 for each query vector, by a sequential scan; with its timings."""
    from django.db import connection, transaction

    def run(vector: np.ndarray) -> tuple[list[int], float]:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(EXACT_SESSION)
            started = time.perf_counter()
            cursor.execute(EXACT_SQL, [collection.pk, vector_literal(vector)])
            ids = [row[0] for row in cursor.fetchall()]
            return ids, (time.perf_counter() - started) * 1000

    for vector in vectors[:5]:  # bring the table into the cache, as the warm-up pass does for the searches
        run(vector)
    results = [run(vector) for vector in tqdm(vectors, desc="exact scan", unit="query")]
    return [ids for ids, _ in results], [ms for _, ms in results]


def recall_by_ef_search(queries, workspace, collection, exact_ids, values=(200, 400)) -> dict[str, float]:
    """Dense recall@10 at larger ef_search values: how much of the loss is the graph search."""
    from search.selectors import chunk_search

    recalls = {}
    for ef in values:
        found = [
            [
                hit.chunk_id
                for hit in chunk_search(
                    query=text,
                    workspace=workspace,
                    collection_ids=[collection.pk],
                    mode="dense",
                    top_k=10,
                    ef_search=ef,
                    snippets=False,
                ).hits
            ]
            for text in tqdm(queries, desc=f"dense ef_search={ef}", unit="query", leave=False)
        ]
        recalls[str(ef)] = recall_at_10(found, exact_ids)
    return recalls


def halfvec_ceiling(vectors: np.ndarray, query_vectors: list[np.ndarray]) -> float:
    """recall@10 of an exact search over the vectors rounded to half precision (what the index stores)
    against the exact fp32 search, computed here in NumPy: the best any halfvec index can do."""

    def top10(rows: np.ndarray, queries: np.ndarray) -> np.ndarray:
        rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
        scores = rows @ queries.T  # (n, queries)
        return np.argpartition(-scores, 10, axis=0)[:10].T

    queries = np.stack(query_vectors).astype(np.float32)
    exact = top10(vectors, queries)
    half = top10(vectors.astype(np.float16).astype(np.float32), queries.astype(np.float16).astype(np.float32))
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(half, exact, strict=True)]))


def recall_at_10(found: list[list[int]], truth: list[list[int]]) -> float:
    return float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)]))


def explain(sql: str, params, session: str) -> str:
    """EXPLAIN ANALYZE of a statement after the session settings it ran with (vector literals shortened)."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(session)
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    return re.sub(r"'\[[-0-9.e,]{100,}\]'", "'[...]'", plan)


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="Chunks in the collection.")
    parser.add_argument("--queries", type=int, default=225, help="How many Cranfield queries to run.")
    parser.add_argument("--passages", type=int, default=4000, help="At most this many base passages to embed.")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    parser.add_argument("--explain", action="store_true", help="Print EXPLAIN ANALYZE of the slowest hybrid query.")
    args = parser.parse_args()

    # A database of our own on the project's server, chosen before Django reads its settings.
    server = server_url()
    database_recreate(server)
    os.environ["DATABASE_URL"] = with_database(server, DATABASE)
    django_setup()

    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    try:
        call_command("migrate", verbosity=0)
        result = run(args, settings)
    finally:
        connections.close_all()
        if not args.keep:
            database_drop(server)
    report("search_scale", result, corpus=CRANFIELD)


def run(args, settings) -> dict:
    from search.beir import queries_read
    from search.embedders import query_embedding
    from search.services import collection_create, workspace_create

    rng = np.random.default_rng(SEED)
    started = time.perf_counter()
    passages = passages_read(args.passages)
    base, tokens = base_embed(passages)
    embed_seconds = time.perf_counter() - started
    picks, vectors, cosine = rows_make(base, args.n, rng)

    workspace = workspace_create(name="Scale benchmark", slug="bench-scale")
    collection = collection_create(workspace=workspace, name="scale", embedding_model=MODEL)
    assert collection.embedding_dimensions == DIMENSIONS
    started = time.perf_counter()
    steps = collection_load(collection, passages, tokens, picks, vectors)
    load_seconds = time.perf_counter() - started
    index_seconds, bm25_index_seconds = index_build()
    collection.refresh_from_db()

    queries = list(queries_read(CRANFIELD).values())[: args.queries]
    query_vectors = [query_embedding(MODEL, text) for text in queries]  # warms the Redis cache
    capture = StatementCapture()
    measured = searches_time(queries, workspace, collection, capture)
    exact_ids, exact_ms = exact_search(collection, query_vectors)

    recall = recall_at_10(measured["dense"]["hits"], exact_ids)
    # Where recall is lost: the search of the graph (recall at larger ef_search) or the
    # half-precision vectors in the index (an exact search over them, in NumPy).
    recall_ef = {str(settings.HNSW_EF_SEARCH): round(recall, 4)}
    recall_ef.update(
        {ef: round(r, 4) for ef, r in recall_by_ef_search(queries, workspace, collection, exact_ids).items()}
    )
    ceiling = halfvec_ceiling(vectors, query_vectors)
    del vectors

    keyword_paths = measured["keyword"]["paths"]
    result: dict = {
        "n": args.n,
        "queries": len(queries),
        "recall@10": round(recall, 4),
        "keyword_index_path_share": round(keyword_paths.count("index") / len(keyword_paths), 3),
        "keyword_top10_agreement_with_exact": round(
            keyword_exact_agreement(queries, workspace, collection, measured["keyword"]["hits"]), 4
        ),
    }
    for mode in MODES:
        p50, p99 = percentiles(measured[mode]["latencies"])
        result[f"{mode}_p50_ms"] = round(p50, 2)
        result[f"{mode}_p99_ms"] = round(p99, 2)
    exact_p50, exact_p99 = percentiles(exact_ms)
    result["exact_p50_ms"] = round(exact_p50, 2)
    result["exact_p99_ms"] = round(exact_p99, 2)
    result["speedup_vs_exact"] = round(exact_p50 / result["dense_p50_ms"], 1)
    result["load_s"] = round(load_seconds, 2)
    result["index_build_s"] = round(index_seconds, 2)
    result["bm25_index_build_s"] = round(bm25_index_seconds, 2)
    result["load_steps_s"] = {k: round(v, 2) for k, v in steps.items() if k != "avgdl"}
    result["base_embed_s"] = round(embed_seconds, 2)
    result["base_passages"] = len(passages)
    result["documents"] = math.ceil(args.n / CHUNKS_PER_DOCUMENT)
    result["perturbation_cosine"] = round(cosine, 4)
    result["bm25_avgdl"] = round(collection.bm25_avgdl, 2)
    result["ef_search"] = settings.HNSW_EF_SEARCH
    result["recall@10_by_ef_search"] = recall_ef
    result["halfvec_exact_recall@10"] = round(ceiling, 4)
    result["candidates"] = settings.SEARCH_CANDIDATES
    result["seed"] = SEED

    if args.explain:
        latencies = measured["hybrid"]["latencies"]
        slowest = int(np.argmax(latencies))
        print(f"\nslowest hybrid query ({latencies[slowest]:.1f} ms): {queries[slowest]!r}")
        ef = max(settings.HNSW_EF_SEARCH, settings.SEARCH_CANDIDATES)
        session = f"SET LOCAL hnsw.ef_search = {int(min(ef, 1000))}; SET LOCAL hnsw.iterative_scan = relaxed_order"
        print(explain(*measured["hybrid"]["statements"][slowest], session), flush=True)
        print(f"\nexact scan, query {queries[0]!r}:")
        print(explain(EXACT_SQL, [collection.pk, vector_literal(query_vectors[0])], EXACT_SESSION), flush=True)
    return result


if __name__ == "__main__":
    main()
