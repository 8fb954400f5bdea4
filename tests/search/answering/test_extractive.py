"""Extractive answers and abstention (search/answering/extractive.py, search/answering/abstention.py).

The sentence rules run on texts as the parsers leave them; the answers run on the demo corpus
(demo/corpus, ingested with the real embedder into real PostgreSQL) with the questions of
demo/qa.jsonl, retrieved as ``answer_create`` retrieves them. The calibration of abstention
against Cranfield (slow) needs the judged queries of ../shared/data/cranfield and is skipped
without them. Figures: docs/answers.md, "Extractive answers and abstention".
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from search.analysis import language_of
from search.answering.abstention import (
    ABSTAIN_BELOW,
    ABSTAIN_BELOW_LEXICAL,
    NOT_ANSWERED,
    answer_kind,
    holds_kind,
    numbers_of,
    question_parts,
    relevance,
    sentence_units,
)
from search.answering.answers import sources_retrieved
from search.answering.extractive import CLOSEST_LEAD, LEAD, NOTHING_FOUND, extractive_answer
from search.answering.prompting import Source
from search.beir import corpus_read
from search.ingest import pipeline
from search.management.commands.eval_answers import COMPARED
from search.models import Document
from search.services import collection_create, document_create, workspace_create

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "demo" / "corpus"
QA = [json.loads(line) for line in (ROOT / "demo" / "qa.jsonl").read_text(encoding="utf-8").splitlines() if line]
CRANFIELD = ROOT / "tests" / "data" / "cranfield_500"
CRANFIELD_QRELS = ROOT.parent / "shared" / "data" / "cranfield" / "qrels" / "test.tsv"
TOP_K = 8  # answer_create's default
README_QUESTIONS = [
    "What is the per-diem for a full day in Zürich?",
    "Who must approve an expense claim of €3,000?",
    "How soon must a suspected security incident be reported?",
    "After how many minutes is the secondary on-call engineer paged?",
    "What is the response target for a SEV1 incident?",
    "What is the maximum payload of the Atlas-7, and how long does the battery last?",
    "What are the core hours for remote employees, and how large is the home-office stipend?",
    "What should I do if I lose my YubiKey, and when must I return it if I leave the company?",
]
# Near misses: topics the handbook does not cover, in words it uses. Not in the QA set: the
# calibration measures them, and two are known misses (docs/answers.md).
NEAR_MISSES = [
    "What is the dress code in the office?",
    "How do I book a meeting room in Zürich?",
    "How much is the annual bonus?",
    "What is the sick leave policy?",
    "What is the IP rating of the Atlas-7 against dust and water?",
    "How many parking spaces are there in Eindhoven?",
    "What severance pay do employees get when they leave the company?",
    "Which programming language is the Route Planner written in?",
    "When is the company Christmas party?",
    "How much does the company contribute to the pension plan?",
    "How much does the Atlas Care Plus plan cost?",
    "Who is the Data Protection Officer?",  # named nowhere, but the sentence about the role holds every word
    "What is the per-diem on the Moon?",
    "How many vacation days can be carried over to next year?",
    "Can I bring my dog to the office?",
    "What is the budget for team events?",
]
BULLET_START = re.compile(r"^(?:[-*+\u2022]|\d{1,3}[.)])\s")


# --------------------------------------------------------------------------- sentences


def test_headings_are_never_sentences_and_bullets_are_dropped():
    # As the Markdown parser leaves a document: markers gone, "## 2. Rotation" a line alone.
    text = (
        "On-Call Handbook\n\n2. Rotation\n\n- Each rotation lasts 7 days. Tuesday hand-over avoids Mondays.\n"
        "- - Nested bullets leave no artifact.\n\n4. Paging and escalation\n\nThe escalation policy is:\n\n"
        "1. 0 minutes — the primary is paged.\n2. 10 minutes without acknowledgement — the secondary is paged.\n\n"
        "BEFORE YOUR FIRST DAY\n\nHow long does the battery last?\n\nA fully charged robot runs for 10 hours."
    )
    units = sentence_units(text, 3)
    assert [unit.sentence for unit in units] == [
        "Each rotation lasts 7 days.",
        "Tuesday hand-over avoids Mondays.",
        "Nested bullets leave no artifact.",
        "0 minutes — the primary is paged.",
        "10 minutes without acknowledgement — the secondary is paged.",
        "A fully charged robot runs for 10 hours.",
    ]
    assert {unit.number for unit in units} == {3}
    # Headings and lead-ins are what a sentence is about, for scoring.
    assert units[0].context == "Rotation"
    assert units[3].context == "Paging and escalation The escalation policy is:"
    assert units[-1].context == "How long does the battery last?"


def test_table_rows_carry_their_column_names_and_phrase_items_their_lead_in():
    text = (
        "5. Approval thresholds\n\nEach claim is routed automatically:\n\n| Claim total | Approver |\n"
        "| Up to €500 | Direct manager |\n| €2,500.01 \u2013 €10,000 | Department head and Finance Controller |\n\n"
        "EQUIPMENT\n\nEvery employee receives:\n - a 14-inch laptop\n - a YubiKey 5 NFC security key\n\n"
        "It holds these certifications:\n\nCE marking under the Machinery Directive\nUL 3100 for battery safety\n\n"
        "Each robot has two emergency stop buttons."
    )
    assert [unit.sentence for unit in sentence_units(text)] == [
        "Claim total: Up to €500; Approver: Direct manager",
        "Claim total: €2,500.01 \u2013 €10,000; Approver: Department head and Finance Controller",
        "Every employee receives: a 14-inch laptop; a YubiKey 5 NFC security key",
        "It holds these certifications: CE marking under the Machinery Directive; UL 3100 for battery safety",
        "Each robot has two emergency stop buttons.",
    ]


def test_sentences_split_at_ends_not_at_abbreviations_and_wrapped_lines_join():
    text = (
        "Owner: Security team, led by Dr. Léa Fontaine\nVersion: 5.0\n\nPasswords need 14 characters, e.g. four\n"
        "words. Reuse is a violation! Why? Because.\n\nexperimental study of a wing . an experimental study was made ."
    )
    assert [unit.sentence for unit in sentence_units(text)] == [
        "Owner: Security team, led by Dr. Léa Fontaine",  # "Label: value" lines say something
        "Version: 5.0",
        "Passwords need 14 characters, e.g. four words.",
        "Reuse is a violation!",
        "experimental study of a wing .",
        "an experimental study was made .",
    ]


def test_questions_in_parts_numbers_and_what_a_question_asks_for():
    assert question_parts("What is the maximum payload of the Atlas-7, and how long does the battery last?") == [
        "What is the maximum payload of the Atlas-7",
        "how long does the battery last",
    ]
    assert question_parts("Who approves a claim above 5,000 euros?") == ["Who approves a claim above 5,000 euros?"]
    assert [(n.value, n.currency) for n in numbers_of("a claim of €3,000 or 5,000 euros, 3,000 cycles, Atlas-7")] == [
        (3000.0, True),
        (5000.0, True),
        (3000.0, False),
    ]
    assert answer_kind("How much does the Atlas Care Plus plan cost?").name == "money"
    assert answer_kind("How long does the battery last?").name == "duration"
    assert answer_kind("How many robots can one site run?").counted == "robot"
    assert answer_kind("What should I do if I lose my YubiKey?").name == "instruction"
    assert answer_kind("Who is the CEO?") is None
    count = answer_kind("After how many failed attempts is an account locked?")
    assert holds_kind(count, "After 10 failed login attempts the account is locked.")
    assert not holds_kind(count, "The account is locked for 30 minutes.")
    assert not holds_kind(answer_kind("How much does it cost?"), "Coverage extends to 5 years.")


def test_without_embeddings_words_alone_decide():
    sources = [
        Source(1, 11, 1, "Robot", "# Robot\n\nThe robot runs for 10 hours. Charging takes 90 minutes.", 0, 60, 0.9),
        Source(2, 12, 2, "Travel", "Receipts are due within 30 days. Charging a card needs approval.", 0, 64, 0.5),
    ]
    answer = extractive_answer("How long does charging take?", sources, embedding_model=None)
    assert answer.text == f"{LEAD}\n\n- Charging takes 90 minutes. [1]"
    assert not answer.abstained and [(e.number, e.sentence) for e in answer.extracts] == [
        (1, "Charging takes 90 minutes.")
    ]
    declined = extractive_answer("What is the parental leave policy?", sources, embedding_model=None)
    assert declined.abstained and declined.extracts == []
    assert declined.text == f"{NOT_ANSWERED}\n\n{CLOSEST_LEAD}\n- Robot [1]\n- Travel [2]"
    assert [c["number"] for c in declined.closest] == [1, 2]
    nothing = extractive_answer("anything", [], embedding_model=None)
    assert (nothing.text, nothing.abstained, nothing.closest) == (NOTHING_FOUND, True, [])


# --------------------------------------------------------------------------- the demo corpus


def ingest(collection, documents: list[tuple[str, bytes]]) -> None:
    ids = [
        document_create(collection=collection, source_name=name, content=content, enqueue=False)[0].pk
        for name, content in documents
    ]
    pipeline.documents_ingest(document_ids=ids)


@pytest.fixture(scope="module")
def demo(django_db_setup, django_db_blocker, tmp_path_factory):
    """The demo corpus's handbook as ``seed_demo`` loads it (its English files), ingested once for the module."""
    english = [path for path in sorted(DEMO.iterdir()) if language_of(path.read_text(encoding="utf-8")) == "en"]
    with django_db_blocker.unblock(), override_settings(MEDIA_ROOT=tmp_path_factory.mktemp("media")):
        workspace = workspace_create(name="Demo answers", slug="demo-answers")
        collection = collection_create(workspace=workspace, name="Northwind handbook")
        ingest(collection, [(path.name, path.read_bytes()) for path in english])
        names = dict(Document.objects.filter(collection=collection).values_list("pk", "source_name"))
        yield SimpleNamespace(workspace=workspace, collection=collection, names=names)
        workspace.delete()


