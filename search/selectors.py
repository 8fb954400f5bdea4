"""Reads for the search app. ``chunk_search`` is the one retrieval service that the UI,
the REST API, the answer pipeline and ``eval_retrieval`` all call.

A search is one SQL statement of common table expressions, assembled here from named parts:
each ranking (``_dense_ranking``, ``_keyword_ranking``) gives its best candidates a rank,
``_fusion`` combines them (weighted reciprocal rank in hybrid mode), and ``_statement``
reads the top hits with their snippets. The BM25 side (the query's vector, its terms) is
``search.bm25``'s.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction

from ragsite import metrics
from ragsite.databases import reads, reads_alias
from ragsite.errors import DomainError
from search import analysis, bm25
from search.access import RESTRICTED_SQL, WORKSPACE, Reader
from search.analysis import highlight
from search.embedders import embedder_languages, query_embedding
from search.models import Collection, Workspace
from search.query_syntax import SYNTAXES, ParsedQuery, query_parse
from search.scoping import collections_chosen
from search.vector_indexes import bm25_index_exists, dense_distance_sql

MODES = ("hybrid", "dense", "keyword")
# ts_headline marks matches with these; the text is HTML-escaped afterwards and only
# then are they turned into <mark>, so document text can never inject markup.
_MARK_START, _MARK_END = "\x02", "\x03"
# Per document, a ranking reads this many chunks per wanted document (a document may hold
# several matching chunks) and keeps each document's best.
PER_DOCUMENT_CHUNK_FACTOR = 3
# A dense-only search reads this many candidates per hit asked for. A filtered scan (a reader
# who may see 10 %) passes over nine rows for each it keeps, so each candidate costs there
# (benchmarks.permissions, docs/benchmarks.md: 100 candidates gave a p99 2.7 times the
# unrestricted one, 50 gave 1.6 to 2.2, 30 gave 1.3 with recall 0.996; 20 lost recall, 0.979).
DENSE_ONLY_CANDIDATES_PER_HIT = 3


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
    # The document's own date (ISO 8601, from its metadata), when it states one.
    document_date: str | None = None


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


@dataclass(frozen=True)
class _DenseGroup:
    """Collections of one embedding model: one dense ranking, with the query embedded by it."""

    model: str
    dimensions: int
    collection_ids: list[int]


@dataclass(frozen=True)
class _Scope:
    """What a search runs over: its collections, their embedding models and the text-search
    configuration they share."""

    collections: list[Collection]
    dense_groups: list[_DenseGroup]
    config: str
    # The collections' language setting (search.analysis): "auto" when they differ.
    language: str


@metrics.search_timed  # ragsite_search_duration_seconds{mode}
def chunk_search(
    *,
    query: str,
    workspace: Workspace | None,
    collection_ids: list[int | Collection] | None = None,
    mode: str = "hybrid",
    top_k: int = 10,
    metadata: dict | None = None,
    documents_excluded: list[int] | None = None,
    reader: Reader = WORKSPACE,
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
    - ``documents_excluded``: ids of documents left out, as if they were not in the collections
      (``eval_answers --removed-source`` asks questions whose own passage is gone).
    - ``reader``: whose search it is (search.access): only chunks it may read are ranked, inside
      each ranking's scan, so a restricted reader still gets a full ``top_k``. Few readable
      chunks (``SEARCH_EXACT_READABLE_MAX_CHUNKS``) are ranked exactly, from their documents,
      rather than by an index scan that would pass over the rest (docs/access.md).
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
    scope = _scope(workspace, collection_ids, mode)
    if scope is None:
        return SearchResult(query=query, mode=mode, hits=[], timings_ms={"total": 0.0})

    if candidates is None and mode == "dense" and not per_document:
        # Nothing past top_k is read without a fusion; a few more than top_k keep the re-sort of
        # an iterative scan's relaxed order honest, and a restricted reader's filtered scan short.
        candidates = min(settings.SEARCH_CANDIDATES, DENSE_ONLY_CANDIDATES_PER_HIT * top_k)
    candidates = max(top_k, candidates or settings.SEARCH_CANDIDATES)
    query_language = analysis.language_resolved(scope.language, query)
    config, parsed = _query_analysed(scope, query_language, query_parse(query, syntax=syntax))
    params = _params(
        scope, config, parsed, candidates=candidates, top_k=top_k, per_document=per_document, metadata=metadata
    )
    params["rrf_k"] = float(rrf_k or settings.SEARCH_RRF_K)
    if dense_weight is None:
        japanese = query_language == analysis.JAPANESE
        dense_weight = settings.SEARCH_DENSE_WEIGHT_JAPANESE if japanese else settings.SEARCH_DENSE_WEIGHT
    params["dense_weight"] = float(dense_weight)
    params["keyword_weight"] = float(settings.SEARCH_KEYWORD_WEIGHT if keyword_weight is None else keyword_weight)
    # Which documents a ranking may return: by their metadata, less those excluded.
    documents_sql = (_METADATA_SQL if metadata else "") + (_EXCLUDED_SQL if documents_excluded else "")
    if documents_excluded:
        params["documents_excluded"] = [int(pk) for pk in documents_excluded]
    readable = None  # the documents a restricted reader may read, when they are few
    chunks = readable_chunks = sum(c.chunk_count for c in scope.collections)
    if not reader.unrestricted:
        documents_sql += _READERS_SQL
        params["readers"] = list(reader.principals)
        readable_chunks, readable = _readable(params["collections"], params["readers"], chunks)
        if readable is not None:
            params["readable"] = readable

    use_dense = mode in ("dense", "hybrid")
    use_keyword = mode in ("keyword", "hybrid")
    query_bm25, matching_rows, params["terms"] = None, 0, ""
    if use_keyword or snippets:  # snippets mark the query's ranked terms
        query_bm25, matching_rows, params["terms"] = bm25.query_vector(
            config=config, rank_text=params["rank_text"], collection_ids=params["collections"]
        )
    use_keyword = use_keyword and query_bm25 is not None

    ctes = []
    groups = _dense_groups_read(scope.dense_groups, query_language) if use_dense else []
    if groups:
        embed_started = time.perf_counter()
        for index, group in enumerate(groups):
            vector = query_embedding(group.model, query)
            params[f"query_vector{index}"] = "[" + ",".join(f"{x:.7g}" for x in vector) + "]"
            params[f"model{index}"] = group.model
            params[f"collections{index}"] = group.collection_ids
        timings["embed"] = (time.perf_counter() - embed_started) * 1000
        # Beside another model's, a ranking reads the chunks in the query's language only.
        language_sql = _chunk_language_sql(query_language) if len(groups) > 1 else ""
        # A small scope is compared whole: in an index shared with larger collections, a filtered
        # HNSW scan gives up (hnsw.max_scan_tuples) before it reaches a few thousand chunks of one
        # tenant among millions, and returns fewer than k, or none.
        exact = chunks <= settings.SEARCH_EXACT_READABLE_MAX_CHUNKS
        ctes.append(
            _dense_ranking(
                groups, documents_sql + language_sql, per_document, exact=exact, readable=readable is not None
            )
        )
    keyword_path = None
    if use_keyword:
        params["query_bm25"] = query_bm25
        # A restricted reader's exact ranking scores only the matching chunks it may read.
        readable_share = readable_chunks / chunks if chunks else 1.0
        common = matching_rows * readable_share > settings.SEARCH_KEYWORD_EXACT_MAX_ROWS
        keyword_path = "index" if common and bm25_index_exists() and readable is None else "exact"
        # Fewer readable chunks than matching ones: start from what the reader may read (its GIN
        # bitmap) and test the words row by row, rather than build the words' bitmap over the
        # whole collection (22 of 33 ms for a long query matching 76 % of 100,000 chunks).
        by_readers = readable_chunks < min(chunks, matching_rows)
        ctes.append(
            _keyword_ranking(
                keyword_path, parsed, documents_sql, per_document, readable=readable is not None, by_readers=by_readers
            )
        )
    if not ctes:
        return SearchResult(query=query, mode=mode, hits=[], timings_ms={"total": 0.0})
    ctes.append(_fusion(bool(groups), use_keyword, per_document))

    query_started = time.perf_counter()
    ef = max(ef_search or settings.HNSW_EF_SEARCH, candidates)
    if keyword_path == "index":
        ef = max(ef, settings.KEYWORD_HNSW_EF_SEARCH)
    rows = _run(_statement(ctes, snippets), params, ef_search=ef)
    timings["sql"] = (time.perf_counter() - query_started) * 1000
    hits = [_hit(row, snippets, parsed.rank_text) for row in rows]
    if analysis.asks_for_latest(query):
        hits = _newest_first(hits)
    timings["total"] = (time.perf_counter() - started) * 1000
    return SearchResult(
        query=query, mode=mode, hits=hits, timings_ms=timings, keyword_path=keyword_path, syntax=parsed.syntax
    )


def _scope(workspace: Workspace | None, collection_ids: list[int | Collection] | None, mode: str) -> _Scope | None:
    """The collections searched and what they share (None: the workspace has none). Keyword
    ranking needs one text-search configuration (Japanese chunks aside: search.analysis);
    collections of different embedding models are ranked by each model apart and fused."""
    collections = collections_chosen(workspace, collection_ids)
    if not collections:
        return None
    configs = {c.text_search_config for c in collections}
    if mode != "dense" and len(configs) > 1:
        raise SearchError("these collections use different text-search languages; search them separately")
    by_model: dict[tuple[str, int], list[int]] = {}
    for c in collections:
        by_model.setdefault((c.embedding_model, c.embedding_dimensions), []).append(c.pk)
    groups = [_DenseGroup(model, dimensions, ids) for (model, dimensions), ids in sorted(by_model.items())]
    languages = {c.language for c in collections}
    language = languages.pop() if len(languages) == 1 else analysis.AUTO
    return _Scope(collections=collections, dense_groups=groups, config=next(iter(configs)), language=language)


def _dense_groups_read(groups: list[_DenseGroup], query_language: str) -> list[_DenseGroup]:
    """The dense rankings a query is given. Beside others, a model that does not read the
    query's language (all-MiniLM-L6-v2 and Japanese) ranks nothing: its nearest chunks to a
    query it cannot read are noise, and reciprocal-rank fusion would credit them as a first
    place (docs/search.md, "A whole workspace")."""
    if len(groups) < 2:
        return groups
    return [group for group in groups if query_language in embedder_languages(group.model)]


def _chunk_language_sql(query_language: str) -> str:
    """Chunks analysed in the query's language (search.analysis: Japanese chunks carry
    search_japanese, others their collection's configuration)."""
    operator = "=" if query_language == analysis.JAPANESE else "<>"
    return f" AND c.ts_config {operator} '{analysis.JAPANESE_CONFIG}'::regconfig"


