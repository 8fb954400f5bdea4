"""BM25 inside PostgreSQL: each chunk's weights, its collection's term statistics, a query's vector.

A chunk stores its BM25 document vector (``search_chunk.bm25``, a ``sparsevec``: per term,
the saturated and length-normalised term frequency); a query's vector holds each of its
terms' IDF, so that their inner product is the chunk's BM25 score (docs/search.md). The IDF
needs each term's document frequency in the collection (``search_termstat``) and the
collection's chunk count; the length normalisation, its average chunk length. This module
is the only one that writes those or reads them back:

- ``WEIGHTS`` weighs a ``tsvector`` (the insert of new chunks, ``collection_bm25_refresh``);
- ``statistics_add`` / ``statistics_remove`` / ``statistics_rebuild`` keep the term
  statistics, all three over one definition of a chunk's terms (``_TERMS``);
- ``query_vector`` turns a query into its IDF vector, its terms and the rows they match.

The SQL functions (``search_tsvector``, ``search_term_index``, ``search_bm25_lexeme``,
``search_bm25_document_vector``) are the migrations'.
"""

from __future__ import annotations

from django.conf import settings
from django.db import connection, transaction

from ragsite.databases import reads
from search import analysis
from search.models import Collection
from search.query_syntax import ParsedQuery

# Re-weigh a collection's BM25 vectors when its average chunk length has drifted this far
# from the one the stored weights were computed with.
AVGDL_DRIFT_LIMIT = 0.2

# A tsvector's BM25 document vector at the collection's average length; parameters
# ``avgdl``, ``k1`` and ``b`` (``weights_params``).
WEIGHTS = "search_bm25_document_vector({tsvector}, %(avgdl)s, %(k1)s, %(b)s)"

# The ranked terms of the chunks ``{scope}`` selects (alias ``c``): one row per chunk and
# term, with the term's frequency in the chunk. Stop words and single characters are not
# ranked (``search_bm25_lexeme``), so they are neither counted nor weighed.
_TERMS = """
    SELECT c.id, search_term_index(u.lexeme) AS term, coalesce(array_length(u.positions, 1), 1) AS tf
    FROM search_chunk c, unnest(c.tsv) u
    WHERE {scope} AND search_bm25_lexeme(u.lexeme)
"""


def weights_params(avgdl: float) -> dict:
    return {"avgdl": avgdl, "k1": settings.BM25_K1, "b": settings.BM25_B}


def staging_avgdl(cursor, staging_table: str) -> float:
    """The average ranked length of the chunks in ``staging_table`` (columns ``ts_config``,
    ``text`` and ``lexemes``): a collection's first documents set its length normalisation."""
    cursor.execute(
        "SELECT avg((SELECT sum(coalesce(array_length(u.positions, 1), 1))"
        " FROM unnest(search_tsvector(s.ts_config::regconfig, coalesce(s.lexemes, s.text))) u"
        f" WHERE search_bm25_lexeme(u.lexeme))) FROM {staging_table} s"
    )
    return float(cursor.fetchone()[0] or 1.0)


def statistics_add(cursor, collection_id: int, document_ids: list[int]) -> int:
    """Count the documents' chunks into the collection's document frequencies; returns their
    ranked lexemes. Inside the caller's transaction, the collection row locked."""
    cursor.execute(
        f"""
        WITH terms AS ({_TERMS.format(scope="c.document_id = ANY(%(documents)s)")}),
        added AS (
            INSERT INTO search_termstat (collection_id, term, df)
            SELECT %(collection)s, term, count(DISTINCT id) FROM terms GROUP BY term ORDER BY term
            ON CONFLICT (collection_id, term) DO UPDATE SET df = search_termstat.df + EXCLUDED.df
        )
        SELECT coalesce(sum(tf), 0) FROM terms
        """,
        {"documents": document_ids, "collection": collection_id},
    )
    return int(cursor.fetchone()[0])


def statistics_remove(cursor, collection_id: int, document_id: int, model: str) -> tuple[int, int]:
    """Take a document's chunks of ``model`` (the collection's, the only ones counted) out of
    the collection's document frequencies; returns (their chunks, their ranked lexemes). Call
    before deleting the chunks, inside the caller's transaction, the collection row locked."""
    cursor.execute(
        f"""
        WITH terms AS ({_TERMS.format(scope="c.document_id = %(document)s AND c.embedding_model = %(model)s")}),
        removed AS (
            UPDATE search_termstat t SET df = t.df - r.n
            FROM (SELECT term, count(DISTINCT id) AS n FROM terms GROUP BY term) r
            WHERE t.collection_id = %(collection)s AND t.term = r.term
        )
        SELECT (SELECT count(*) FROM search_chunk WHERE document_id = %(document)s AND embedding_model = %(model)s),
               coalesce(sum(tf), 0)
        FROM terms
        """,
        {"document": document_id, "collection": collection_id, "model": model},
    )
    chunks, lexemes = cursor.fetchone()
    return int(chunks), int(lexemes)