def ask(corpus, question: str, *, embeddings: bool = True):
    """The sources ``answer_create`` would retrieve, and the extractive answer from them
    (``embeddings=False``: as when the embedder cannot run)."""
    sources = sources_retrieved(question, workspace=corpus.workspace, collections=[corpus.collection.pk], top_k=TOP_K)
    collection = corpus.collection
    answer = extractive_answer(
        question,
        sources,
        embedding_model=collection.embedding_model if embeddings else None,
        text_search_config=collection.text_search_config,
    )
    return sources, answer


@pytest.fixture(scope="module")
def answered(demo, django_db_blocker):
    """Every QA question asked once: id -> (sources, answer, files cited)."""
    with django_db_blocker.unblock():
        results = {}
        for item in QA:
            sources, answer = ask(demo, item["question"])
            by_number = {source.number: demo.names[source.document_id] for source in sources}
            results[item["id"]] = (sources, answer, {by_number[extract.number] for extract in answer.extracts})
        return results


def correct(item: dict, answer, cited: set[str]) -> bool:
    if item["kind"] == "unanswerable":
        return answer.abstained
    return (
        not answer.abstained
        and all(re.search(pattern, answer.text, re.IGNORECASE) for pattern in item["expected"])
        and set(item["sources"]) <= cited
    )


