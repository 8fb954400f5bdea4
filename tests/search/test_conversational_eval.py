"""The conversational retrieval evaluation (search/conversational_eval.py): the rule that
turns a judged question into a first turn and a follow-up, the written sample's reader, and
``eval_retrieval --conversational`` end to end."""

from __future__ import annotations

import io
import json
import math

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from search.conversational_eval import conversation_built, followups_read, subject_of
from tests.search.test_commands import write_mini

# word -> (lexeme, IDF), as search.answering.conversations.word_weights gives them.
AIRCRAFT = "what similarity laws must be obeyed when constructing aeroelastic models of heated high speed aircraft ."
AIRCRAFT_WEIGHTS = {
    "what": ("what", 5.0),  # rarest of all, but a word that asks: never the subject
    "similarity": ("similar", 3.1),
    "laws": ("law", 3.0),
    "must": ("must", 2.0),
    "obeyed": ("obey", 4.2),
    "when": ("when", 3.5),
    "constructing": ("construct", 3.9),
    "aeroelastic": ("aeroelast", 4.6),
    "models": ("model", 2.2),
    "heated": ("heat", 2.8),
    "high": ("high", 1.0),
    "speed": ("speed", 1.2),
    "aircraft": ("aircraft", 2.9),
}
FLUTTER = "Is the flutter of thin wings like the flutter of a thick wing?"
FLUTTER_WEIGHTS = {
    "flutter": ("flutter", 4.0),
    "thin": ("thin", 2.5),
    "thick": ("thick", 2.5),
    "wings": ("wing", 1.5),
    "wing": ("wing", 1.5),
}


def test_the_subject_is_the_three_rarest_words_that_name_and_the_follow_up_leaves_them_out():
    built = conversation_built("1", AIRCRAFT, AIRCRAFT_WEIGHTS)
    # Ten stems name something ("what" and "when" ask); the three rarest, in the question's order.
    assert built.subject == ("obeyed", "constructing", "aeroelastic")
    assert built.first_turn == "I have a question about obeyed constructing aeroelastic."
    # "constructing aeroelastic" is one run: one pronoun for both.
    assert built.followup == "what similarity laws must be it when it models of heated high speed aircraft ."
    assert (built.query_id, built.question) == ("1", AIRCRAFT)


def test_a_short_question_keeps_half_its_words_and_every_form_of_the_subject_goes():
    # Four stems: two are the subject. "thin" and "thick" tie: the earlier wins. Both
    # "flutter"s go, each with its article.
    assert subject_of(FLUTTER, FLUTTER_WEIGHTS) == ("flutter", "thin")
    built = conversation_built("2", FLUTTER, FLUTTER_WEIGHTS)
    assert built.first_turn == "I have a question about flutter thin."
    assert built.followup == "Is it of it wings like it of a thick wing?"
    # A run with an article before it is one pronoun; one stem, two forms ("wings", "wing").
    weights = {**FLUTTER_WEIGHTS, "wings": ("wing", 4.5)}
    assert conversation_built("3", FLUTTER, weights).followup == "Is it of thin it like it of a thick it?"


def test_questions_with_one_telling_word_or_none():
    assert conversation_built("4", "what is flutter ?", FLUTTER_WEIGHTS).followup == "what is it ?"
    nothing = conversation_built("5", "what is it ?", FLUTTER_WEIGHTS)
    assert (nothing.subject, nothing.first_turn, nothing.followup) == ((), "I have a question.", "what is it ?")


def test_the_written_sample_is_read_and_checked(tmp_path):
    queries = {"q1": "supersonic wing flutter", "q2": "laminar heat transfer"}
    path = tmp_path / "followups.jsonl"
    path.write_text(
        json.dumps({"query_id": "q2", "first_turn": " Laminar heat transfer. ", "followup": "Papers on it?"}) + "\n\n"
    )
    (written,) = followups_read(path, queries)
    assert (written.query_id, written.question, written.first_turn, written.followup, written.subject) == (
        "q2",
        "laminar heat transfer",
        "Laminar heat transfer.",
        "Papers on it?",
        (),
    )
    for line, error in [
        ({"query_id": "q9", "first_turn": "x", "followup": "y"}, "line 1: query q9 is not a judged query"),
        ({"query_id": "q1", "first_turn": "x"}, r"line 1: .* lacking \['followup'\]"),
        ("not json", "line 1: not JSON"),
        ({"query_id": "q1", "first_turn": "x", "followup": " "}, "line 1: first_turn and followup must be non-empty"),
    ]:
        path.write_text((line if isinstance(line, str) else json.dumps(line)) + "\n")
        with pytest.raises(ValueError, match=error):
            followups_read(path, queries)
    path.write_text((json.dumps({"query_id": "q1", "first_turn": "x", "followup": "y"}) + "\n\n") * 2)
    with pytest.raises(ValueError, match="line 3: query q1 is given twice"):
        followups_read(path, queries)


VARIANT_KEYS = [
    f"{variant}_{metric}"
    for variant in ("standalone", "followup_alone", "followup_terms")
    for metric in ("ndcg@10", "recall@100", "mrr@10")
]


