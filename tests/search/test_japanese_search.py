"""Japanese keyword search inside PostgreSQL: chunks analysed in their own language, BM25
over the analysed terms in the one SQL statement, query syntax and snippets in Japanese,
and a new collection of Japanese text embedded by the multilingual model."""

from __future__ import annotations

import pytest

from search.analysis import analysed
from search.embedders import DEFAULT_EMBEDDER, MULTILINGUAL_EMBEDDER, embedder_get
from search.ingest.parsers import parse_document
from search.ingest.pipeline import document_chunks
from search.models import Chunk, Collection, Document
from search.selectors import SearchError, chunk_search
from search.services import collection_create
from tests.search.files import ingest_texts

pytestmark = pytest.mark.django_db(transaction=True)

TEXTS = {
    "経費精算規程.md": "経費精算は、支出日から30日以内に申請してください。領収書の原本を添付すること。",
    "出張規程.md": "国内出張の日当は1日あたり3,000円です。宿泊費は実費精算とします。",
    "売上報告.md": "2026年度第2四半期の売上高は12億5,000万円で、前年同期比8.2%の増加となりました。",
    "security.md": "Report a suspected security incident to the security team within four hours.",
}


def keyword(collection, query: str, **kwargs) -> list[str]:
    result = chunk_search(query=query, workspace=collection.workspace, mode="keyword", snippets=True, **kwargs)
    titles = {c.pk: c.document.source_name for c in Chunk.objects.select_related("document")}
    return [titles[hit.chunk_id] for hit in result.hits]


@pytest.fixture
def mixed(workspace):
    collection = collection_create(workspace=workspace, name="規程集")
    ingest_texts(collection, TEXTS)
    collection.refresh_from_db()
    return collection


def test_each_chunk_is_analysed_in_its_own_language(mixed):
    rows = {c.document.source_name: (c.ts_config, c.lexemes) for c in Chunk.objects.select_related("document")}
    assert rows["経費精算規程.md"] == (
        "search_japanese",
        "経費 精算 支出 日 30 日 30日 以内 申請 為る 領収 書 原本 添付 為る 事",
    )
    assert rows["security.md"] == ("search_english", None)
    # The collection read Japanese first, so it is embedded by the multilingual model.
    assert mixed.language == "auto"
    assert (mixed.embedding_model, mixed.embedding_dimensions) == (MULTILINGUAL_EMBEDDER, 384)


def test_a_japanese_question_finds_its_document_by_keyword(mixed):
    assert keyword(mixed, "出張の日当はいくらですか")[0] == "出張規程.md"
    assert keyword(mixed, "領収書")[0] == "経費精算規程.md"
    # Full-width digits in the query match the half-width ones in the text.
    assert keyword(mixed, "第２四半期の売上")[0] == "売上報告.md"
    # English in the same collection is still read as English (stemmed: "reported" finds "Report").
    assert keyword(mixed, "reported incidents") == ["security.md"]


def test_japanese_query_syntax(mixed):
    # A quoted phrase must appear as written (its words in sequence), -word excludes.
    assert keyword(mixed, '"実費精算"') == ["出張規程.md"]
    assert set(keyword(mixed, "精算")) == {"経費精算規程.md", "出張規程.md"}
    assert keyword(mixed, "精算 -出張") == ["経費精算規程.md"]


def test_snippets_mark_japanese_words(mixed):
    result = chunk_search(query="日当", workspace=mixed.workspace, mode="keyword")
    assert (
        result.hits[0].snippet_html == "国内出張の<mark>日当</mark>は1日あたり3,000円です。宿泊費は実費精算とします。"
    )


@pytest.mark.parametrize("query", ["。、！？", "「」", "ーー"])
def test_a_query_of_punctuation_only_ranks_nothing(mixed, query):
    assert chunk_search(query=query, workspace=mixed.workspace, mode="keyword").hits == []


def test_an_english_collection_stays_english(workspace):
    collection = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(collection, {"security.md": TEXTS["security.md"]})
    collection = Collection.objects.get(pk=collection.pk)
    assert collection.embedding_model == DEFAULT_EMBEDDER


def test_a_workspace_of_both_languages_and_two_embedders(workspace):
    """Each model ranks its own collections, in the query's language: an English question is
    not given the Japanese collection's nearest chunks, nor a Japanese one MiniLM's."""
    japanese = collection_create(workspace=workspace, name="規程")
    ingest_texts(japanese, {name: text for name, text in TEXTS.items() if name.endswith("規程.md")})
    english = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(
        english,
        {
            "security.md": TEXTS["security.md"],
            "travel.md": "The per-diem for a full day in Zurich is 68 euros; receipts are not needed for it.",
        },
    )
    japanese.refresh_from_db()
    english.refresh_from_db()
    assert (japanese.embedding_model, english.embedding_model) == (MULTILINGUAL_EMBEDDER, DEFAULT_EMBEDDER)
    names = {c.pk: c.document.source_name for c in Chunk.objects.select_related("document")}

    def ranked(query, mode):
        return [names[hit.chunk_id] for hit in chunk_search(query=query, workspace=workspace, mode=mode).hits]

    assert ranked("What is the per-diem in Zurich?", "dense") == ["travel.md", "security.md"]
    assert ranked("経費精算の期限はいつですか", "dense") == ["経費精算規程.md", "出張規程.md"]
    assert ranked("What is the per-diem in Zurich?", "hybrid")[0] == "travel.md"
    assert ranked("経費精算の期限はいつですか", "hybrid")[0] == "経費精算規程.md"
    # Keyword search reads both languages' chunks in one ranking.
    assert sorted(ranked("精算", "keyword")) == ["出張規程.md", "経費精算規程.md"]


