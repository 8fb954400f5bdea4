"""The ``search_english`` text-search configuration, the default from now on.

English as Lucene's ``EnglishAnalyzer`` and bm25s analyse it for BM25: the 33 stop
words of Lucene's list are removed as words before stemming (PostgreSQL's ``english``
drops 127), and every word, numerals with letters included, is stemmed by Snowball.
``search_tsvector(config, text)`` is what chunks are indexed with and queries are
analysed with; collections on ``english`` move to ``search_english``, and their term
statistics and BM25 weights are recomputed here. docs/search.md says why.
"""

import django.contrib.postgres.search
from django.conf import settings
from django.db import migrations, models
from django.db.models import F, Func

import search.models

# Frozen here; search.text_normalization.ENGLISH_STOP_WORDS is the same list (a test keeps them equal).
STOP_WORDS = (
    "a|an|and|are|as|at|be|but|by|for|if|in|into|is|it|no|not|of|on|or|such|that|the|their|then|there|these|"
    "they|this|to|was|will|with"
)

CONFIGURATION = """
CREATE TEXT SEARCH DICTIONARY search_english_stem (TEMPLATE = snowball, Language = english);
CREATE TEXT SEARCH CONFIGURATION search_english (COPY = english);
ALTER TEXT SEARCH CONFIGURATION search_english
    ALTER MAPPING FOR asciiword, asciihword, hword_asciipart, word, hword, hword_part, numword
    WITH search_english_stem;
"""

# SET search_path FROM CURRENT: the generated column calls this with whatever search_path
# a session has (pg_restore runs with an empty one); the function finds its own objects.
TSVECTOR = rf"""
CREATE OR REPLACE FUNCTION search_tsvector(config regconfig, body text) RETURNS tsvector
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE SET search_path FROM CURRENT AS $$
    SELECT to_tsvector(config, CASE WHEN config = 'search_english'::regconfig
        THEN regexp_replace(search_text_normalize(body), '\m({STOP_WORDS})\M', ' ', 'gi')
        ELSE search_text_normalize(body) END)
$$;
"""

TSVECTOR_COLUMN = """
DROP INDEX IF EXISTS chunk_tsv_gin;
ALTER TABLE search_chunk DROP COLUMN tsv;
UPDATE search_chunk SET ts_config = '{new}' WHERE ts_config = '{old}'::regconfig;
UPDATE search_collection SET text_search_config = '{new}' WHERE text_search_config = '{old}'::regconfig;
ALTER TABLE search_chunk ADD COLUMN tsv tsvector GENERATED ALWAYS AS ({expression}) STORED;
CREATE INDEX chunk_tsv_gin ON search_chunk USING gin (tsv);
"""
FORWARD_COLUMN = TSVECTOR_COLUMN.format(old="english", new="search_english", expression="search_tsvector(ts_config, text)")
BACKWARD_COLUMN = TSVECTOR_COLUMN.format(
    old="search_english", new="english", expression="to_tsvector(ts_config, search_text_normalize(text))"
)


def _statistics_rebuild(apps, schema_editor, config: str) -> None:
    """Term frequencies, lengths and BM25 weights of the collections now on ``config``
    (the same computation as search.ingest.pipeline's rebuild and refresh)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT id FROM search_collection WHERE text_search_config = %s::regconfig", [config])
        ids = [row[0] for row in cursor.fetchall()]
        if not ids:
            return
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
                    FROM search_chunk k WHERE k.collection_id = c.id
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


def forward(apps, schema_editor):
    _statistics_rebuild(apps, schema_editor, "search_english")


def backward(apps, schema_editor):
    _statistics_rebuild(apps, schema_editor, "english")


class Migration(migrations.Migration):
    dependencies = [("search", "0003_answer")]

    operations = [
        migrations.RunSQL(
            CONFIGURATION,
            "DROP TEXT SEARCH CONFIGURATION IF EXISTS search_english;"
            " DROP TEXT SEARCH DICTIONARY IF EXISTS search_english_stem;",
        ),
        migrations.RunSQL(TSVECTOR, "DROP FUNCTION IF EXISTS search_tsvector(regconfig, text)"),
        # Undone, the statistics are rebuilt after the column is back on PostgreSQL's english.
        migrations.RunPython(migrations.RunPython.noop, backward),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(FORWARD_COLUMN, BACKWARD_COLUMN)],
            state_operations=[
                migrations.AlterField(
                    model_name="chunk",
                    name="tsv",
                    field=models.GeneratedField(
                        db_persist=True,
                        expression=Func(
                            F("ts_config"),
                            F("text"),
                            function="search_tsvector",
                            output_field=django.contrib.postgres.search.SearchVectorField(),
                        ),
                        output_field=django.contrib.postgres.search.SearchVectorField(),
                    ),
                ),
                migrations.AlterField(
                    model_name="collection",
                    name="text_search_config",
                    field=search.models.RegConfigField(
                        default="search_english",
                        help_text=(
                            "PostgreSQL text-search configuration: search_english (English as BM25 references"
                            " analyse it), or any other, e.g. german, simple."
                        ),
                        max_length=63,
                    ),
                ),
            ],
        ),
        migrations.RunPython(forward, migrations.RunPython.noop),
    ]
