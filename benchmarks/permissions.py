"""Retrieval under permissions: recall and latency for readers who may see part of a collection.

    python -m benchmarks.permissions [--n 100000] [--queries 100] [--keep] [--explain] [--exact-max-chunks N]

Method
------
Database. A database of its own, ``ragsite_bench_permissions``, on the project's PostgreSQL
server (``DATABASE_URL``, else the embedded one), and Redis database 9 (emptied, for the query
embedding cache): created fresh, migrated, and dropped at the end unless ``--keep``.

Collection. Exactly the collection of ``benchmarks.search_scale`` (its functions, its seed):
Cranfield passages embedded with all-MiniLM-L6-v2, ``n`` perturbed copies written as the
pipeline writes them, documents of 100 chunks; the readers are set (below) before the HNSW
indexes (embeddings, BM25 vectors) are built, once.

Readers. Two users and a group are created. With a fixed seed, 10 % of the documents are
made readable by user A only (readers ``["u:<A>"]``), a disjoint 1 % by user B only, and every
other document by the group only; documents and chunks are updated in SQL (one statement
each), then ``VACUUM ANALYZE``. A reads as ``("*", "u:<A>")``, B as ``("*", "u:<B>")``, as
``search.access.reader_of_user`` would make them: no document is open, so A sees exactly its
10 % of the chunks and B its 1 %. The third reader is the operator (no filter: the
unrestricted query). Whether a reader is served by the exact path over its readable documents
(``SEARCH_EXACT_READABLE_MAX_CHUNKS``, overridden for the run by ``--exact-max-chunks``) or by
the filtered index scans is reported per reader (``exact_readable_path``): at the default
(5,000) and 100,000 chunks, B (1,000 chunks) takes the exact path and A (10,000) the index.

Timing. The Cranfield queries, their embeddings pre-warmed in the Redis cache. For each mode
(dense, keyword, hybrid): one untimed pass of every query for every reader, then every query
is run through ``chunk_search`` (top 10, snippets on) by the three readers in turn, the order
rotating from query to query, so that noise from other work on the machine falls on the three
alike. A query's latency is the service's ``total`` minus its ``embed`` time, as in
search_scale. ``p99_ratio`` = a restricted reader's p99 over the unrestricted p99, same mode,
same run.

Reference. ``recall@10`` is the mean, over queries, of the share of the exact top 10 over only
the reader's visible chunks that the search returned (queries with an empty reference are
skipped and counted in ``empty_reference``):

- dense: exact fp32 cosine, ``ORDER BY embedding <=> q`` over the collection's chunks whose
  readers overlap the reader's, index and bitmap scans disabled (a sequential scan), as
  search_scale's reference. ``recall_vs_halfvec_exact`` compares with the exact search over
  the half-precision vectors the index holds instead (the next item's method, dense).
- keyword and hybrid: ``chunk_search`` by the same reader made exact. A restricted reader is
  sent down the exact-readable path whatever its share (``SEARCH_EXACT_READABLE_MAX_CHUNKS``
  set beyond the collection): every visible chunk holding a query word is scored by BM25,
  and in hybrid every visible chunk is compared with the query's embedding, the two exact
  lists fused as served. For the operator the exact keyword path is forced
  (``SEARCH_KEYWORD_EXACT_MAX_ROWS``). Ordered index scans are disabled for these searches
  (``enable_indexscan = off``): otherwise the planner may read the "exact" keyword candidates
  off the BM25 HNSW index, sorting its approximate order by (score, id) incrementally, and the
  operator's dense side becomes a sequential scan. That is the exact answer of each mode over
  the visible chunks; the operator's ``recall_unrestricted`` is context, what the unrestricted
  search itself reaches.

The final line's ``recall_vs_visible_10pct`` / ``_1pct`` are the worst mode's recall for A / B,
``p99_ratio_10pct`` / ``_1pct`` the worst mode's p99 ratio; ``modes`` holds every figure.
``--explain`` prints EXPLAIN ANALYZE of A's slowest query in each mode.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from tqdm import tqdm

from benchmarks.common import CRANFIELD, own_databases, report
from benchmarks.search_scale import (
    CHUNKS_PER_DOCUMENT,
    DIMENSIONS,
    EXACT_SESSION,
    MODEL,
    SEED,
    StatementCapture,
    base_embed,
    collection_load,
    explain,
    index_build,
    passages_read,
    percentiles,
    rows_make,
    vector_literal,
)

DATABASE = "ragsite_bench_permissions"
REDIS_DB = 9
MODES = ("dense", "keyword", "hybrid")
SHARES = {"10pct": 0.10, "1pct": 0.01}  # reader -> share of the documents it may read
# The reference for dense: exact fp32 cosine over the chunks the reader may read, by a sequential scan.
EXACT_VISIBLE_SQL = (
    "SELECT id FROM search_chunk WHERE collection_id = %s AND readers && %s::varchar[]"
    " ORDER BY embedding <=> %s::vector LIMIT 10"
)


# --------------------------------------------------------------------------- readers


def readers_assign(collection, rng: np.random.Generator) -> tuple[dict, dict[str, int]]:
    """Restrict every document: a random 10 % to user A, a disjoint 1 % to user B, the rest to a
    group. Returns the readers by name (``"unrestricted"``, ``"10pct"``, ``"1pct"``) and the
    chunks each restricted one may read."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.db import connection

    from search.access import EVERYONE, OPERATOR, Reader, group_principal, user_principal
    from search.models import Document

    users = {name: get_user_model().objects.create_user(username=f"reader-{name}") for name in SHARES}
    others = Group.objects.create(name="everyone else")
    ids = np.array(sorted(Document.objects.filter(collection=collection).values_list("pk", flat=True)))
    order = rng.permutation(ids)
    chosen, start = {}, 0
    for name, share in SHARES.items():
        count = max(1, round(share * len(ids)))
        chosen[name] = [int(pk) for pk in order[start : start + count]]
        start += count
    assert start < len(ids), "too few documents for two disjoint readers and the rest"

    def readers_sql(document_id: str) -> str:
        cases = " ".join(f"WHEN {document_id} = ANY(%(docs_{name})s) THEN ARRAY[%(user_{name})s]" for name in SHARES)
        return f"CASE {cases} ELSE ARRAY[%(rest)s] END::varchar(24)[]"

    params = {f"docs_{name}": chosen[name] for name in SHARES}
    params |= {f"user_{name}": user_principal(users[name].pk) for name in SHARES}
    params |= {"rest": group_principal(others.pk), "collection": collection.pk}
    with connection.cursor() as cursor:
        for table, document_id in (("search_document", "id"), ("search_chunk", "document_id")):
            readers_set = readers_sql(document_id)
            cursor.execute(f"UPDATE {table} SET readers = {readers_set} WHERE collection_id = %(collection)s", params)  # noqa: S608 (fixed names; values bound)
        cursor.execute("VACUUM ANALYZE search_chunk")
        cursor.execute("VACUUM ANALYZE search_document")
        visible = {}
        for name in SHARES:
            cursor.execute(
                "SELECT count(*) FROM search_chunk WHERE collection_id = %s AND readers && %s::varchar[]",
                [collection.pk, [EVERYONE, user_principal(users[name].pk)]],
            )
            visible[name] = cursor.fetchone()[0]
    readers = {"unrestricted": OPERATOR}
    readers |= {name: Reader(principals=(EVERYONE, user_principal(users[name].pk))) for name in SHARES}
    return readers, visible