def test_a_question_for_the_latest_puts_the_newest_document_first(workspace):
    collection = collection_create(workspace=workspace, name="売上")
    reports = {
        f"売上報告_{quarter}.md": (
            f"---\ndate: {date}\n---\n# 売上報告（{quarter}）\n\n{quarter}の売上高は{amount}でした。\n"
        )
        for quarter, date, amount in [
            ("2025年度第4四半期", "2026-04-16", "11億3,600万円"),
            ("2026年度第2四半期", "2026-10-15", "12億7,500万円"),
            ("2026年度第1四半期", "2026-07-15", "7億9,800万円"),
        ]
    }
    reports["経費精算規程.md"] = TEXTS["経費精算規程.md"]
    ingest_texts(collection, reports)
    dates = dict(Document.objects.filter(collection=collection).values_list("source_name", "metadata__date"))
    assert dates["売上報告_2026年度第2四半期.md"] == "2026-10-15" and dates["経費精算規程.md"] is None

    def ranked(query):
        hits = chunk_search(query=query, workspace=workspace, mode="hybrid", syntax="question").hits
        return [(hit.document_title, hit.document_date) for hit in hits]

    latest = ranked("最新の売上報告を教えてください")
    assert [date for _, date in latest[:3]] == ["2026-10-15", "2026-07-15", "2026-04-16"]
    assert latest[0][0] == "売上報告（2026年度第2四半期）"
    # Without "latest" the words decide, not the date.
    assert ranked("2025年度第4四半期の売上高")[0][0] == "売上報告（2025年度第4四半期）"


def test_a_hundred_kilobytes_of_japanese_without_a_break_is_chunked_within_the_window():
    """Chunked as ingestion chunks it, in multilingual-e5-small's own tokens (the embedding is
    the only step left out: two minutes of a test run), and analysed whole for BM25."""
    text = "東京都特許許可局" * 4_200  # 100,800 bytes: no punctuation, no line break, no space
    embedder = embedder_get(MULTILINGUAL_EMBEDDER)
    chunks = document_chunks(parse_document(text.encode(), media_type="text/plain"), embedder)
    assert len(chunks) > 10
    assert chunks[0].start == 0 and chunks[-1].end == len(text)
    for chunk in chunks:
        assert chunk.text == text[chunk.start : chunk.end]
        # The model's own count of the chunk, "passage: " and its two special tokens included.
        assert embedder._load().token_count(chunk.text) <= 512
    assert all(config == "search_japanese" and terms for config, terms in chunks_analysed_of(chunks))


def chunks_analysed_of(chunks):
    return [analysed(chunk.text, language="auto", config="search_english") for chunk in chunks]


@pytest.mark.parametrize("query", ["", "　　", " \u3000 "])
def test_an_empty_japanese_query_is_refused_naming_the_problem(mixed, query):
    with pytest.raises(SearchError, match="the query is empty"):
        chunk_search(query=query, workspace=mixed.workspace)


def _statistics(collection_id: int) -> tuple:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT term, df FROM search_termstat WHERE collection_id = %s ORDER BY term", [collection_id])
        terms = cursor.fetchall()
        cursor.execute(
            "SELECT id, ts_config::text, lexemes, bm25::text FROM search_chunk WHERE collection_id = %s ORDER BY id",
            [collection_id],
        )
        chunks = cursor.fetchall()
    collection = Collection.objects.get(pk=collection_id)
    return terms, chunks, collection.chunk_count, collection.lexeme_total, collection.bm25_avgdl


def test_a_collection_is_analysed_again_in_another_language_and_back(mixed):
    from search.ingest.reanalysis import collection_reanalyze

    ingested = _statistics(mixed.pk)
    progress = []
    english = collection_reanalyze(
        collection_id=mixed.pk, language="en", on_progress=lambda done, total: progress.append((done, total))
    )
    assert english.language == "en" and progress[-1] == (4, 4)
    rows = {c.document.source_name: (c.ts_config, c.lexemes) for c in Chunk.objects.select_related("document")}
    assert rows["経費精算規程.md"] == ("search_english", None)  # its text, as search_english splits it
    assert keyword(mixed, "日当") == []  # a run of kanji is one "word" in English
    assert keyword(mixed, "reported incidents") == ["security.md"]
    back = collection_reanalyze(collection_id=mixed.pk, language="auto")
    assert back.language == "auto"
    # Exactly as ingestion left it: terms, their frequencies, every chunk's lexemes and weights.
    assert _statistics(mixed.pk) == ingested
    assert keyword(mixed, "出張の日当はいくらですか")[0] == "出張規程.md"


def test_reanalyze_names_what_it_did_and_refuses_what_is_not_there(mixed):
    import io

    from django.core.management import call_command
    from django.core.management.base import CommandError

    out = io.StringIO()
    call_command("reanalyze", str(mixed.pk), "--language", "ja", stdout=out)
    assert out.getvalue() == f"{mixed}: language ja, 4 chunks analysed again\n"
    assert Collection.objects.get(pk=mixed.pk).language == "ja"
    with pytest.raises(CommandError, match="no collection with id 999999"):
        call_command("reanalyze", "999999")
    with pytest.raises(CommandError, match="invalid choice: 'fr'"):
        call_command("reanalyze", str(mixed.pk), "--language", "fr")
