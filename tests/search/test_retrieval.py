"""``chunk_search`` on a small fixed corpus: exact ids, order and scores, checked against
independent computations (BM25 and cosine in Python, reciprocal-rank fusion by hand).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from django.conf import settings
from django.db import connection

from search.embedders import embedder_get
from search.ingest import pipeline
from search.models import Chunk, Collection, Document
from search.scoping import CollectionNotFound
from search.selectors import SearchError, chunk_search
from search.services import collection_create, document_create, workspace_create
from search.vector_indexes import BM25_INDEX_NAME, bm25_index_forget, create_bm25_index_sql

pytestmark = pytest.mark.django_db

CORPUS = {
    "robot.md": "# Atlas-7 robot\n\nThe Atlas-7 warehouse robot runs for 10 hours on one battery charge "
    "and carries a payload of 300 kg. Charging takes 90 minutes.",
    "travel.md": "# Travel policy\n\nReceipts must be submitted within 30 days. Flights over six hours may be "
    "booked in business class after approval by a director.",
    "security.md": "# Security policy\n\nEvery laptop uses full-disk encryption. Report a lost laptop to the "
    "security team within 4 hours. Passwords need at least 14 characters.",
    "oncall.md": "# On-call handbook\n\nA SEV1 incident pages the secondary after 10 minutes without an "
    "acknowledgement. The rotation lasts one week.",
    "wing.md": "# Wing aerodynamics\n\nThe propeller slipstream increases the lift of the wing. Jet engines "
    "behind the wing change the pressure distribution.",
    "html.md": "# Markup notes\n\nNever paste <script>alert(1)</script> into a page: the robot battery "
    "warning says voltage < 12 & falling.",
}


@pytest.fixture(scope="module")
def corpus(django_db_setup, django_db_blocker):
    """The corpus, ingested once for the module; removed afterwards."""
    with django_db_blocker.unblock():
        workspace = workspace_create(name="Retrieval", slug="retrieval")
        collection = collection_create(workspace=workspace, name="Fixed")
        ids = {}
        for name, text in CORPUS.items():
            document, _ = document_create(collection=collection, source_name=name, content=text.encode(), enqueue=False)
            ids[name] = document.pk
        pipeline.documents_ingest(document_ids=list(ids.values()))
        assert set(Document.objects.filter(collection=collection).values_list("status", flat=True)) == {"indexed"}
        with connection.cursor() as cursor:
            cursor.execute(create_bm25_index_sql())
        bm25_index_forget()
        yield workspace, collection, ids
        workspace.delete()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP INDEX IF EXISTS {BM25_INDEX_NAME}")
        bm25_index_forget()


def search(corpus, query, **kwargs):
    workspace, collection, _ = corpus
    kwargs.setdefault("collection_ids", [collection.pk])
    return chunk_search(query=query, workspace=workspace, **kwargs)


def python_bm25(collection: Collection, query: str) -> list[tuple[int, float]]:
    """BM25 computed here from PostgreSQL's lexemes, as an independent reference."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.id, u.lexeme, coalesce(array_length(u.positions, 1), 1) FROM search_chunk c, unnest(c.tsv) u"
            " WHERE c.collection_id = %s AND search_bm25_lexeme(u.lexeme)",
            [collection.pk],
        )
        tf: dict[int, dict[str, int]] = {}
        for chunk_id, lexeme, count in cursor.fetchall():
            tf.setdefault(chunk_id, {})[lexeme] = count
        cursor.execute(
            "SELECT u.lexeme, coalesce(array_length(u.positions, 1), 1)"
            " FROM unnest(search_tsvector(%s::regconfig, %s)) u WHERE search_bm25_lexeme(u.lexeme)",
            [collection.text_search_config, query],
        )
        terms = dict(cursor.fetchall())  # lexeme -> how often the query holds it
    chunk_total = len(tf)
    avgdl = collection.bm25_avgdl
    k1, b = settings.BM25_K1, settings.BM25_B
    scores = {}
    for chunk_id, counts in tf.items():
        length = sum(counts.values())
        score = 0.0
        for term, query_count in terms.items():
            if term in counts:
                df = sum(1 for other in tf.values() if term in other)
                idf = math.log(1 + (chunk_total - df + 0.5) / (df + 0.5))
                f = counts[term]
                score += query_count * idf * f * (k1 + 1) / (f + k1 * (1 - b + b * length / avgdl))
        if score > 0:
            scores[chunk_id] = score
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))


