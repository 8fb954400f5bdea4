"""Answers to Japanese questions: said in Japanese, quoted from Japanese sentences, declined in
Japanese, and answered from the sources when the route's model does not write Japanese."""

from __future__ import annotations

import pytest

from inference.models import Provider, Route, UpstreamKey
from search.answering.abstention import answer_kind, numbers_of, sentence_units
from search.answering.answers import answer_create
from search.answering.prompting import SYSTEM_PROMPT_JAPANESE, Source, answer_messages
from search.models import Answer, Document
from search.services import collection_create, workspace_create
from tests.search.files import ingest_texts

pytestmark = pytest.mark.django_db(transaction=True)

TEXTS = {
    "経費精算規程.md": (
        "# 経費精算規程\n\n## 第3条（申請期限）\n"
        "経費の精算は、支出日から30日以内に申請してください。60日を過ぎた申請は精算しません。\n\n"
        "## 第5条（日当）\n国内出張の日当は1日あたり3,000円です。日帰り出張の日当は2,000円とします。\n"
    ),
    "情報セキュリティ規程.md": (
        "# 情報セキュリティ規程\n\n"
        "セキュリティインシデントの疑いがある場合は、4時間以内にセキュリティチームへ報告してください。\n"
    ),
}
LEAD_NO_MODEL = "資料から抜粋しました（生成モデルが設定されていません）："


@pytest.fixture
def corpus(db):
    workspace = workspace_create(name="東京", slug="tokyo")
    collection = collection_create(workspace=workspace, name="社内規程")
    ingest_texts(collection, TEXTS)
    return workspace, collection


def cited_files(answer: Answer) -> set[str]:
    names = dict(Document.objects.values_list("pk", "source_name"))
    return {names[citation["document_id"]] for citation in answer.citations}


def test_a_japanese_question_is_answered_with_a_japanese_lead(corpus):
    workspace, _ = corpus
    answer = answer_create(workspace=workspace, question="日帰り出張の日当はいくらですか")
    assert (answer.mode, answer.status, answer.abstained) == ("extractive", "done", False)
    lines = answer.text.split("\n")
    assert lines[:2] == [LEAD_NO_MODEL, ""]
    assert "- 日帰り出張の日当は2,000円とします。 [" in answer.text
    assert cited_files(answer) == {"経費精算規程.md"}
    # Why, for operators, stays in English.
    assert answer.stats["why"] == "no generation model is configured"


def test_a_question_the_sources_do_not_answer_is_declined_in_japanese(corpus):
    workspace, _ = corpus
    answer = answer_create(workspace=workspace, question="社員食堂のランチの値段はいくらですか")
    assert (answer.mode, answer.abstained) == ("extractive", True)
    assert answer.text.startswith("見つかった資料には、この質問への答えがありません。")


def test_a_route_whose_model_does_not_write_japanese_answers_from_the_sources(corpus, upstream_server):
    workspace, _ = corpus
    provider = Provider.objects.create(
        name="english-only",
        kind=Provider.Kind.OPENAI_COMPATIBLE,
        base_url=upstream_server,
        model="stand-in-7b",
        context_window=4096,
    )
    key = UpstreamKey(provider=provider, label="main")
    key.set_secret("sk-test")
    key.save()
    Route.objects.create(name="default", provider=provider, is_default=True, languages=["en"])

    answer = answer_create(workspace=workspace, question="セキュリティインシデントは何時間以内に報告しますか")
    assert (answer.mode, answer.status, answer.route_id) == ("extractive", "done", None)
    assert answer.text.split("\n")[0] == "資料から抜粋しました（生成モデルが日本語で回答できないため）："
    assert "4時間以内にセキュリティチームへ報告してください。" in answer.text
    assert answer.stats["why"] == "the generation model does not answer in Japanese"
    assert cited_files(answer) == {"情報セキュリティ規程.md"}


def test_japanese_sentences_headings_numbers_and_kinds():
    units = sentence_units(TEXTS["経費精算規程.md"], 1)
    assert [(unit.sentence, unit.context) for unit in units] == [
        ("経費の精算は、支出日から30日以内に申請してください。", "第3条（申請期限）"),
        ("60日を過ぎた申請は精算しません。", "第3条（申請期限）"),
        ("国内出張の日当は1日あたり3,000円です。", "第5条（日当）"),
        ("日帰り出張の日当は2,000円とします。", "第5条（日当）"),
    ]
    assert [n.value for n in numbers_of("2026年度第１四半期の売上高は7億9,800万円")] == [2026, 1, 7, 9800]
    assert [n.currency for n in numbers_of("日当は3,000円")] == [True]
    assert answer_kind("出張の日当はいくらですか").name == "money"
    assert answer_kind("申請は何日以内ですか").name == "duration"
    assert answer_kind("参加者は何人ですか").name == "count"


def test_a_japanese_question_is_prompted_in_japanese():
    text = "日当は3,000円です。"
    source = Source(1, 1, 1, title="経費精算規程", text=text, start_offset=0, end_offset=len(text), score=1.0)
    system, user = answer_messages("日当はいくらですか", [source])
    assert system == {"role": "system", "content": SYSTEM_PROMPT_JAPANESE}
    assert user["content"].startswith("資料：\n\n") and user["content"].endswith("\n\n質問：日当はいくらですか")
    english = answer_messages("What is the per-diem?", [source])
    assert english[1]["content"].startswith("Sources:\n\n")
    assert english[1]["content"].endswith("Question: What is the per-diem?")


def test_a_generated_japanese_answer_is_checked_sentence_by_sentence():
    from search.answering.verification import _sentence_spans

    text = "日帰り出張の日当は2,000円です。[1]宿泊を伴う出張は3,000円です[1]。申請は30日以内に行います！"
    assert [text[s.start : s.end] for s in _sentence_spans(text)] == [
        "日帰り出張の日当は2,000円です。[1]",
        "宿泊を伴う出張は3,000円です[1]。",
        "申請は30日以内に行います！",
    ]


def test_a_japanese_follow_up_is_read_by_its_words(corpus):
    from search.answering.conversations import word_weights, words_of

    _, collection = corpus
    words = words_of("日当はいくらですか")
    assert words == ["日当", "は", "いくら", "です", "か"]
    # Each word as keyword search reads it: 日当's lemma is in the collection, the particles rank nothing.
    assert set(word_weights(words, [collection])) == {"日当"}