def _query_analysed(scope: _Scope, query_language: str, parsed: ParsedQuery) -> tuple[str, ParsedQuery]:
    """The configuration a query is analysed under and its words as the index holds them: a
    Japanese query becomes the analysis module's terms, as Japanese chunks were indexed."""
    if query_language != analysis.JAPANESE:
        return scope.config, parsed

    def terms(text: str) -> str:
        return analysis.analysed(text, language=analysis.JAPANESE, config=scope.config)[1] or ""

    return analysis.JAPANESE_CONFIG, parsed.analysed(terms)


# Documents whose metadata contains the search's ``metadata`` (``%(metadata)s``, JSON).
_METADATA_SQL = (
    " AND EXISTS (SELECT 1 FROM search_document d WHERE d.id = c.document_id AND d.metadata @> %(metadata)s::jsonb)"
)

_EXCLUDED_SQL = " AND c.document_id <> ALL(%(documents_excluded)s)"
# Chunks the search's reader may read (search.access; %(readers)s: its principals).
_READERS_SQL = " AND c.readers && %(readers)s::varchar[]"


def _readable(collection_ids: list[int], principals: list[str], chunks: int) -> tuple[int, list[int] | None]:
    """How many of the collections' ``chunks`` ``principals`` may read, and the ids of the
    documents they may read when those hold at most ``SEARCH_EXACT_READABLE_MAX_CHUNKS`` chunks
    and not all of them; else None (the index scans, filtered, serve them).

    An HNSW scan filtered to 1 % of a collection visits a hundred rows for each one it keeps;
    ranking those few chunks exactly, found through their documents, costs less and misses
    none. Only the restricted documents are read to count (a partial index holds them): a
    collection open to its whole workspace costs one index probe per search."""
    params = {"collections": collection_ids, "readers": principals}
    with reads().cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(chunks_total), 0),"
            " coalesce(sum(chunks_total) FILTER (WHERE readers && %(readers)s::varchar[]), 0)"
            f" FROM search_document WHERE collection_id = ANY(%(collections)s) AND {RESTRICTED_SQL}",
            params,
        )
        restricted, restricted_readable = cursor.fetchone()
        readable_chunks = max(0, chunks - int(restricted) + int(restricted_readable))
        if readable_chunks >= chunks or readable_chunks > settings.SEARCH_EXACT_READABLE_MAX_CHUNKS:
            return readable_chunks, None
        cursor.execute(
            "SELECT coalesce(array_agg(id), '{}') FROM search_document"
            " WHERE collection_id = ANY(%(collections)s) AND readers && %(readers)s::varchar[]",
            params,
        )
        return readable_chunks, cursor.fetchone()[0]