@pytest.mark.django_db
def test_eval_retrieval_conversational_prints_both_sets_as_its_last_line(tmp_path):
    write_mini(tmp_path / "mini")
    followups = tmp_path / "followups.jsonl"
    # A follow-up that holds no word of the corpus: alone it finds nothing at all.
    followups.write_text(
        json.dumps({"query_id": "q1", "first_turn": "Tell me about wing flutter.", "followup": "When does it happen?"})
    )
    out = io.StringIO()
    arguments = ["--mode", "keyword", "--conversational", "--followups", str(followups)]
    call_command("eval_retrieval", str(tmp_path / "mini"), *arguments, stdout=out, stderr=io.StringIO())
    lines = out.getvalue().strip().splitlines()
    result = json.loads(lines[-1])
    assert list(result) == ["collection", "queries", "mode", "rule", "written"]
    assert (result["collection"], result["queries"], result["mode"]) == ("mini", 2, "keyword")
    rule, written = result["rule"], result["written"]
    assert list(rule) == ["queries", *VARIANT_KEYS, "alone_ratio", "terms_ratio"]
    assert list(written) == ["queries", *VARIANT_KEYS, "alone_ratio", "terms_ratio", "path", "rule_same_queries"]
    assert (rule["queries"], written["queries"], written["path"]) == (2, 1, str(followups))
    # Every word of the mini corpus is in one chunk of three: the same IDF, so the subject is
    # each question's first word ("supersonic", "laminar"), and the follow-ups ("it wing
    # flutter", "it heat transfer") still find what the questions find.
    q2 = 1 / (1 + 1 / math.log2(3))  # as tests/search/test_commands.py: d2 first, d3 not matched
    assert rule["standalone_ndcg@10"] == round((1.0 + q2) / 2, 4)
    assert rule["followup_alone_ndcg@10"] == rule["followup_terms_ndcg@10"] == rule["standalone_ndcg@10"]
    assert (rule["alone_ratio"], rule["terms_ratio"]) == (1.0, 1.0)
    # The written follow-up alone finds nothing; read with its first turn ("wing", "flutter"
    # added), d1 first as the question itself.
    assert (written["standalone_ndcg@10"], written["followup_alone_ndcg@10"], written["followup_terms_ndcg@10"]) == (
        1.0,
        0.0,
        1.0,
    )
    assert (written["followup_alone_recall@100"], written["alone_ratio"], written["terms_ratio"]) == (0.0, 0.0, 1.0)
    assert written["rule_same_queries"] == {
        "followup_alone_ndcg@10": 1.0,
        "followup_terms_ndcg@10": 1.0,
        "terms_ratio": 1.0,
    }
    # The table before it: the rule's set, the written one, the rule's over the written one's queries.
    assert lines[-6].startswith("nDCG@10 / Recall@100 / MRR@10")
    assert [line.split("  ")[0] for line in lines[-5:-1]] == ["set", "rule", "written", "rule, same"]

    # Without a written sample: the rule's set alone, the same figures.
    out = io.StringIO()
    arguments = ["--mode", "keyword", "--conversational"]
    call_command("eval_retrieval", str(tmp_path / "mini"), *arguments, stdout=out, stderr=io.StringIO())
    alone = json.loads(out.getvalue().strip().splitlines()[-1])
    assert (alone["rule"], alone["written"]) == (rule, None)


@pytest.mark.django_db
def test_followups_go_with_conversational(tmp_path):
    write_mini(tmp_path / "mini")
    with pytest.raises(CommandError, match="--followups goes with --conversational"):
        call_command("eval_retrieval", str(tmp_path / "mini"), "--followups", str(tmp_path / "f.jsonl"))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)  # the remote worker reads the route
def test_rewrite_route_adds_the_models_reading_and_counts_its_fallbacks(tmp_path, upstream_server):
    from tests.conftest import celery_worker
    from tests.search.answering.test_answers import remote_provider
    from tests.upstream_server import upstream_log, upstream_script

    write_mini(tmp_path / "mini")
    followups = tmp_path / "followups.jsonl"
    followups.write_text(
        json.dumps({"query_id": "q1", "first_turn": "Tell me about wing flutter.", "followup": "When does it happen?"})
    )
    route, api_key = remote_provider(upstream_server)
    # One rewrite at a time, in the sets' order: the rule's q1 and q2 rewritten back into their
    # questions, then the written q1's rewrite refused (it falls back to the terms' reading).
    upstream_script(
        upstream_server,
        api_key,
        [{"reply": "supersonic wing flutter"}, {"reply": "laminar heat transfer"}, {"status": 400}],
    )
    arguments = ["--mode", "keyword", "--conversational", "--followups", str(followups)]
    arguments += ["--rewrite-route", route.name, "--rewrite-concurrency", "1"]
    out = io.StringIO()
    with celery_worker(["remote"], tmp_path, pool="threads", concurrency=2):
        call_command("eval_retrieval", str(tmp_path / "mini"), *arguments, stdout=out, stderr=io.StringIO())
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    rule, written = result["rule"], result["written"]
    assert rule["followup_model_ndcg@10"] == rule["standalone_ndcg@10"] and rule["model_ratio"] == 1.0
    assert (rule["model_route"], rule["model_fallbacks"]) == (route.name, {})
    assert [sample["rewritten"] for sample in rule["model_samples"]] == [
        "supersonic wing flutter",
        "laminar heat transfer",
    ]
    assert written["model_fallbacks"] == {"the rewrite failed": 1}
    assert written["followup_model_ndcg@10"] == written["followup_terms_ndcg@10"] == 1.0
    seen = upstream_log(upstream_server, api_key)
    assert [entry["outcome"] for entry in seen] == ["ok", "ok", "status 400"]
    assert all(entry["max_tokens"] == 64 and entry["temperature"] == 0 for entry in seen)
    assert out.getvalue().strip().splitlines()[-5].split("  ")[-1] == "model / standalone"
