"""Reranking (search/answering/reranking.py): the reader reorders a fused ranking's first
candidates beside their fused rank, leaves the rest, says why when it cannot, and an answer's
sources are reranked when SEARCH_RERANK_TOP asks (its stats say so). Its effect on retrieval is
measured by ``eval_retrieval --rerank`` (docs/search.md, "Reranking")."""

from __future__ import annotations

import pytest
from django.test import override_settings

from search.answering import reader, reranking
from search.answering.answers import sources_retrieved
from search.reader import model
from search.selectors import SearchHit
from search.services import collection_create, workspace_create
from tests.search.files import ingest_texts

LEAVE = "How many days of paid leave do employees get?"


def _hit(number: int, title: str, text: str) -> SearchHit:
    return SearchHit(
        chunk_id=number,
        document_id=number,
        document_title=title,
        collection_id=1,
        ordinal=0,
        text=text,
        start_offset=0,
        end_offset=len(text),
        score=1.0 / number,
        dense_rank=number,
        keyword_rank=number,
        snippet_html="",
    )


HITS = [
    _hit(1, "Atlas-7 battery", "The Atlas-7 battery is sold separately. Battery packs come in black and grey."),
    _hit(2, "Travel", "Book trains in second class. Flights need the manager's approval."),
    _hit(3, "Atlas-7 runtime", "The Atlas-7 runs for twelve hours on one charge of its battery."),
    _hit(4, "Leave", "Employees receive 25 days of paid leave a year."),
    _hit(5, "Leave carry-over", "Unused leave days carry over until March."),
]


@pytest.fixture
def fresh_reader():
    """The reader loaded afresh, and forgotten after (the test swaps its weights)."""
    reader.reader_reset()
    yield
    reader.reader_reset()


def _ids(hits) -> list[int]:
    return [hit.chunk_id for hit in hits]


def test_the_passage_that_answers_moves_up_and_the_rest_stay():
    # Whatever ANSWER_READER says: reranking loads the reader on its own.
    with override_settings(ANSWER_READER="signals"):
        result = reranking.reranked(LEAVE, HITS, 4, rank_weight=0.4)
    assert _ids(result.hits) == [4, 1, 2, 3, 5]  # the 5th was not a candidate: it stays 5th
    assert result.top == 4 and len(result.scores) == 4
    assert result.scores[3] == max(result.scores)
    assert result.as_record()["top"] == 4
    assert result.as_record()["reader"] == model.weights_manifest()["version"]


def test_the_fused_rank_decides_as_its_weight_grows():
    alone = reranking.reranked(LEAVE, HITS, 5, rank_weight=0.0)
    assert _ids(alone.hits) == [HITS[i].chunk_id for i in sorted(range(5), key=lambda i: -alone.scores[i])]
    # 10 x (1 - rank / 5): 2.0 between neighbours, more than a probability can make up.
    assert _ids(reranking.reranked(LEAVE, HITS, 5, rank_weight=10.0).hits) == [1, 2, 3, 4, 5]


def test_nothing_to_rerank_is_said_so():
    assert reranking.reranked(LEAVE, HITS[:1], 4).as_record() == {"top": 0, "why_not": "fewer than two candidates"}
    assert reranking.reranked(LEAVE, [], 4).as_record() == {"top": 0, "why_not": "fewer than two candidates"}
    assert reranking.reranked(LEAVE, HITS, 1).as_record() == {"top": 0, "why_not": "reranking off (top 1)"}
    assert _ids(reranking.reranked(LEAVE, HITS, 0).hits) == [1, 2, 3, 4, 5]


def test_missing_weights_leave_the_fused_order_and_name_the_file(tmp_path, monkeypatch, fresh_reader):
    missing = tmp_path / "reader.safetensors"
    monkeypatch.setattr(model, "HEAD_FILE", missing)
    result = reranking.reranked(LEAVE, HITS, 4)
    assert _ids(result.hits) == [1, 2, 3, 4, 5]
    assert result.top == 0 and str(missing) in result.why_not
    assert result.as_record() == {"top": 0, "why_not": result.why_not}


@pytest.fixture
def handbook(db):
    workspace = workspace_create(name="Rerank", slug="rerank")
    collection = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(collection, {f"{hit.document_title}.md": f"# {hit.document_title}\n\n{hit.text}" for hit in HITS})
    return workspace, collection


def test_an_answers_sources_are_reranked_when_asked(handbook):
    workspace, collection = handbook
    arguments = {"workspace": workspace, "collections": [collection.pk], "top_k": 3}
    stats: dict = {}
    fused = sources_retrieved(LEAVE, stats=stats, **arguments)
    assert stats == {}  # off by default
    with override_settings(SEARCH_RERANK_TOP=4):
        reranked = sources_retrieved(LEAVE, stats=stats, **arguments)
    assert stats["rerank"]["top"] == 4
    assert stats["rerank"]["reader"] == model.weights_manifest()["version"]
    assert len(reranked) == len(fused) == 3
    assert "25 days" in reranked[0].text