def test_keyword_ranking_is_bm25(corpus):
    _, collection, _ = corpus
    collection.refresh_from_db()
    query = "battery charge of the warehouse robot"
    expected = python_bm25(collection, query)
    result = search(corpus, query, mode="keyword", top_k=10)
    assert [hit.chunk_id for hit in result.hits] == [chunk_id for chunk_id, _ in expected]
    for hit, (_, score) in zip(result.hits, expected, strict=True):
        assert hit.score == pytest.approx(score, rel=1e-4)  # sparsevec stores float32
        assert hit.keyword_rank is not None and hit.dense_rank is None


def test_common_words_use_the_bm25_index_with_the_same_ranking(corpus, settings):
    _, collection, _ = corpus
    collection.refresh_from_db()
    query = "battery charge of the warehouse robot"
    exact = search(corpus, query, mode="keyword", top_k=10)
    assert exact.keyword_path == "exact"
    settings.SEARCH_KEYWORD_EXACT_MAX_ROWS = 0  # every query counts as "common words"
    indexed = search(corpus, query, mode="keyword", top_k=10)
    assert indexed.keyword_path == "index"
    # On a corpus this small the HNSW graph is exhaustive: the same ids, order and scores.
    assert [(h.chunk_id, round(h.score, 4)) for h in indexed.hits] == [
        (h.chunk_id, round(h.score, 4)) for h in exact.hits
    ]
    assert [h.chunk_id for h in indexed.hits] == [chunk_id for chunk_id, _ in python_bm25(collection, query)]
    # Typed phrases still filter on the index path.
    _, _, ids = corpus
    phrase = search(corpus, '"propeller slipstream" wing', mode="keyword")
    assert phrase.keyword_path == "index"
    assert [hit.document_id for hit in phrase.hits] == [ids["wing.md"]]


def test_dense_ranking_is_cosine_similarity(corpus):
    _, collection, ids = corpus
    query = "How long does the robot's battery last?"
    vector = embedder_get("all-MiniLM-L6-v2").embed_query(query)
    chunks = list(Chunk.objects.filter(collection=collection))
    exact = sorted(((c.id, float(np.dot(np.asarray(c.embedding), vector))) for c in chunks), key=lambda item: -item[1])
    result = search(corpus, query, mode="dense", top_k=len(chunks))
    assert [hit.chunk_id for hit in result.hits][:3] == [chunk_id for chunk_id, _ in exact][:3]
    assert result.hits[0].document_id == ids["robot.md"]
    for hit, (_, similarity) in zip(result.hits, exact, strict=True):
        assert hit.score == pytest.approx(similarity, abs=5e-3)  # the index compares halfvecs


def test_hybrid_is_reciprocal_rank_fusion_of_both_rankings(corpus):
    query = "lost laptop encryption"
    dense = search(corpus, query, mode="dense", top_k=100)
    keyword = search(corpus, query, mode="keyword", top_k=100)
    hybrid = search(corpus, query, mode="hybrid", top_k=100)
    k = settings.SEARCH_RRF_K
    fused: dict[int, float] = {}
    for rank, hit in enumerate(dense.hits, 1):
        fused[hit.chunk_id] = fused.get(hit.chunk_id, 0) + 1 / (k + rank)
    for rank, hit in enumerate(keyword.hits, 1):
        fused[hit.chunk_id] = fused.get(hit.chunk_id, 0) + 1 / (k + rank)
    expected = sorted(fused.items(), key=lambda item: (-item[1], item[0]))
    assert [(hit.chunk_id, round(hit.score, 9)) for hit in hybrid.hits] == [
        (chunk_id, round(score, 9)) for chunk_id, score in expected
    ]
    assert hybrid.hits[0].document_id == corpus[2]["security.md"]


def test_quoted_phrases_must_match_and_exclusions_must_not(corpus):
    _, _, ids = corpus
    phrase = search(corpus, '"propeller slipstream" wing', mode="keyword")
    assert [hit.document_id for hit in phrase.hits] == [ids["wing.md"]]
    excluded = search(corpus, "robot battery -script", mode="keyword")
    assert [hit.document_id for hit in excluded.hits] == [ids["robot.md"]]
    both = search(corpus, "robot battery", mode="keyword")
    assert {hit.document_id for hit in both.hits} == {ids["robot.md"], ids["html.md"]}
    hyphen = search(corpus, '"Atlas-7"', mode="keyword")
    assert [hit.document_id for hit in hyphen.hits] == [ids["robot.md"]]


