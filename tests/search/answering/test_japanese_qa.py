"""The Japanese demo QA set (demo/qa-ja.jsonl) answered extractively over the whole demo
workspace, as ``seed_demo`` loads it: the English handbook (all-MiniLM-L6-v2) beside the Japanese
documents (multilingual-e5-small), every collection asked, retrieved as ``answer_create``
retrieves. Figures: docs/answers.md, "Japanese"; docs/benchmarks.md, "Japanese answers"."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.test import override_settings

from search.analysis import JAPANESE, language_of
from search.answering.answers import sources_retrieved
from search.answering.extractive import extractive_answer
from search.models import Document
from search.services import collection_create, workspace_create
from tests.search.answering.test_extractive import TOP_K, ingest

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "demo" / "corpus"


def read_qa(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "demo" / name).read_text(encoding="utf-8").splitlines() if line]


QA_JA = read_qa("qa-ja.jsonl")
# Written after the rules were found on QA_JA, by an author who had seen neither it nor the code.
HELD_OUT = read_qa("qa-ja-heldout.jsonl")


def nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


@pytest.fixture(scope="module")
def workspace(django_db_setup, django_db_blocker, tmp_path_factory):
    """The demo corpus in two collections, by language, ingested once for the module."""
    with django_db_blocker.unblock(), override_settings(MEDIA_ROOT=tmp_path_factory.mktemp("media")):
        workspace = workspace_create(name="Demo in Japanese", slug="demo-ja-answers")
        by_language = {
            "en": collection_create(workspace=workspace, name="Northwind handbook"),
            JAPANESE: collection_create(workspace=workspace, name="ノースウィンド社内文書"),
        }
        files: dict[str, list[tuple[str, bytes]]] = {"en": [], JAPANESE: []}
        for path in sorted(DEMO.iterdir()):
            language = JAPANESE if language_of(path.read_text(encoding="utf-8")) == JAPANESE else "en"
            files[language].append((path.name, path.read_bytes()))
        for language, collection in by_language.items():
            ingest(collection, files[language])
            collection.refresh_from_db()
        names = dict(Document.objects.filter(collection__workspace=workspace).values_list("pk", "source_name"))
        yield SimpleNamespace(workspace=workspace, japanese=by_language[JAPANESE], names=names)
        workspace.delete()


def outcomes(workspace, items: list[dict], django_db_blocker) -> dict[str, tuple[bool, bool, bool]]:
    """Per question: (correct, right source, declined), as eval_answers scores them."""
    japanese = workspace.japanese
    assert japanese.embedding_model == "multilingual-e5-small"  # chosen by its first document's language
    results = {}
    with django_db_blocker.unblock():
        for item in items:
            sources = sources_retrieved(item["question"], workspace=workspace.workspace, collections=None, top_k=TOP_K)
            answer = extractive_answer(
                item["question"],
                sources,
                embedding_model=japanese.embedding_model,
                text_search_config=japanese.text_search_config,
                language=JAPANESE,
            )
            by_number = {source.number: workspace.names[source.document_id] for source in sources}
            cited = {by_number[extract.number] for extract in answer.extracts}
            if item["kind"] == "unanswerable":
                results[item["id"]] = (answer.abstained, True, answer.abstained)
                continue
            correct = not answer.abstained and all(
                re.search(nfkc(pattern), nfkc(answer.text), re.IGNORECASE) for pattern in item["expected"]
            )
            results[item["id"]] = (correct, set(item["sources"]) <= cited, answer.abstained)
    return results


def figures(items: list[dict], results: dict) -> dict:
    answerable = [item["id"] for item in items if item["kind"] != "unanswerable"]
    unanswerable = [item["id"] for item in items if item["kind"] == "unanswerable"]
    return {
        "correct": round(sum(results[key][0] for key in answerable) / len(answerable), 4),
        "right_source": round(sum(results[key][1] for key in answerable) / len(answerable), 4),
        "unanswerable_declined": sum(results[key][2] for key in unanswerable),
        "unanswerable": len(unanswerable),
        "answerable_declined": sorted(key for key in answerable if results[key][2]),
        "wrong": sorted(key for key in answerable if not results[key][0]),
    }


def test_the_japanese_qa_sets_are_well_formed():
    files = {path.name for path in DEMO.iterdir()}
    for items in (QA_JA, HELD_OUT):
        ids = [item["id"] for item in items]
        assert len(ids) == len(set(ids)) and len(items) >= 30
        assert sum(item["kind"] == "unanswerable" for item in items) >= 3
        for item in items:
            assert set(item) == {"id", "question", "expected", "sources", "kind"}, item["id"]
            assert language_of(item["question"]) == JAPANESE, item["id"]
            assert set(item["sources"]) <= files, item["id"]
            # Every expected fact is written in its source (the demo's Markdown emphasis aside).
            written = nfkc(" ".join((DEMO / name).read_text(encoding="utf-8") for name in item["sources"]))
            for pattern in item["expected"]:
                assert re.search(nfkc(pattern), written.replace("**", ""), re.IGNORECASE), (item["id"], pattern)
    assert not {item["question"] for item in QA_JA} & {item["question"] for item in HELD_OUT}


def test_the_japanese_demo_qa_set_extractively(workspace, django_db_blocker):
    results = outcomes(workspace, QA_JA, django_db_blocker)
    measured = figures(QA_JA, results)
    print(json.dumps({"qa_ja": measured}, ensure_ascii=False))
    # The rules were found on this set (docs/answers.md, "Japanese"). Since abstention weighs a
    # question's terms by rarity and its line moved to where questions asked as people ask are
    # answered (docs/answers.md, "Calibration"), three of its eight near misses are answered.
    assert measured["unanswerable_declined"] >= 5
    assert measured["answerable_declined"] == []
    assert measured["correct"] >= 0.91 and measured["right_source"] >= 0.95


def test_the_held_out_japanese_set_extractively(workspace, django_db_blocker):
    results = outcomes(workspace, HELD_OUT, django_db_blocker)
    measured = figures(HELD_OUT, results)
    print(json.dumps({"qa_ja_heldout": measured}, ensure_ascii=False))
    # Where it stands (docs/answers.md: synonyms and English answers to Japanese questions are not
    # read yet): a floor against going back, not the bar the product must reach.
    assert measured["correct"] >= 0.72 and measured["right_source"] >= 0.76
    assert measured["unanswerable_declined"] >= measured["unanswerable"] - 1
    assert len(measured["answerable_declined"]) <= 5
