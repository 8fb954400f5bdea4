"""Reads for the search app. ``chunk_search`` is the one retrieval service that the UI,
the REST API, the answer pipeline and ``eval_retrieval`` all call.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.db import connection, transaction

from ragsite import metrics
from ragsite.errors import DomainError
from search.embedders import query_embedding
from search.models import Collection, Workspace
from search.query_syntax import SYNTAXES, ParsedQuery, query_parse
from search.vector_indexes import bm25_index_exists, dense_distance_sql

MODES = ("hybrid", "dense", "keyword")
# ts_headline marks matches with these; the text is HTML-escaped afterwards and only
# then are they turned into <mark>, so document text can never inject markup.
_MARK_START, _MARK_END = "\x02", "\x03"
# Per document, a ranking reads this many chunks per wanted document (a document may hold
# several matching chunks) and keeps each document's best.
PER_DOCUMENT_CHUNK_FACTOR = 3


class SearchError(DomainError):
    """A search that cannot run as asked (unknown mode, collections of mixed models...)."""


@dataclass(frozen=True)
class SearchHit:
    chunk_id: int
    document_id: int
    document_title: str
    collection_id: int
    ordinal: int
    text: str
    start_offset: int
    end_offset: int
    score: float
    dense_rank: int | None
    keyword_rank: int | None
    snippet_html: str


@dataclass
class SearchResult:
    query: str
    mode: str
    hits: list[SearchHit]
    timings_ms: dict[str, float] = field(default_factory=dict)
    # How keyword candidates were found: "exact" (every matching chunk scored) or
    # "index" (BM25 HNSW index, for queries whose words are common); None without keywords.
    keyword_path: str | None = None
    # What the query was read as: "search" (typed syntax honoured) or "question".
    syntax: str = "search"


def _collections_for(workspace: Workspace | None, collection_ids: list[int] | None) -> list[Collection]:
    queryset = Collection.objects.all()
    if workspace is not None:
        queryset = queryset.filter(workspace=workspace)
    if collection_ids is not None:
        queryset = queryset.filter(pk__in=collection_ids)
    collections = list(queryset.order_by("pk"))
    if collection_ids is not None and len(collections) != len(set(collection_ids)):
        missing = sorted(set(collection_ids) - {c.pk for c in collections})
        raise SearchError(f"unknown collection ids: {', '.join(map(str, missing))}")
    return collections


@metrics.search_timed  # ragsite_search_duration_seconds{mode}
def chunk_search(
    *,
    query: str,
    workspace: Workspace | None,
    collection_ids: list[int] | None = None,
    mode: str = "hybrid",
    top_k: int = 10,
    metadata: dict | None = None,
    per_document: bool = False,
    candidates: int | None = None,
    rrf_k: int | None = None,
    dense_weight: float | None = None,
    keyword_weight: float | None = None,
    ef_search: int | None = None,
    snippets: bool = True,
    syntax: str = "auto",
) -> SearchResult:
    """Search chunks of a workspace's collections, best first.

    - ``mode``: ``dense`` (HNSW cosine), ``keyword`` (BM25 over PostgreSQL full text) or
      ``hybrid`` (both, fused by weighted reciprocal rank), in one SQL statement.
    - ``metadata``: documents whose metadata contains these keys and values.
    - ``per_document``: at most one hit per document (its best chunk); each ranking then
      contributes its best ``candidates`` documents to the fusion, not chunks.
    - ``syntax``: ``search`` (quotes, ``-word`` and ``OR`` honoured), ``question`` (no
      syntax: every word ranks) or ``auto`` (a search box: a question when it reads as one).
    - ``workspace=None`` searches across tenants: for management commands only.
    """
    if mode not in MODES:
        raise SearchError(f"unknown search mode {mode!r}: use one of {', '.join(MODES)}")
    if syntax not in SYNTAXES:
        raise SearchError(f"unknown query syntax {syntax!r}: use one of {', '.join(SYNTAXES)}")
    query = query.strip()
    if not query:
        raise SearchError("the query is empty")
    top_k = max(1, min(int(top_k), 1000))
    started = time.perf_counter()
    timings: dict[str, float] = {}
    collections = _collections_for(workspace, collection_ids)
    if not collections:
        return SearchResult(query=query, mode=mode, hits=[], timings_ms={"total": 0.0})
    models = {(c.embedding_model, c.embedding_dimensions) for c in collections}
    configs = {c.text_search_config for c in collections}
    if mode != "keyword" and len(models) > 1:
        raise SearchError("these collections use different embedding models; search them separately")
    if mode != "dense" and len(configs) > 1:
        raise SearchError("these collections use different text-search languages; search them separately")
    model, dimensions = next(iter(models))
    config = next(iter(configs))

    candidates = max(top_k, candidates or settings.SEARCH_CANDIDATES)
    params: dict = {
        "collections": [c.pk for c in collections],
        # Only chunks of each collection's current model: during `reembed` a collection
        # briefly holds chunks of two models, and a search must see one copy of each.
        "model": model,
        "models": sorted({c.embedding_model for c in collections}),
        "candidates": candidates,
        # Per document, a ranking reads more chunks so that `candidates` documents remain.
        "chunk_candidates": min(1000, candidates * PER_DOCUMENT_CHUNK_FACTOR) if per_document else candidates,
        "top_k": top_k,
        "config": config,
        "rrf_k": float(rrf_k or settings.SEARCH_RRF_K),
        "dense_weight": float(settings.SEARCH_DENSE_WEIGHT if dense_weight is None else dense_weight),
        "keyword_weight": float(settings.SEARCH_KEYWORD_WEIGHT if keyword_weight is None else keyword_weight),
        "mark": f"StartSel={_MARK_START}, StopSel={_MARK_END}, MaxWords=40, MinWords=20, MaxFragments=2, "
        f'FragmentDelimiter=" … "',
    }
    metadata_sql = ""
    if metadata:
        import json

        params["metadata"] = json.dumps(metadata)
        metadata_sql = (
            " AND EXISTS (SELECT 1 FROM search_document d WHERE d.id = c.document_id"
            " AND d.metadata @> %(metadata)s::jsonb)"
        )

    parsed = query_parse(query, syntax=syntax)
    params["rank_text"] = parsed.rank_text
    params["required"] = parsed.required_websearch(config)
    use_dense = mode in ("dense", "hybrid")
    use_keyword = mode in ("keyword", "hybrid")
    query_bm25, matching_rows, params["terms"] = None, 0, ""
    if use_keyword or snippets:
        query_bm25, matching_rows, params["terms"] = _query_bm25(params)
    use_keyword = use_keyword and query_bm25 is not None
    filter_sql = _keyword_filter_sql(parsed)

    def best_per_document(cte: str, order: str) -> str:
        # Per document, each ranking keeps the document's best chunk before fusion: a
        # document is ranked by its best passage in each list, as the evaluation defines.
        if not per_document:
            return cte
        return f"(SELECT DISTINCT ON (document_id) * FROM {cte} ORDER BY document_id, {order}, id) AS best"

    # Each ranking contributes its best `candidates` results (documents, per document).
    within_depth = " WHERE rank <= %(candidates)s" if per_document else ""

    ctes = []
    if use_dense:
        embed_started = time.perf_counter()
        params["query_vector"] = "[" + ",".join(f"{x:.7g}" for x in query_embedding(model, query)) + "]"
        timings["embed"] = (time.perf_counter() - embed_started) * 1000
        distance = dense_distance_sql(dimensions)
        # MATERIALIZED + re-sort: with iterative index scans the index returns rows in
        # relaxed order (pgvector's documented pattern).
        ctes.append(f"""
        dense AS MATERIALIZED (
            SELECT c.id, c.document_id, {distance} AS distance
            FROM search_chunk c
            WHERE c.collection_id = ANY(%(collections)s) AND c.embedding_dimensions = {int(dimensions)}
              AND c.embedding_model = %(model)s{metadata_sql}
            ORDER BY {distance}
            LIMIT %(chunk_candidates)s
        ),
        dense_ranked AS (
            SELECT * FROM (
                SELECT id, document_id, row_number() OVER (ORDER BY distance, id) AS rank, 1 - distance AS score
                FROM {best_per_document("dense", "distance")}
            ) ranked{within_depth}
        )""")
    keyword_path = None
    if use_keyword:
        params["query_bm25"] = query_bm25
        common = matching_rows > settings.SEARCH_KEYWORD_EXACT_MAX_ROWS
        keyword_path = "index" if common and bm25_index_exists() else "exact"
    if use_keyword and keyword_path == "exact":
        # Every chunk holding a query word (GIN) is scored: exact BM25.
        ctes.append(f"""
        keyword AS MATERIALIZED (
            SELECT c.id, c.document_id, (c.bm25 <#> %(query_bm25)s::sparsevec) AS negative_score
            FROM search_chunk c
            WHERE c.collection_id = ANY(%(collections)s) AND c.tsv @@ {filter_sql}
              AND c.embedding_model = ANY(%(models)s){metadata_sql}
              AND (c.bm25 <#> %(query_bm25)s::sparsevec) < 0  -- at least one ranked term matches
            ORDER BY c.bm25 <#> %(query_bm25)s::sparsevec, c.id
            LIMIT %(chunk_candidates)s
        )""")
    elif use_keyword:
        # Common words match a large share of the collection: the HNSW index over the BM25
        # vectors finds the best inner products instead; typed phrases and exclusions
        # still filter (the iterative scan goes on until enough rows pass).
        required_sql = ""
        if parsed.phrases or parsed.excluded:
            required_sql = " AND c.tsv @@ websearch_to_tsquery(%(config)s::regconfig, %(required)s)"
        ctes.append(f"""
        keyword AS MATERIALIZED (
            SELECT c.id, c.document_id, (c.bm25 <#> %(query_bm25)s::sparsevec) AS negative_score
            FROM search_chunk c
            WHERE c.collection_id = ANY(%(collections)s) AND c.embedding_model = ANY(%(models)s)
              AND (c.bm25 <#> %(query_bm25)s::sparsevec) < 0{required_sql}{metadata_sql}
            ORDER BY c.bm25 <#> %(query_bm25)s::sparsevec
            LIMIT %(chunk_candidates)s
        )""")
    if use_keyword:
        ctes.append(f"""
        keyword_ranked AS (
            SELECT * FROM (
                SELECT id, document_id, row_number() OVER (ORDER BY negative_score, id) AS rank,
                       -negative_score AS score
                FROM {best_per_document("keyword", "negative_score")}
            ) ranked{within_depth}
        )""")
    if not ctes:
        return SearchResult(query=query, mode=mode, hits=[], timings_ms={"total": 0.0})

    if use_dense and use_keyword:
        join = "document_id" if per_document else "id"
        fused = f"""
        fused AS (
            -- Weighted reciprocal-rank fusion. Per document, the keyword list's chunk is shown
            -- when there is one (its matched terms can be highlighted).
            SELECT coalesce(k.id, d.id) AS id, coalesce(d.document_id, k.document_id) AS document_id,
                   d.rank AS dense_rank, k.rank AS keyword_rank,
                   coalesce(%(dense_weight)s / (%(rrf_k)s + d.rank), 0)
                 + coalesce(%(keyword_weight)s / (%(rrf_k)s + k.rank), 0) AS score
            FROM dense_ranked d FULL OUTER JOIN keyword_ranked k ON d.{join} = k.{join}
        )"""
    elif use_dense:
        fused = """
        fused AS (SELECT id, document_id, rank AS dense_rank, NULL::bigint AS keyword_rank, score FROM dense_ranked)"""
    else:
        fused = """
        fused AS (
            SELECT id, document_id, NULL::bigint AS dense_rank, rank AS keyword_rank, score FROM keyword_ranked
        )"""
    ctes.append(fused)
    ctes.append("""
        top AS (SELECT * FROM fused ORDER BY score DESC, id LIMIT %(top_k)s)""")

    # Snippets mark the query's ranked terms (not its stop words or single characters).
    snippet_sql = "ts_headline(c.ts_config, c.text, %(terms)s::tsquery, %(mark)s)" if snippets else "''"
    sql = (
        "WITH "
        + ",".join(ctes)
        + f"""
        SELECT t.id, t.document_id, doc.title, c.collection_id, c.ordinal, c.text, c.start_offset, c.end_offset,
               t.score, t.dense_rank, t.keyword_rank, {snippet_sql}
        FROM top t
        JOIN search_chunk c ON c.id = t.id
        JOIN search_document doc ON doc.id = t.document_id
        ORDER BY t.score DESC, t.id
        """
    )
    query_started = time.perf_counter()
    ef = max(ef_search or settings.HNSW_EF_SEARCH, candidates)
    if keyword_path == "index":
        ef = max(ef, settings.KEYWORD_HNSW_EF_SEARCH)
    with transaction.atomic(), connection.cursor() as cursor:
        # SET LOCAL: these hold for this transaction only, so pooled connections are unaffected.
        cursor.execute(
            f"SET LOCAL hnsw.ef_search = {int(min(ef, 1000))};"
            " SET LOCAL hnsw.iterative_scan = relaxed_order;"
            " SET LOCAL client_min_messages = warning"
        )
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    timings["sql"] = (time.perf_counter() - query_started) * 1000
    hits = [
        SearchHit(
            chunk_id=row[0],
            document_id=row[1],
            document_title=row[2],
            collection_id=row[3],
            ordinal=row[4],
            text=row[5],
            start_offset=row[6],
            end_offset=row[7],
            score=float(row[8]),
            dense_rank=row[9],
            keyword_rank=row[10],
            snippet_html=_snippet_html(row[11]) if snippets else "",
        )
        for row in rows
    ]
    timings["total"] = (time.perf_counter() - started) * 1000
    return SearchResult(
        query=query, mode=mode, hits=hits, timings_ms=timings, keyword_path=keyword_path, syntax=parsed.syntax
    )


def _query_bm25(params: dict) -> tuple[str | None, int, str]:
    """The query side of BM25, how many chunks hold any of its terms, and its terms as a
    ``tsquery`` (any of them); ``(None, 0, "")`` when the query has no rankable term.

    A term weighs its IDF times the number of times the query holds it, as Lucene's
    ``BooleanQuery`` and bm25s score a repeated term (docs/search.md).
    """
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH query_lexemes AS (
                SELECT u.lexeme, search_term_index(u.lexeme) AS term,
                       coalesce(array_length(u.positions, 1), 1) AS qtf
                FROM unnest(search_tsvector(%(config)s::regconfig, %(rank_text)s)) u
                WHERE search_bm25_lexeme(u.lexeme)
            ), query_terms AS (
                SELECT term, sum(qtf) AS qtf FROM query_lexemes GROUP BY term
            ), term_stats AS (
                SELECT q.term, q.qtf, coalesce((
                    SELECT sum(t.df) FROM search_termstat t
                    WHERE t.term = q.term AND t.collection_id = ANY(%(collections)s)
                ), 0) AS df
                FROM query_terms q
            ), total AS (
                SELECT coalesce(sum(chunk_count), 0) AS n FROM search_collection WHERE id = ANY(%(collections)s)
            )
            SELECT format('{%%s}/1000000000', string_agg(
                       s.term || ':' || s.qtf * ln(1 + (total.n - s.df + 0.5) / (s.df + 0.5)), ',' ORDER BY s.term)),
                   -- an upper bound on the chunks holding any query word
                   least(coalesce(sum(s.df), 0), max(total.n)),
                   count(*),
                   -- the lexemes as tsquery literals (ASCII punctuation, backslashes included,
                   -- never reaches a lexeme: search_text_normalize)
                   (SELECT string_agg(quote_literal(lexeme), ' | ' ORDER BY lexeme)
                    FROM query_lexemes)
            FROM term_stats s, total
            """,
            params,
        )
        vector, matching_rows, terms, any_term = cursor.fetchone()
    if not terms:
        return None, 0, ""
    return vector, int(matching_rows), any_term


def _keyword_filter_sql(parsed: ParsedQuery) -> str:
    """The tsquery a keyword candidate must match: any ranked term, and what typed syntax requires."""
    if parsed.phrases or parsed.excluded:
        return "(%(terms)s::tsquery && websearch_to_tsquery(%(config)s::regconfig, %(required)s))"
    return "%(terms)s::tsquery"


def _snippet_html(headline: str) -> str:
    escaped = html.escape(" ".join(headline.split()))
    return escaped.replace(_MARK_START, "<mark>").replace(_MARK_END, "</mark>")


def texts_lexemes(texts: list[str], config: str, *, numbers: bool = True) -> list[list[str]]:
    """Each text's BM25 lexemes as keyword search analyses text (``search_tsvector`` under
    ``config``), all texts in one statement; ``numbers=False`` leaves out lexemes of digits
    only (compared as numbers by the caller). Used to compare sentences with passages
    (``search.verification``, ``search.abstention``)."""
    digits = "" if numbers else " AND lexeme !~ '^[0-9]+$'"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT array(SELECT lexeme FROM unnest(search_tsvector(%s::regconfig, t))"
            f" WHERE search_bm25_lexeme(lexeme){digits})"
            " FROM unnest(%s::text[]) WITH ORDINALITY AS x(t, i) ORDER BY i",
            [config, texts],
        )
        return [list(row[0]) for row in cursor.fetchall()]