# --------------------------------------------------------------------------- measurements


def searches_time(queries, workspace, collection, readers: dict, capture) -> dict[str, dict[str, dict]]:
    """Per mode, per reader: latencies (ms, embedding excluded), hit ids, statements and keyword paths."""
    from django.db import connection

    from search.selectors import chunk_search

    names = list(readers)
    measured: dict[str, dict[str, dict]] = {}
    for mode in MODES:
        for text in tqdm(queries, desc=f"warm-up {mode}", unit="query", leave=False):
            for name in names:
                chunk_search(
                    query=text, workspace=workspace, collection_ids=[collection.pk], mode=mode, top_k=10,
                    reader=readers[name],
                )  # fmt: skip
        measured[mode] = {name: {"latencies": [], "hits": [], "statements": [], "paths": []} for name in names}
        with connection.execute_wrapper(capture):
            for number, text in enumerate(tqdm(queries, desc=f"search {mode}", unit="query")):
                shift = number % len(names)  # each reader goes first, second and last as often
                for name in names[shift:] + names[:shift]:
                    result = chunk_search(
                        query=text, workspace=workspace, collection_ids=[collection.pk], mode=mode, top_k=10,
                        reader=readers[name], snippets=True,
                    )  # fmt: skip
                    row = measured[mode][name]
                    row["latencies"].append(result.timings_ms["total"] - result.timings_ms.get("embed", 0.0))
                    row["hits"].append([hit.chunk_id for hit in result.hits])
                    row["statements"].append(capture.last)
                    row["paths"].append(result.keyword_path)
    return measured