def _params(
    scope: _Scope,
    config: str,
    parsed: ParsedQuery,
    *,
    candidates: int,
    top_k: int,
    per_document: bool,
    metadata: dict | None,
) -> dict:
    """The statement's bound parameters that the scope and the query decide."""
    params: dict = {
        "collections": [c.pk for c in scope.collections],
        # Only chunks of each collection's current model: during `reembed` a collection
        # briefly holds chunks of two models, and a search must see one copy of each.
        "models": sorted({c.embedding_model for c in scope.collections}),
        "candidates": candidates,
        # Per document, a ranking reads more chunks so that `candidates` documents remain.
        "chunk_candidates": min(1000, candidates * PER_DOCUMENT_CHUNK_FACTOR) if per_document else candidates,
        "top_k": top_k,
        "config": config,
        "rank_text": parsed.rank_text,
        "required": parsed.required_websearch(config),
        "mark": f"StartSel={_MARK_START}, StopSel={_MARK_END}, MaxWords=40, MinWords=20, MaxFragments=2, "
        f'FragmentDelimiter=" … "',
    }
    if metadata:
        params["metadata"] = json.dumps(metadata)
    return params


def _ranked(name: str, score_sql: str, order: str, per_document: bool) -> str:
    """``{name}_ranked``: the candidates of CTE ``name`` numbered best first, with their score.

    Per document, each ranking keeps the document's best chunk before fusion (a document is
    ranked by its best passage in each list, as the evaluation defines), and contributes its
    best ``candidates`` documents."""
    source = name
    within_depth = ""
    if per_document:
        source = f"(SELECT DISTINCT ON (document_id) * FROM {name} ORDER BY document_id, {order}, id) AS best"
        within_depth = " WHERE rank <= %(candidates)s"
    return f"""
        {name}_ranked AS (
            SELECT * FROM (
                SELECT id, document_id, row_number() OVER (ORDER BY {order}, id) AS rank, {score_sql} AS score
                FROM {source}
            ) ranked{within_depth}
        )"""