def corpus_headings() -> set[str]:
    """Every heading of the demo files, as written: Markdown's, HTML's, the text file's capitals."""
    headings = set()
    for path in DEMO.iterdir():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".md":
            headings |= {re.sub(r"^#+\s*(\d+\.\s*)?", "", line) for line in text.splitlines() if line.startswith("#")}
        elif path.suffix == ".html":
            headings |= set(re.findall(r"<h[1-6]>(.*?)</h[1-6]>", text))
        else:
            headings |= {line for line in text.splitlines() if line.strip() and line.upper() == line}
    return {heading.strip().lower() for heading in headings}


def test_the_qa_set_is_well_formed():
    ids = [item["id"] for item in QA]
    assert len(ids) == len(set(ids)) and len(QA) >= 30
    assert set(README_QUESTIONS) <= {item["question"] for item in QA}
    files = {path.name for path in DEMO.iterdir()}
    for item in QA:
        assert set(item) == {"id", "question", "expected", "sources", "kind"}, item["id"]
        assert item["kind"] in {"single", "two_facts", "two_documents", "unanswerable"}, item["id"]
        assert set(item["sources"]) <= files, item["id"]
        for pattern in item["expected"]:
            re.compile(pattern)
        if item["kind"] == "unanswerable":
            assert item["expected"] == [] and item["sources"] == [], item["id"]
        else:
            assert item["expected"] and item["sources"], item["id"]
        if item["kind"] == "two_documents":
            assert len(item["sources"]) == 2, item["id"]
    assert sum(item["kind"] == "unanswerable" for item in QA) >= 4