def dense_exact_visible(collection, reader, vectors: list[np.ndarray]) -> list[list[int]]:
    """The exact fp32 cosine top 10 over the chunks ``reader`` may read (all for the operator)."""
    from django.db import connection, transaction

    principals = list(reader.principals) if reader.principals is not None else None
    sql = EXACT_VISIBLE_SQL if principals is not None else EXACT_VISIBLE_SQL.replace(
        " AND readers && %s::varchar[]", ""
    )  # fmt: skip
    found = []
    for vector in tqdm(vectors, desc="exact dense", unit="query", leave=False):
        params = [collection.pk, *([principals] if principals is not None else []), vector_literal(vector)]
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(EXACT_SESSION)
            cursor.execute(sql, params)
            found.append([row[0] for row in cursor.fetchall()])
    return found


def exact_reference(queries, workspace, collection, reader, mode: str) -> list[list[int]]:
    """``chunk_search`` made exact: a restricted reader always takes the exact-readable path
    (every visible chunk compared, dense; every visible chunk holding a query word scored,
    keyword), the operator the exact keyword path, and ordered index scans are disabled, so that
    no ranking is read off an HNSW index (the operator's dense ranking becomes a sequential scan).
    Hybrid fuses the two exact lists as served."""
    from django.db import connection, transaction
    from django.test.utils import override_settings

    from search.selectors import chunk_search

    found = []
    exact = override_settings(SEARCH_EXACT_READABLE_MAX_CHUNKS=10**12, SEARCH_KEYWORD_EXACT_MAX_ROWS=10**12)
    with exact:
        for text in tqdm(queries, desc=f"exact {mode}", unit="query", leave=False):
            # Without this the planner may read even the "exact" keyword candidates off the BM25
            # HNSW index (ORDER BY score, id as an incremental sort over its approximate order).
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SET LOCAL enable_indexscan = off")
                result = chunk_search(
                    query=text, workspace=workspace, collection_ids=[collection.pk], mode=mode, top_k=10,
                    reader=reader, snippets=False,
                )  # fmt: skip
            found.append([hit.chunk_id for hit in result.hits])
    return found


def recall_vs(found: list[list[int]], truth: list[list[int]]) -> tuple[float, int]:
    """Mean share of each non-empty reference list that was found; and how many references were empty."""
    shares = [len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True) if t]
    return (float(np.mean(shares)) if shares else 1.0), sum(1 for t in truth if not t)


def exact_readable_path(collection, reader) -> bool:
    """Whether ``chunk_search`` serves this reader from its readable documents, exactly (at the run's setting)."""
    from search.selectors import _readable

    if reader.unrestricted:
        return False
    return _readable([collection.pk], list(reader.principals), collection.chunk_count)[1] is not None


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="Chunks in the collection.")
    parser.add_argument("--queries", type=int, default=100, help="How many Cranfield queries to run.")
    parser.add_argument("--passages", type=int, default=4000, help="At most this many base passages to embed.")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    parser.add_argument("--explain", action="store_true", help="Print EXPLAIN ANALYZE of A's slowest queries.")
    parser.add_argument(
        "--exact-max-chunks",
        type=int,
        default=None,
        help="SEARCH_EXACT_READABLE_MAX_CHUNKS for this run (default: the setting's value).",
    )
    args = parser.parse_args()

    with own_databases(DATABASE, REDIS_DB, keep=args.keep):
        from django.conf import settings

        if args.exact_max_chunks is not None:
            settings.SEARCH_EXACT_READABLE_MAX_CHUNKS = args.exact_max_chunks
        result = run(args, settings)
    report("permissions", result, corpus=CRANFIELD)