def _dense_ranking(
    groups: list[_DenseGroup], filter_sql: str, per_document: bool, *, exact: bool = False, readable: bool = False
) -> str:
    """The nearest chunks to the query's embedding (HNSW), ranked: one ranking per embedding
    model, over its own collections (disjoint, so ``dense_ranked`` is their union, each chunk
    with its rank in its own model's list). ``exact``: every chunk compared, no index;
    ``readable``: the chunks of ``%(readable)s`` documents only (``_readable``)."""
    ctes = []
    for index, group in enumerate(groups):
        if exact or readable:
            # Every row compared, on the stored fp32 vectors (no half-precision copy of each
            # made for the index's operator); "+ 0": an order no index provides.
            distance = f"(c.embedding <=> %(query_vector{index})s::vector({int(group.dimensions)}))"
            order = f"{distance} + 0"
        else:
            distance = order = dense_distance_sql(group.dimensions, f"%(query_vector{index})s")
        readable_sql = " AND c.document_id = ANY(%(readable)s)" if readable else ""
        # MATERIALIZED + re-sort: with iterative index scans the index returns rows in
        # relaxed order (pgvector's documented pattern).
        ctes.append(
            f"""
        dense{index} AS MATERIALIZED (
            SELECT c.id, c.document_id, {distance} AS distance
            FROM search_chunk c
            WHERE c.collection_id = ANY(%(collections{index})s) AND c.embedding_dimensions = {int(group.dimensions)}
              AND c.embedding_model = %(model{index})s{readable_sql}{filter_sql}
            ORDER BY {order}
            LIMIT %(chunk_candidates)s
        ),"""
            + _ranked(f"dense{index}", "1 - distance", "distance", per_document)
        )
    union = " UNION ALL ".join(f"SELECT * FROM dense{index}_ranked" for index in range(len(groups)))
    return (
        ",".join(ctes)
        + f""",
        dense_ranked AS ({union})"""
    )