def statistics_prune(cursor, collection_id: int) -> None:
    """Forget the terms no chunk of the collection holds any more."""
    cursor.execute("DELETE FROM search_termstat WHERE collection_id = %s AND df <= 0", [collection_id])


def statistics_rebuild(cursor, collection_id: int) -> tuple[int, int]:
    """Recompute a collection's document frequencies from its chunks; returns (chunks,
    ranked lexemes). For bulk loads and model switches, where counting once beats updating
    per document. Inside the caller's transaction."""
    cursor.execute("DELETE FROM search_termstat WHERE collection_id = %s", [collection_id])
    cursor.execute(
        f"""
        WITH terms AS ({_TERMS.format(scope="c.collection_id = %(collection)s")}),
        added AS (
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


def avgdl_drifted(collection: Collection) -> bool:
    """Whether the collection's stored weights were computed with an average chunk length
    more than ``AVGDL_DRIFT_LIMIT`` away from today's (then ``collection_bm25_refresh``)."""
    if not collection.chunk_count or collection.bm25_avgdl <= 0:
        return False
    current = collection.lexeme_total / collection.chunk_count
    return abs(current - collection.bm25_avgdl) / collection.bm25_avgdl > AVGDL_DRIFT_LIMIT


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
                f"""
                WITH batch AS (
                    SELECT id FROM search_chunk WHERE collection_id = %(collection)s AND id > %(last)s
                    ORDER BY id LIMIT %(size)s
                )
                UPDATE search_chunk c
                SET bm25 = {WEIGHTS.format(tsvector="c.tsv")}
                FROM batch WHERE c.id = batch.id
                RETURNING c.id
                """,
                {"collection": collection_id, "last": last_id, "size": batch_size, **weights_params(avgdl)},
            )
            ids = [row[0] for row in cursor.fetchall()]
        if not ids:
            break
        last_id = max(ids)
    Collection.objects.filter(pk=collection_id).update(bm25_avgdl=avgdl)
    return avgdl


def query_vector(*, config: str, rank_text: str, collection_ids: list[int]) -> tuple[str | None, int, str]:
    """The query side of BM25, how many chunks hold any of its terms, and its terms as a
    ``tsquery`` (any of them); ``(None, 0, "")`` when the query has no rankable term.

    A term weighs its IDF times the number of times the query holds it, as Lucene's
    ``BooleanQuery`` and bm25s score a repeated term (docs/search.md).
    """
    with reads().cursor() as cursor:
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
            {"config": config, "rank_text": rank_text, "collections": collection_ids},
        )
        vector, matching_rows, terms, any_term = cursor.fetchone()
    if not terms:
        return None, 0, ""
    return vector, int(matching_rows), any_term


def keyword_filter_sql(parsed: ParsedQuery) -> str:
    """The tsquery a keyword candidate must match: any ranked term (``%(terms)s``), and what
    typed syntax requires (``%(required)s`` under ``%(config)s``)."""
    if parsed.phrases or parsed.excluded:
        return "(%(terms)s::tsquery && websearch_to_tsquery(%(config)s::regconfig, %(required)s))"
    return "%(terms)s::tsquery"


def texts_lexemes(texts: list[str], config: str, *, numbers: bool = True) -> list[list[str]]:
    """Each text's BM25 lexemes as keyword search analyses text, all texts in one statement:
    each in its own language (search.analysis: a Japanese text's words analysed first, then
    ``search_tsvector`` under ``search_japanese``; others under ``config``). ``numbers=False``
    leaves out lexemes of digits only (compared as numbers by the caller). Used to compare
    sentences with passages (``search.answering.verification``, ``search.answering.abstention``)."""
    analysed = [analysis.analysed(text, language=analysis.AUTO, config=config) for text in texts]
    digits = "" if numbers else " AND lexeme !~ '^[0-9]+$'"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT array(SELECT lexeme FROM unnest(search_tsvector(c::regconfig, t))"
            f" WHERE search_bm25_lexeme(lexeme){digits})"
            " FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS x(c, t, i) ORDER BY i",
            [
                [c for c, _ in analysed],
                [terms if terms is not None else text for (_, terms), text in zip(analysed, texts, strict=True)],
            ],
        )
        return [list(row[0]) for row in cursor.fetchall()]