def test_no_heading_alone_and_no_list_artifact_is_ever_quoted(answered):
    headings = corpus_headings()
    assert "receipts and submission deadline" in headings and "how long does the battery last?" in headings
    for item in QA:
        _, answer, _ = answered[item["id"]]
        assert "- -" not in answer.text and "* " not in answer.text, item["id"]
        for extract in answer.extracts:
            sentence = extract.sentence.strip()
            assert sentence.lower() not in headings, (item["id"], sentence)
            assert not sentence.endswith("?"), (item["id"], sentence)
            assert not BULLET_START.match(sentence), (item["id"], sentence)
            assert f"- {sentence} [{extract.number}]" in answer.text.split("\n")


def test_the_approver_of_a_claim_above_5000_euros_is_named(answered):
    [item] = [item for item in QA if item["question"] == "Who approves a claim above 5,000 euros?"]
    _, answer, cited = answered[item["id"]]
    first = answer.extracts[0].sentence
    assert "Department head and Finance Controller (currently Ingrid Halvorsen)" in first
    assert cited == {"travel-and-expenses.md"}


def test_a_question_in_two_parts_gets_both_facts(answered):
    payload = next(item for item in QA if item["question"].startswith("What is the maximum payload"))
    _, answer, _ = answered[payload["id"]]
    assert re.search(r"600 kg", answer.text) and re.search(r"\b10 hours", answer.text)
    yubikey = next(item for item in QA if "YubiKey" in item["question"])
    _, answer, cited = answered[yubikey["id"]]
    assert "the IT Service Desk the same working day" in answer.text and "within 10 working days" in answer.text
    assert cited == {"security-policy.md", "remote-work-policy.md"}


def test_an_unanswerable_question_is_declined_with_the_closest_passages(answered):
    item = next(item for item in QA if item["question"] == "What is the parental leave policy?")
    sources, answer, _ = answered[item["id"]]
    assert answer.abstained and answer.extracts == []
    lines = answer.text.split("\n")
    assert lines[:3] == [NOT_ANSWERED, "", CLOSEST_LEAD]
    by_number = {source.number: source for source in sources}
    assert 1 <= len(answer.closest) <= 3
    for closest in answer.closest:
        source = by_number[closest["number"]]
        assert (closest["chunk_id"], closest["document_id"], closest["title"]) == (
            source.chunk_id,
            source.document_id,
            source.title,
        )
        assert closest["score"] < ABSTAIN_BELOW
        assert any(line.startswith(f"- {source.title} ") and f"[{source.number}]" in line for line in lines[3:])
    assert answer.relevance is not None and answer.relevance < ABSTAIN_BELOW