def test_snippets_highlight_terms_and_escape_markup(corpus):
    _, _, ids = corpus
    result = search(corpus, "robot battery", mode="keyword")
    snippet = next(hit.snippet_html for hit in result.hits if hit.document_id == ids["html.md"])
    chunk = Chunk.objects.get(document_id=ids["html.md"])
    assert "<script>" in chunk.text  # stored as written...
    assert "<script>" not in snippet  # ...never rendered as markup
    assert "voltage &lt; 12 &amp; falling" in snippet
    assert "<mark>robot</mark> <mark>battery</mark>" in snippet


def test_metadata_filter_and_one_hit_per_document(corpus):
    _, _, ids = corpus
    Document.objects.filter(pk=ids["travel.md"]).update(metadata={"department": "finance"})
    result = search(corpus, "approval", mode="hybrid", metadata={"department": "finance"})
    assert {hit.document_id for hit in result.hits} == {ids["travel.md"]}
    per_document = search(corpus, "policy", mode="hybrid", per_document=True, top_k=100)
    document_ids = [hit.document_id for hit in per_document.hits]
    assert len(document_ids) == len(set(document_ids)) == len(CORPUS)


def test_excluded_documents_are_not_searched_in_any_mode(corpus):
    _, _, ids = corpus
    for mode in ("dense", "keyword", "hybrid"):
        everything = search(corpus, "approval", mode=mode, top_k=100)
        first = everything.hits[0].document_id
        rest = search(corpus, "approval", mode=mode, top_k=100, documents_excluded=[first])
        assert first not in {hit.document_id for hit in rest.hits}, mode
        # The others keep their order here (fusion could reorder ties elsewhere): only the excluded
        # document's chunks are gone.
        assert [hit.chunk_id for hit in rest.hits] == [
            hit.chunk_id for hit in everything.hits if hit.document_id != first
        ], mode
    assert search(corpus, "approval", documents_excluded=list(ids.values())).hits == []


def test_only_the_workspaces_own_collections_can_be_searched(corpus, db):
    _, collection, _ = corpus
    other = workspace_create(name="Other", slug="other")
    with pytest.raises(CollectionNotFound) as refused:
        chunk_search(query="robot", workspace=other, collection_ids=[collection.pk])
    assert (refused.value.field, refused.value.message) == (
        "collections",
        f"No collection {collection.pk} in this workspace.",
    )
    assert chunk_search(query="robot", workspace=other).hits == []


def test_bad_requests_are_refused_with_the_reason(corpus):
    with pytest.raises(SearchError, match="unknown search mode 'fuzzy'"):
        search(corpus, "robot", mode="fuzzy")
    with pytest.raises(SearchError, match="the query is empty"):
        search(corpus, "   ")
    # Only stop words and exclusions: nothing for keyword search to look for.
    assert search(corpus, "the -robot", mode="keyword").hits == []


def test_query_embeddings_are_cached(corpus, monkeypatch):
    from search import embedders

    query = "a question asked twice about charging"
    search(corpus, query, mode="dense")
    monkeypatch.setattr(embedders, "embedder_get", lambda name: pytest.fail("the model ran for a cached query"))
    assert search(corpus, query, mode="dense").hits


@pytest.mark.django_db(transaction=True)
def test_the_bm25_index_is_created_once_the_table_is_large():
    from search.vector_indexes import bm25_index_exists, search_indexes_maintain

    with connection.cursor() as cursor:  # another test's fixture may have built it
        cursor.execute(f"DROP INDEX IF EXISTS {BM25_INDEX_NAME}")
    bm25_index_forget()
    workspace = workspace_create(name="Index", slug="index")
    collection = collection_create(workspace=workspace, name="Small")
    document, _ = document_create(collection=collection, source_name="a.txt", content=b"One chunk.", enqueue=False)
    pipeline.documents_ingest(document_ids=[document.pk])
    assert search_indexes_maintain(min_chunks=10**6) is None
    assert bm25_index_exists() is False
    assert search_indexes_maintain(min_chunks=1).startswith(f"created {BM25_INDEX_NAME} (the table holds about ")
    assert bm25_index_exists() is True
    assert search_indexes_maintain(min_chunks=1) is None  # already there