def _keyword_ranking(
    path: str,
    parsed: ParsedQuery,
    documents_sql: str,
    per_document: bool,
    *,
    readable: bool = False,
    by_readers: bool = False,
) -> str:
    """The chunks of the best BM25 scores, ranked; ``path``: how they are found.

    ``exact``: every chunk holding a query word (GIN) is scored. ``index``: common words
    match a large share of the collection, so the HNSW index over the BM25 vectors finds the
    best inner products instead; typed phrases and exclusions still filter (the iterative
    scan goes on until enough rows pass). ``readable``: ``exact`` over the chunks of the few
    documents a restricted reader may read (``_readable``). ``by_readers``: the words are
    tested on each readable row ("IS TRUE": a form the words' GIN index does not serve)."""
    if readable:
        documents_sql = " AND c.document_id = ANY(%(readable)s)" + documents_sql
    if path == "exact":
        words_sql = f"c.tsv @@ {bm25.keyword_filter_sql(parsed)}"
        if by_readers and not (parsed.phrases or parsed.excluded):
            # "Any ranked term" is what the BM25 test below already says: testing each readable
            # row's tsvector too doubled the scan (21 against 11 ms over 10,000 readable chunks
            # of 100,000, the same rows: docs/access.md). Typed syntax still needs the words.
            words_sql = "TRUE"
        elif by_readers:
            words_sql = f"({words_sql}) IS TRUE"
        candidates = f"""
        keyword AS MATERIALIZED (
            SELECT c.id, c.document_id, (c.bm25 <#> %(query_bm25)s::sparsevec) AS negative_score
            FROM search_chunk c
            WHERE c.collection_id = ANY(%(collections)s) AND {words_sql}
              AND c.embedding_model = ANY(%(models)s){documents_sql}
              AND (c.bm25 <#> %(query_bm25)s::sparsevec) < 0  -- at least one ranked term matches
            -- "+ 0": no index provides this order, so every matching chunk is scored (the planner
            -- would otherwise read the BM25 HNSW index and sort incrementally: approximate).
            ORDER BY (c.bm25 <#> %(query_bm25)s::sparsevec) + 0, c.id
            LIMIT %(chunk_candidates)s
        ),"""
    else:
        required_sql = ""
        if parsed.phrases or parsed.excluded:
            required_sql = " AND c.tsv @@ websearch_to_tsquery(%(config)s::regconfig, %(required)s)"
        candidates = f"""
        keyword AS MATERIALIZED (
            SELECT c.id, c.document_id, (c.bm25 <#> %(query_bm25)s::sparsevec) AS negative_score
            FROM search_chunk c
            WHERE c.collection_id = ANY(%(collections)s) AND c.embedding_model = ANY(%(models)s)
              AND (c.bm25 <#> %(query_bm25)s::sparsevec) < 0{required_sql}{documents_sql}
            ORDER BY c.bm25 <#> %(query_bm25)s::sparsevec
            LIMIT %(chunk_candidates)s
        ),"""
    return candidates + _ranked("keyword", "-negative_score", "negative_score", per_document)


