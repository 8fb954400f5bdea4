"""Management commands: ingest (files, folders, BEIR) and eval_retrieval, end to end."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from django.core.management import call_command
from django.db.migrations.loader import MigrationLoader

from search.beir import mrr_at, ndcg_at, recall_at
from search.models import Collection, Document
from tests.conftest import PROJECT_ROOT


def write_beir(directory, documents, queries, qrels):
    (directory / "qrels").mkdir(parents=True)
    (directory / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": i, "title": t, "text": x}) + "\n" for i, t, x in documents)
    )
    (directory / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": q}) + "\n" for i, q in queries))
    (directory / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in qrels)
    )


def write_mini(directory):
    """Three judged abstracts, an empty entry (refused, not fatal) and an unjudged question."""
    write_beir(
        directory,
        documents=[
            ("d1", "Wing flutter", "Flutter of thin wings at supersonic speed."),
            ("d2", "Heat transfer", "Heat transfer in a laminar boundary layer."),
            ("d3", "Nozzle flow", "Flow in a convergent nozzle with a shock."),
            ("d4", "", ""),
        ],
        queries=[("q1", "supersonic wing flutter"), ("q2", "laminar heat transfer"), ("q3", "unjudged")],
        qrels=[("q1", "d1", 2), ("q2", "d2", 1), ("q2", "d3", 1)],
    )


def test_metrics_match_hand_computed_values():
    judged = {"a": 2, "b": 1}
    # a at rank 2, b at rank 3: DCG = 2/log2(3) + 1/log2(4); ideal = 2/log2(2) + 1/log2(3)
    expected = (2 / math.log2(3) + 1 / 2) / (2 + 1 / math.log2(3))
    assert ndcg_at(["x", "a", "b"], judged) == pytest.approx(expected)
    assert recall_at(["x", "a"], judged) == 0.5
    assert mrr_at(["x", "y", "b"], judged) == pytest.approx(1 / 3)
    assert ndcg_at(["x"], {}) == 0.0


@pytest.mark.django_db
def test_eval_retrieval_prints_exact_figures_as_its_last_line(tmp_path, settings):
    settings.MEDIA_ROOT = tmp_path / "media"
    write_mini(tmp_path / "mini")
    out = io.StringIO()
    call_command("eval_retrieval", str(tmp_path / "mini"), "--mode", "keyword", stdout=out, stderr=io.StringIO())
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    # q1: d1 first (1.0). q2: d2 first, d3 not matched at all: DCG 1, ideal 1 + 1/log2(3).
    q2 = 1 / (1 + 1 / math.log2(3))
    assert result["ndcg@10"] == round((1.0 + q2) / 2, 4)
    assert result["recall@100"] == 0.75
    assert result["mrr@10"] == 1.0
    assert (result["collection"], result["mode"], result["queries"]) == ("mini", "keyword", 2)
    assert result["p50_ms"] > 0 and result["p99_ms"] >= result["p50_ms"]
    collection = Collection.objects.get(name="beir:mini")
    assert Document.objects.filter(collection=collection, status="indexed").count() == 3

    # A second run reuses the ingested collection.
    again = io.StringIO()
    call_command("eval_retrieval", str(tmp_path / "mini"), "--mode", "keyword", stdout=again, stderr=io.StringIO())
    assert json.loads(again.getvalue().strip().splitlines()[-1])["ndcg@10"] == result["ndcg@10"]
    assert Document.objects.filter(collection=collection).count() == 3


@pytest.mark.django_db
def test_eval_retrieval_reranks_one_half_by_the_reader(tmp_path, settings, monkeypatch):
    from django.core.management.base import CommandError

    from search.answering import reader
    from search.reader import model

    settings.MEDIA_ROOT = tmp_path / "media"
    settings.SEARCH_RERANK_RANK_WEIGHT = 0.0  # the reader's order alone
    write_mini(tmp_path / "mini")
    reader.reader_reset()

    def run(*arguments) -> dict:
        out = io.StringIO()
        call_command("eval_retrieval", str(tmp_path / "mini"), *arguments, stdout=out, stderr=io.StringIO())
        return json.loads(out.getvalue().strip().splitlines()[-1])

    even = run("--half", "even", "--rerank", "3")
    assert (even["queries"], even["half"], even["rerank"]) == (1, "even", {"top": 3, "rank_weight": 0.0})
    assert even["ndcg@10"] == 1.0 and even["mrr@10"] == 1.0  # q1's flutter abstract read as the answer
    odd = run("--half", "odd")
    assert (odd["queries"], odd["half"]) == (1, "odd") and "rerank" not in odd

    missing = tmp_path / "reader.safetensors"
    monkeypatch.setattr(model, "HEAD_FILE", missing)
    reader.reader_reset()
    with pytest.raises(CommandError, match=f"--rerank: .*missing: {missing}"):
        run("--rerank", "3")
    reader.reader_reset()


@pytest.mark.django_db(transaction=True)
def test_eval_retrieval_against_the_references(tmp_path, settings):
    settings.MEDIA_ROOT = tmp_path / "media"
    write_mini(tmp_path / "mini")
    out = io.StringIO()
    arguments = ["--references", "--long-questions", "5", "--language", "english"]
    call_command("eval_retrieval", str(tmp_path / "mini"), *arguments, stdout=out, stderr=io.StringIO())
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    q2 = 1 / (1 + 1 / math.log2(3))  # d2 first, d3 holds no word of the question
    assert result["keyword_vs_bm25s"] == {
        "top10_agreement": 1.0,
        "top10_agreement_whole_documents": 1.0,
        "multi_chunk_documents": 0,
        "ndcg@10": round((1.0 + q2) / 2, 4),
        "bm25s_ndcg@10": round((1.0 + q2) / 2, 4),
        "ndcg@10_minus_bm25s": 0.0,
    }
    # Three documents can be asked about; each long question finds its own document first.
    long = result["long_questions"]
    assert (long["count"], long["top10_agreement"], long["ndcg@10"], long["bm25s_ndcg@10"]) == (3, 1.0, 1.0, 1.0)
    for mode in ("keyword", "dense", "hybrid"):
        figures = result[mode]
        assert figures["ndcg@10_minus_reference"] == round(figures["ndcg@10"] - figures["reference_ndcg@10"], 4)
    assert result["keyword"]["reference_ndcg@10"] == result["keyword"]["ndcg@10"]
    assert result["dense"]["reference_ndcg@10"] == result["dense"]["ndcg@10"]  # exact on three documents
    collection = Collection.objects.get(name="beir:mini:english")
    assert collection.text_search_config == "english"


@pytest.mark.django_db
def test_ingest_command_loads_folders_and_reports_refusals(tmp_path, settings):
    settings.MEDIA_ROOT = tmp_path / "media"
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.md").write_text("# Alpha\n\nFirst document.")
    (folder / "sub" / "b.txt").write_text("Second document.")
    (folder / "empty.txt").write_text("")
    (folder / ".hidden.txt").write_text("not ingested")
    out, err = io.StringIO(), io.StringIO()
    call_command("ingest", str(folder), "--workspace", "acme", "--collection", "Docs", stdout=out, stderr=err)
    collection = Collection.objects.get(workspace__slug="acme", name="Docs")
    assert sorted(Document.objects.filter(collection=collection).values_list("source_name", "status")) == [
        ("a.md", "indexed"),
        ("b.txt", "indexed"),
    ]
    assert "refused: empty.txt: the file is empty" in err.getvalue()
    assert "collection Docs: indexed 2" in out.getvalue()


def test_a_command_on_a_database_without_migrations_says_to_migrate(tmp_path):
    """Not a traceback about a missing relation: the command refuses, naming the fix."""
    name = "ragsite_never_migrated"
    url = urlsplit(os.environ["DATABASE_URL"])
    with psycopg.connect(os.environ["DATABASE_URL"], dbname="postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")
    try:
        write_mini(tmp_path / "beir")
        result = subprocess.run(
            [sys.executable, "manage.py", "eval_retrieval", str(tmp_path / "beir")],
            cwd=PROJECT_ROOT,
            env={**os.environ, "DATABASE_URL": urlunsplit(url._replace(path=f"/{name}"))},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        with psycopg.connect(os.environ["DATABASE_URL"], dbname="postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name}")
    migrations = len(MigrationLoader(None, ignore_no_migrations=True).graph.nodes)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"CommandError: database '{name}' lacks {migrations} migration(s) ("), last
    assert last.endswith(
        f"and {migrations - 3} more): run `python manage.py migrate` first (`python3 dev.py up` migrates by itself)"
    )
    assert "Traceback" not in result.stderr