def test_an_answerable_question_is_answered_and_relevance_says_the_same(demo, answered):
    item = next(item for item in QA if item["question"] == "What is the per-diem for a full day in Zürich?")
    sources, answer, cited = answered[item["id"]]
    assert not answer.abstained and answer.text.startswith(f"{LEAD}\n\n- ")
    assert "Full day: €68" in answer.text and cited == {"travel-and-expenses.md"}
    collection = demo.collection
    shared = relevance(
        item["question"],
        sources,
        embedding_model=collection.embedding_model,
        text_search_config=collection.text_search_config,
    )
    assert (shared.abstain, shared.score, shared.closest) == (False, answer.relevance, answer.closest)


def test_the_whole_qa_set_extractively(answered):
    outcomes = {item["id"]: correct(item, *answered[item["id"]][1:]) for item in QA}
    unanswerable = [item["id"] for item in QA if item["kind"] == "unanswerable"]
    answerable = [item["id"] for item in QA if item["kind"] != "unanswerable"]
    rate = sum(outcomes.values()) / len(QA)
    print(
        json.dumps(
            {
                "extractive_correct": round(rate, 3),
                "correct": sum(outcomes.values()),
                "questions": len(QA),
                "wrong": sorted(key for key, good in outcomes.items() if not good),
                "false_abstentions": sorted(key for key in answerable if answered[key][1].abstained),
            }
        )
    )
    # Two unanswerable questions hold most of a sentence's words (q40's "days ... per year" in the
    # training rule, q41's "maximum ... Atlas-7 ... operation"): the line that declined them
    # declined a fifth of the questions written without these rules (docs/answers.md, "Calibration").
    assert [key for key in unanswerable if not outcomes[key]] == ["q40", "q41"]
    assert not any(answered[key][1].abstained for key in answerable)
    assert rate >= 0.93


def test_near_misses_are_declined(demo):
    declined = {question: ask(demo, question)[1].abstained for question in NEAR_MISSES}
    print(json.dumps({"near_misses_declined": sum(declined.values()), "of": len(declined)}))
    assert sum(declined.values()) >= len(NEAR_MISSES) - 2, [q for q, ok in declined.items() if not ok]


# --------------------------------------------------------------------------- calibration


@pytest.fixture(scope="module")
def cranfield(django_db_setup, django_db_blocker, tmp_path_factory):
    if not CRANFIELD_QRELS.exists():
        pytest.skip(f"no Cranfield judgements at {CRANFIELD_QRELS}")
    with django_db_blocker.unblock(), override_settings(MEDIA_ROOT=tmp_path_factory.mktemp("media")):
        workspace = workspace_create(name="Cranfield answers", slug="cranfield-answers")
        collection = collection_create(workspace=workspace, name="Cranfield 500")
        documents = [(f"{item.id}.txt", item.content().encode()) for item in corpus_read(CRANFIELD) if item.content()]
        ingest(collection, documents)
        names = dict(Document.objects.filter(collection=collection).values_list("pk", "source_name"))
        yield SimpleNamespace(workspace=workspace, collection=collection, names=names)
        workspace.delete()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_abstention_calibration(demo, cranfield, django_db_blocker):
    """Positives: answerable demo questions; Cranfield queries whose retrieved sources hold a
    document judged 3 or 4 (a complete or highly relevant answer). Negatives: the unanswerable
    demo questions and near misses, and each collection's questions asked of the other."""
    queries = [json.loads(line) for line in (CRANFIELD / "queries.jsonl").read_text().splitlines() if line]
    judged: dict[str, dict[str, int]] = {}
    for line in CRANFIELD_QRELS.read_text().splitlines()[1:]:
        query_id, document_id, grade = line.split("\t")
        judged.setdefault(query_id, {})[f"{document_id}.txt"] = int(grade)
    with django_db_blocker.unblock():
        figures = {"threshold": ABSTAIN_BELOW, "lexical_threshold": ABSTAIN_BELOW_LEXICAL}
        for embeddings, prefix in ((True, ""), (False, "lexical_")):
            figures.update(
                {prefix + key: value for key, value in _rates(demo, cranfield, queries, judged, embeddings).items()}
            )
    print(json.dumps(figures))
    assert figures["demo_false_abstention"] == 0 and figures["demo_unanswerable_declined"] >= 4 / 6
    assert figures["lexical_demo_false_abstention"] == 0
    assert figures["cross_collection_declined"] >= 0.95
    assert figures["cranfield_false_abstention"] <= 0.15
    # Terms weighed by rarity: a query whose rare words no source holds is declined.
    assert figures["cranfield_unjudged_declined"] >= 0.5


