"""Japanese: collections read each chunk's language (``language``, ``auto`` by default), and a
Japanese chunk is indexed from terms analysed in Python (``search_chunk.lexemes``) under
``search_japanese``, a copy of ``search_english`` (search/analysis/__init__.py).

Existing collections move to ``auto``; their chunks that are Japanese are analysed again here
and their collections' term statistics and BM25 weights recomputed (English chunks keep
their analysis, and so their figures). Written by hand.
"""

import django.contrib.postgres.search
from django.conf import settings
from django.db import migrations, models
from django.db.models import F, Func
from django.db.models.functions import Coalesce

# Frozen here, as in 0004: the same 33 words (a test keeps them equal to search.text_normalization's).
STOP_WORDS = (
    "a|an|and|are|as|at|be|but|by|for|if|in|into|is|it|no|not|of|on|or|such|that|the|their|then|there|these|"
    "they|this|to|was|will|with"
)

CONFIGURATION = "CREATE TEXT SEARCH CONFIGURATION search_japanese (COPY = search_english);"

# search_japanese's input is already words (the analysis module's terms joined by spaces): it
# is split and stemmed as search_english is, so Latin words in either language index alike.
TSVECTOR = rf"""
CREATE OR REPLACE FUNCTION search_tsvector(config regconfig, body text) RETURNS tsvector
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE SET search_path FROM CURRENT AS $$
    SELECT to_tsvector(config, CASE WHEN config IN ('search_english'::regconfig, 'search_japanese'::regconfig)
        THEN regexp_replace(search_text_normalize(body), '\m({STOP_WORDS})\M', ' ', 'gi')
        ELSE search_text_normalize(body) END)
$$;
"""
TSVECTOR_BEFORE = rf"""
CREATE OR REPLACE FUNCTION search_tsvector(config regconfig, body text) RETURNS tsvector
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE SET search_path FROM CURRENT AS $$
    SELECT to_tsvector(config, CASE WHEN config = 'search_english'::regconfig
        THEN regexp_replace(search_text_normalize(body), '\m({STOP_WORDS})\M', ' ', 'gi')
        ELSE search_text_normalize(body) END)
$$;
"""

COLUMN = """
DROP INDEX IF EXISTS chunk_tsv_gin;
ALTER TABLE search_chunk DROP COLUMN tsv;
{lexemes}
ALTER TABLE search_chunk ADD COLUMN tsv tsvector GENERATED ALWAYS AS ({expression}) STORED;
CREATE INDEX chunk_tsv_gin ON search_chunk USING gin (tsv);
"""
FORWARD_COLUMN = COLUMN.format(
    lexemes="ALTER TABLE search_chunk ADD COLUMN lexemes text NULL;",
    expression="search_tsvector(ts_config, coalesce(lexemes, text))",
)
BACKWARD_COLUMN = COLUMN.format(
    lexemes="ALTER TABLE search_chunk DROP COLUMN lexemes;", expression="search_tsvector(ts_config, text)"
)

BATCH = 2000


def _japanese_chunks_analysed(apps, schema_editor):
    """Analyse again the chunks that are Japanese, then recompute their collections' BM25."""
    from search.analysis import JAPANESE, JAPANESE_CONFIG, language_of
    from search.analysis.japanese import terms

    touched: set[int] = set()
    with schema_editor.connection.cursor() as cursor:
        last = 0
        while True:
            cursor.execute(
                "SELECT id, collection_id, text FROM search_chunk WHERE id > %s AND lexemes IS NULL ORDER BY id LIMIT %s",
                [last, BATCH],
            )
            rows = cursor.fetchall()
            if not rows:
                break
            last = rows[-1][0]
            japanese = [(pk, collection, text) for pk, collection, text in rows if language_of(text) == JAPANESE]
            if japanese:
                cursor.execute(
                    "UPDATE search_chunk c SET lexemes = v.lexemes, ts_config = %s::regconfig"
                    " FROM unnest(%s::bigint[], %s::text[]) AS v(id, lexemes) WHERE c.id = v.id",
                    [JAPANESE_CONFIG, [r[0] for r in japanese], [" ".join(terms(r[2])) for r in japanese]],
                )
                touched.update(r[1] for r in japanese)
        if not touched:
            return
        ids = sorted(touched)
        cursor.execute("DELETE FROM search_termstat WHERE collection_id = ANY(%s)", [ids])
        cursor.execute(
            """
            INSERT INTO search_termstat (collection_id, term, df)
            SELECT c.collection_id, search_term_index(u.lexeme), count(DISTINCT c.id)
            FROM search_chunk c, unnest(c.tsv) u
            WHERE c.collection_id = ANY(%s) AND search_bm25_lexeme(u.lexeme)
            GROUP BY 1, 2 ORDER BY 1, 2
            """,
            [ids],
        )
        cursor.execute(
            """
            UPDATE search_collection s
            SET chunk_count = t.chunks, lexeme_total = t.lexemes,
                bm25_avgdl = CASE WHEN t.chunks > 0 THEN t.lexemes::float8 / t.chunks ELSE 0 END
            FROM (
                SELECT c.id, count(k.id) AS chunks, coalesce(sum(k.length), 0) AS lexemes
                FROM search_collection c
                LEFT JOIN LATERAL (
                    SELECT k.id, (SELECT coalesce(sum(coalesce(array_length(u.positions, 1), 1)), 0)
                                  FROM unnest(k.tsv) u WHERE search_bm25_lexeme(u.lexeme)) AS length
                    FROM search_chunk k WHERE k.collection_id = c.id AND k.embedding_model = c.embedding_model
                ) k ON true
                WHERE c.id = ANY(%s)
                GROUP BY c.id
            ) t
            WHERE s.id = t.id
            """,
            [ids],
        )
        cursor.execute(
            """
            UPDATE search_chunk k SET bm25 = search_bm25_document_vector(k.tsv, c.bm25_avgdl, %s, %s)
            FROM search_collection c
            WHERE k.collection_id = c.id AND c.id = ANY(%s)
            """,
            [settings.BM25_K1, settings.BM25_B, ids],
        )


class Migration(migrations.Migration):
    dependencies = [("search", "0009_client_ids_named")]

    operations = [
        migrations.RunSQL(CONFIGURATION, "DROP TEXT SEARCH CONFIGURATION IF EXISTS search_japanese;"),
        migrations.RunSQL(TSVECTOR, TSVECTOR_BEFORE),
        migrations.AddField(
            model_name="collection",
            name="language",
            field=models.CharField(
                choices=[("auto", "Each text's own"), ("ja", "Japanese"), ("en", "English")],
                default="auto",
                help_text=(
                    "The language chunks and queries are analysed in: auto reads each one's own (Japanese or the"
                    " text-search configuration's language); ja or en fixes it."
                ),
                max_length=8,
            ),
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD_COLUMN, BACKWARD_COLUMN)],
            state_operations=[
                migrations.AddField(
                    model_name="chunk",
                    name="lexemes",
                    field=models.TextField(blank=True, null=True),
                ),
                migrations.AlterField(
                    model_name="chunk",
                    name="tsv",
                    field=models.GeneratedField(
                        db_persist=True,
                        expression=Func(
                            F("ts_config"),
                            Coalesce(F("lexemes"), F("text")),
                            function="search_tsvector",
                            output_field=django.contrib.postgres.search.SearchVectorField(),
                        ),
                        output_field=django.contrib.postgres.search.SearchVectorField(),
                    ),
                ),
            ],
        ),
        migrations.RunPython(_japanese_chunks_analysed, migrations.RunPython.noop),
    ]
