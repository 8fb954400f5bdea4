"""The keyword ranking against bm25s, a well-kept BM25 library, on the same texts.

Each document is written as one chunk (its whole text), so both rank the same units and
any difference is the ranking's: tokenisation, stop words, stemming, query-term frequency,
IDF and length normalisation. The corpus is the first 500 Cranfield abstracts (tests/data);
the questions are Cranfield's 225, and long questions built from the corpus itself (a
document's title and first sentences, about 50 words).
"""

from __future__ import annotations

import hashlib
import random
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from django.conf import settings
from django.test import override_settings

from search import bm25
from search import reference_rankings as reference
from search.beir import corpus_read, queries_read
from search.ingest import chunk_writes
from search.ingest.chunking import TextChunk
from search.models import Collection
from search.selectors import chunk_search
from search.services import collection_create, document_create, workspace_create

pytestmark = pytest.mark.django_db

CORPUS = Path(__file__).resolve().parent.parent / "data" / "cranfield_500"
DIMENSIONS = 384


@pytest.fixture(scope="module")
def loaded(django_db_setup, django_db_blocker, tmp_path_factory):
    """The corpus written one chunk per document (keyword search reads no vectors:
    every chunk gets the same unit vector)."""
    documents = [item for item in corpus_read(CORPUS) if item.content()]  # one of them is empty
    with django_db_blocker.unblock(), override_settings(MEDIA_ROOT=tmp_path_factory.mktemp("media")):
        workspace = workspace_create(name="BM25 reference", slug="bm25-reference")
        collection = collection_create(workspace=workspace, name="Cranfield 500")
        assert collection.text_search_config == "search_english"  # the default
        embedder = SimpleNamespace(name=collection.embedding_model, dimensions=DIMENSIONS)
        vector = np.full((1, DIMENSIONS), 1 / np.sqrt(DIMENSIONS), dtype=np.float32)
        order = {}
        for index, item in enumerate(documents):
            text = item.content()
            document, _ = document_create(
                collection=collection, source_name=f"{item.id}.txt", content=text.encode(), enqueue=False
            )
            chunk = TextChunk(ordinal=0, text=text, start=0, end=len(text), token_count=len(text.split()))
            assert chunk_writes.chunks_write(
                document=document,
                chunks=[chunk],
                vectors=vector,
                embedder=embedder,
                text_sha256=hashlib.sha256(text.encode()).hexdigest(),
                title=item.title,
                metadata={},
            )
            order[document.pk] = index
        bm25.collection_bm25_refresh(collection_id=collection.pk)  # exact average length
        yield SimpleNamespace(workspace=workspace, collection=collection, documents=documents, order=order)
        workspace.delete()


def ours(loaded, questions: list[str]) -> list[list[int]]:
    rankings = []
    for question in questions:
        result = chunk_search(
            query=question,
            workspace=loaded.workspace,
            collection_ids=[loaded.collection.pk],
            mode="keyword",
            top_k=10,
            snippets=False,
            syntax="question",
        )
        rankings.append([loaded.order[hit.document_id] for hit in result.hits])
    return rankings


def agreement(loaded, questions: list[str]) -> tuple[float, list[tuple[str, list[int], list[int]]]]:
    texts = [item.content() for item in loaded.documents]
    expected = reference.bm25_rankings(texts, questions, depth=10, k1=settings.BM25_K1, b=settings.BM25_B)
    got = ours(loaded, questions)
    shares = [reference.top_agreement(a, b) for a, b in zip(got, expected, strict=True)]
    worst = sorted(zip(shares, questions, got, expected, strict=True))[:3]
    return statistics.fmean(shares), [(q, g, e) for _, q, g, e in worst]


def test_keyword_top10_agrees_with_bm25s_on_cranfield_questions(loaded):
    questions = list(queries_read(CORPUS).values())
    share, worst = agreement(loaded, questions)
    assert share >= 0.95, f"top-10 agreement {share:.4f}; least agreeing: {worst}"


def test_keyword_top10_agrees_with_bm25s_on_long_questions(loaded):
    rng = random.Random(0)  # noqa: S311 (a reproducible sample)
    sampled = rng.sample(loaded.documents, 100)
    questions = [reference.long_question(item.title, item.text) for item in sampled]
    assert statistics.fmean(len(q.split()) for q in questions) >= 40
    share, worst = agreement(loaded, questions)
    assert share >= 0.95, f"top-10 agreement {share:.4f}; least agreeing: {worst}"


def test_a_term_the_question_repeats_weighs_more(loaded):
    """Query-term frequency: "shock" three times outweighs "boundary" once, as in bm25s."""
    collection = Collection.objects.get(pk=loaded.collection.pk)
    assert collection.chunk_count == len(loaded.documents)
    once = ours(loaded, ["shock boundary"])[0]
    repeated = ours(loaded, ["shock shock shock boundary"])[0]
    texts = [item.content() for item in loaded.documents]
    expected_once, expected_repeated = reference.bm25_rankings(
        texts, ["shock boundary", "shock shock shock boundary"], depth=10, k1=settings.BM25_K1, b=settings.BM25_B
    )
    assert once == expected_once and repeated == expected_repeated
    assert once != repeated