def _rates(demo, cranfield, queries: list[dict], judged: dict[str, dict[str, int]], embeddings: bool) -> dict:
    positives = answered = unjudged = unjudged_declined = 0
    for query in queries:
        grades = judged.get(query["_id"], {})
        sources, answer = ask(cranfield, query["text"], embeddings=embeddings)
        if max((grades.get(cranfield.names[s.document_id], 0) for s in sources), default=0) >= 3:
            positives += 1
            answered += not answer.abstained
        elif not set(grades) & set(cranfield.names.values()):  # none judged among the 500
            unjudged += 1
            unjudged_declined += answer.abstained
    across_answers = [ask(demo, query["text"], embeddings=embeddings)[1] for query in queries]
    across_answers += [ask(cranfield, item["question"], embeddings=embeddings)[1] for item in QA]
    across = [answer.abstained for answer in across_answers]
    demo_answers = {item["id"]: ask(demo, item["question"], embeddings=embeddings)[1] for item in QA}
    answerable = [demo_answers[item["id"]] for item in QA if item["kind"] != "unanswerable"]
    unanswerable = [demo_answers[item["id"]] for item in QA if item["kind"] == "unanswerable"]
    near_answers = [ask(demo, question, embeddings=embeddings)[1] for question in NEAR_MISSES]
    near = [answer.abstained for answer in near_answers]
    return {
        "demo_false_abstention": sum(a.abstained for a in answerable) / len(answerable),
        "demo_unanswerable_declined": sum(a.abstained for a in unanswerable) / len(unanswerable),
        "near_misses_declined": round(sum(near) / len(near), 3),
        "cranfield_false_abstention": round(1 - answered / positives, 3),
        "cranfield_positives": positives,
        "cranfield_unjudged_declined": round(unjudged_declined / unjudged, 3),
        "cranfield_unjudged": unjudged,
        "cross_collection_declined": round(sum(across) / len(across), 3),
        "cross_collection_questions": len(across),
        "highest_cross_collection": max(answer.relevance for answer in across_answers),
        "lowest_answerable_demo": min(a.relevance for a in answerable),
        "highest_unanswerable_demo": max(a.relevance for a in unanswerable),
        "highest_near_misses": sorted((a.relevance for a in near_answers), reverse=True)[:3],
    }


# --------------------------------------------------------------------------- manage.py eval_answers


