"""SQL functions for BM25 inside PostgreSQL, and the HNSW index for 384-dimensional embeddings.

Lexemes come from PostgreSQL's own parser and stemmer (``to_tsvector``), so the keyword
index (GIN over ``tsv``) and the BM25 weights always agree on what a term is. Each lexeme
is hashed (first 32 bits of its MD5: stable across PostgreSQL versions, reproducible in
Python) into a sparse-vector index.
"""

from django.db import migrations

from search.vector_indexes import create_index_sql, index_name

TERM_INDEX = """
CREATE OR REPLACE FUNCTION search_term_index(lexeme text) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT (('x' || substr(md5(lexeme), 1, 8))::bit(32)::bigint % 1000000000)::integer + 1
$$;
"""

# Lexemes that count for BM25: single ASCII letters and digits (variable names, list
# markers, units) are left out, as BM25 tokenizers do; they stay in the tsvector, so
# phrases containing them still match.
BM25_LEXEME = """
CREATE OR REPLACE FUNCTION search_bm25_lexeme(lexeme text) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT lexeme !~ '^[a-z0-9]$'
$$;
"""

# Document side of BM25: w(t, d) = tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)),
# with dl the number of counted lexeme occurrences in the chunk. Lexemes that hash to the
# same index are summed (sparsevec indices must be unique).
DOCUMENT_VECTOR = """
CREATE OR REPLACE FUNCTION search_bm25_document_vector(tsv tsvector, avgdl float8, k1 float8, b float8)
RETURNS sparsevec LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    WITH all_terms AS (
        SELECT search_term_index(u.lexeme) AS idx, sum(coalesce(array_length(u.positions, 1), 1))::float8 AS tf
        FROM unnest(tsv) AS u
        WHERE search_bm25_lexeme(u.lexeme)
        GROUP BY 1
    ), length AS (
        SELECT coalesce(sum(tf), 0) AS dl FROM all_terms
    ), terms AS (
        -- pgvector indexes sparse vectors of up to 1000 elements: a chunk (at most a few
        -- hundred tokens) stays far below; keep the most frequent terms if one ever does not.
        SELECT * FROM all_terms ORDER BY tf DESC, idx LIMIT 1000
    )
    -- sparsevec text form: {index:value,...}/dimensions
    SELECT format('{%s}/1000000000', coalesce(
        (SELECT string_agg(
                    t.idx || ':' || (t.tf * (k1 + 1) / (t.tf + k1 * (1 - b + b * l.dl / greatest(avgdl, 1)))),
                    ',' ORDER BY t.idx)
         FROM terms t, length l),
        ''))::sparsevec
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("search", "0001_initial")]

    operations = [
        migrations.RunSQL(TERM_INDEX, "DROP FUNCTION IF EXISTS search_term_index(text)"),
        migrations.RunSQL(BM25_LEXEME, "DROP FUNCTION IF EXISTS search_bm25_lexeme(text)"),
        migrations.RunSQL(
            DOCUMENT_VECTOR, "DROP FUNCTION IF EXISTS search_bm25_document_vector(tsvector, float8, float8, float8)"
        ),
        migrations.RunSQL(create_index_sql(384), f"DROP INDEX IF EXISTS {index_name(384)}"),
    ]