def run(args, settings) -> dict:
    from django.db import connection

    from search.beir import queries_read
    from search.embedders import query_embedding
    from search.services import collection_create, workspace_create

    rng = np.random.default_rng(SEED)
    passages = passages_read(args.passages)
    base, tokens = base_embed(passages)
    picks, vectors, _ = rows_make(base, args.n, rng)
    workspace = workspace_create(name="Permissions benchmark", slug="bench-permissions")
    collection = collection_create(workspace=workspace, name="permissions", embedding_model=MODEL)
    assert collection.embedding_dimensions == DIMENSIONS
    collection_load(collection, passages, tokens, picks, vectors)  # sets each document's chunks_total
    del vectors
    # Readers before the HNSW indexes: updating every chunk after would rebuild the graphs by insertion.
    readers, visible = readers_assign(collection, rng)
    index_build()
    collection.refresh_from_db()

    queries = list(queries_read(CRANFIELD).values())[: args.queries]
    query_vectors = [query_embedding(MODEL, text) for text in queries]  # warms the Redis cache
    capture = StatementCapture()
    measured = searches_time(queries, workspace, collection, readers, capture)

    modes: dict[str, dict] = {}
    for mode in MODES:
        row: dict = {}
        for name in readers:
            p50, p99 = percentiles(measured[mode][name]["latencies"])
            row[f"{name}_p50_ms"] = round(p50, 2)
            row[f"{name}_p99_ms"] = round(p99, 2)
        for name in SHARES:
            row[f"p99_ratio_{name}"] = round(row[f"{name}_p99_ms"] / row["unrestricted_p99_ms"], 3)
            row[f"p50_ratio_{name}"] = round(row[f"{name}_p50_ms"] / row["unrestricted_p50_ms"], 3)
        if mode != "dense":
            for name in readers:
                paths = measured[mode][name]["paths"]
                row[f"{name}_keyword_index_path_share"] = round(paths.count("index") / len(paths), 3)
        modes[mode] = row

    # The references: exact search over each reader's visible chunks (all of them for the operator).
    for name, reader in readers.items():
        truth = dense_exact_visible(collection, reader, query_vectors)
        recall, empty = recall_vs(measured["dense"][name]["hits"], truth)
        modes["dense"][f"recall_{name}"] = round(recall, 4)
        modes["dense"][f"empty_reference_{name}"] = empty
        for mode in MODES:
            truth = exact_reference(queries, workspace, collection, reader, mode)
            recall, empty = recall_vs(measured[mode][name]["hits"], truth)
            if mode == "dense":
                modes[mode][f"recall_vs_halfvec_exact_{name}"] = round(recall, 4)
            else:
                modes[mode][f"recall_{name}"] = round(recall, 4)
                modes[mode][f"empty_reference_{name}"] = empty

    with connection.cursor() as cursor:
        cursor.execute("SHOW hnsw.max_scan_tuples")
        max_scan_tuples = int(cursor.fetchone()[0])
    result: dict = {}
    for name in SHARES:
        worst = min(MODES, key=lambda mode: modes[mode][f"recall_{name}"])
        result[f"recall_vs_visible_{name}"] = modes[worst][f"recall_{name}"]
        result[f"recall_worst_mode_{name}"] = worst
    for name in SHARES:
        worst = max(MODES, key=lambda mode: modes[mode][f"p99_ratio_{name}"])
        result[f"p99_ratio_{name}"] = modes[worst][f"p99_ratio_{name}"]
        result[f"p99_ratio_worst_mode_{name}"] = worst
    result["modes"] = modes
    result["n"] = collection.chunk_count
    result["documents"] = math.ceil(args.n / CHUNKS_PER_DOCUMENT)
    result["queries"] = len(queries)
    result["visible_chunks"] = visible
    result["exact_readable_path"] = {name: exact_readable_path(collection, readers[name]) for name in SHARES}
    result["exact_readable_max_chunks"] = settings.SEARCH_EXACT_READABLE_MAX_CHUNKS
    result["ef_search"] = settings.HNSW_EF_SEARCH
    result["keyword_ef_search"] = settings.KEYWORD_HNSW_EF_SEARCH
    result["hnsw_max_scan_tuples"] = max_scan_tuples
    result["candidates"] = settings.SEARCH_CANDIDATES
    result["seed"] = SEED

    if args.explain:
        for mode in MODES:
            row = measured[mode]["10pct"]
            slowest = int(np.argmax(row["latencies"]))
            ef = max(settings.HNSW_EF_SEARCH, settings.SEARCH_CANDIDATES)
            if row["paths"][slowest] == "index":
                ef = max(ef, settings.KEYWORD_HNSW_EF_SEARCH)
            session = f"SET LOCAL hnsw.ef_search = {min(ef, 1000)}; SET LOCAL hnsw.iterative_scan = relaxed_order"
            print(f"\nslowest 10 % {mode} query ({row['latencies'][slowest]:.1f} ms): {queries[slowest]!r}")
            print(explain(*row["statements"][slowest], session), flush=True)
    return result


if __name__ == "__main__":
    main()