def test_eval_answers_asks_through_the_answer_path_and_judges_each_answer(demo, django_db_blocker, tmp_path):
    """The command on the demo corpus without any route (extractive), on the README's first five
    questions and two unanswerable ones: the verdicts the answers earn, and a refused file."""
    chosen = [item for item in QA if item["id"] in ("q01", "q02", "q03", "q04", "q05")]
    chosen += [item for item in QA if item["kind"] == "unanswerable"][:2]
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(item) + "\n" for item in chosen))
    out = io.StringIO()
    with django_db_blocker.unblock():
        call_command("eval_answers", str(qa), "--workspace", demo.workspace.slug, stdout=out)
    lines = out.getvalue().strip().splitlines()
    summary = json.loads(lines[-1])
    assert (summary["model"], summary["questions"], summary["answerable"]) == ("extractive", 7, 5)
    assert (summary["correct"], summary["right_source"], summary["citation_validity"]) == (1.0, 1.0, 1.0)
    assert (summary["unanswerable_declined"], summary["answerable_declined"], summary["failed"]) == (1.0, 0.0, 0)
    assert summary["modes"] == {"extractive": 7} and summary["latency_p50_ms"] > 0
    assert [line.split()[0] for line in lines[:-1]] == [item["id"] for item in chosen]

    with pytest.raises(CommandError, match=r"--half asks one half; --halves and --held-out compare two sets"):
        call_command("eval_answers", str(qa), "--workspace", demo.workspace.slug, "--half", "odd", "--halves")

    qa.write_text('{"id": "x", "question": "q", "expected": ["("], "sources": [], "kind": "single"}\n')
    with pytest.raises(CommandError, match=r"qa.jsonl:1: a pattern does not compile"):
        call_command("eval_answers", str(qa), "--workspace", demo.workspace.slug)
    qa.write_text('{"id": "x", "question": "q", "expected": [], "sources": [], "kind": "trivia"}\n')
    with pytest.raises(CommandError, match=r"qa.jsonl:1: kind 'trivia' is not one of single"):
        call_command("eval_answers", str(qa), "--workspace", demo.workspace.slug)


def test_eval_answers_reports_questions_nobody_tuned_for_beside_the_tuned_ones(demo, django_db_blocker):
    """``demo/qa.jsonl`` (the rules were found on it) beside ``demo/qa-heldout.jsonl`` (written
    by an author who saw neither it nor the code), each answerable question asked again with
    its own source documents left out (``--removed-source``). Floors at the figures of
    docs/answers.md, "Questions nobody tuned for"; the gap in correctness is still over 0.05."""
    out = io.StringIO()
    with django_db_blocker.unblock():
        call_command(
            "eval_answers",
            str(ROOT / "demo" / "qa.jsonl"),
            "--workspace",
            demo.workspace.slug,
            "--held-out",
            str(ROOT / "demo" / "qa-heldout.jsonl"),
            "--removed-source",
            stdout=out,
        )
    lines = out.getvalue().strip().splitlines()
    report = json.loads(lines[-1])
    # Each set's line as it ends, after its questions' lines.
    tuned_at = lines.index(json.dumps({"tuned": report["tuned"]}, ensure_ascii=False))
    assert lines[-2] == json.dumps({"held_out": report["held_out"]}, ensure_ascii=False)
    assert [line.split()[0] for line in lines[:tuned_at]] == [item["id"] for item in QA]
    tuned, held_out = report["tuned"], report["held_out"]
    assert (tuned["questions"], tuned["answerable"], held_out["questions"], held_out["answerable"]) == (43, 37, 60, 47)
    # A question counts as unanswerable once its source is gone only when no other document
    # holds its answer: 5 of the tuned set's and 12 of the held-out set's still are.
    assert (tuned["removed_source_questions"], tuned["removed_source_skipped"]) == (32, 5)
    assert (held_out["removed_source_questions"], held_out["removed_source_skipped"]) == (35, 12)
    assert tuned["removed_source_declined"] >= 0.95 and held_out["removed_source_declined"] >= 0.9
    assert tuned["answerable_declined"] == 0.0 and held_out["answerable_declined"] <= 0.05
    assert tuned["correct"] >= 0.97 and held_out["correct"] >= 0.91
    assert report["gap"]["correct"] == round(held_out["correct"] - tuned["correct"], 4)
    assert tuple(report["gap"]) == COMPARED  # every share both sets have
    removed = [line for line in lines if "removed_source_declined=" in line]
    assert len(removed) == 32 + 35 and all(line.split()[1] == "extractive" for line in removed)