def _fusion(use_dense: bool, use_keyword: bool, per_document: bool) -> str:
    """``fused``: every candidate with its rank in each list and its final score, and
    ``top``, the best ``top_k`` of them."""
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
    return (
        fused
        + """,
        top AS (SELECT * FROM fused ORDER BY score DESC, id LIMIT %(top_k)s)"""
    )


def _statement(ctes: list[str], snippets: bool) -> str:
    """The whole statement: the CTEs, then the top hits with their chunks and documents."""
    # Snippets mark the query's ranked terms (not its stop words or single characters). A chunk
    # whose words PostgreSQL could not split (``lexemes``: Japanese) is marked in Python (_hit).
    snippet_sql = (
        "CASE WHEN c.lexemes IS NULL THEN ts_headline(c.ts_config, c.text, %(terms)s::tsquery, %(mark)s) END"
        if snippets
        else "''"
    )
    return (
        "WITH "
        + ",".join(ctes)
        + f"""
        SELECT t.id, t.document_id, doc.title, c.collection_id, c.ordinal, c.text, c.start_offset, c.end_offset,
               t.score, t.dense_rank, t.keyword_rank, {snippet_sql}, doc.metadata->>'date'
        FROM top t
        JOIN search_chunk c ON c.id = t.id
        JOIN search_document doc ON doc.id = t.document_id
        ORDER BY t.score DESC, t.id
        """
    )


def _run(sql: str, params: dict, *, ef_search: int) -> list[tuple]:
    with transaction.atomic(using=reads_alias()), reads().cursor() as cursor:
        # SET LOCAL: these hold for this transaction only, so pooled connections are unaffected.
        cursor.execute(
            f"SET LOCAL hnsw.ef_search = {int(min(ef_search, 1000))};"
            " SET LOCAL hnsw.iterative_scan = relaxed_order;"
            " SET LOCAL client_min_messages = warning"
        )
        cursor.execute(sql, params)
        return cursor.fetchall()


def _hit(row: tuple, snippets: bool, rank_text: str) -> SearchHit:
    return SearchHit(
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
        snippet_html=_snippet(row[5], row[11], rank_text) if snippets else "",
        document_date=row[12],
    )


def _newest_first(hits: list[SearchHit]) -> list[SearchHit]:
    """For a question asking for the latest: the dated hits newest first, in the places dated
    hits held (undated ones keep theirs). 「最新の売上報告」 ranks every quarter's report alike
    by its words; only the date tells which is the latest."""
    dated = [index for index, hit in enumerate(hits) if hit.document_date]
    ordered = sorted((hits[index] for index in dated), key=lambda hit: hit.document_date, reverse=True)
    result = list(hits)
    for index, hit in zip(dated, ordered, strict=True):
        result[index] = hit
    return result


def _snippet(text: str, headline: str | None, rank_text: str) -> str:
    if headline is None:
        return highlight.snippet_html(text, rank_text.split())
    return _snippet_html(headline)


def _snippet_html(headline: str) -> str:
    escaped = html.escape(" ".join(headline.split()))
    return escaped.replace(_MARK_START, "<mark>").replace(_MARK_END, "</mark>")
