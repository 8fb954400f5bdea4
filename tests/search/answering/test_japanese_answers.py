"""Answers to Japanese questions: said in Japanese, quoted from Japanese sentences, declined in
Japanese, and answered from the sources when the route's model does not write Japanese."""

from __future__ import annotations

import pytest

from inference.models import Provider, Route, UpstreamKey
from search.answering.abstention import (
    _numbers_held,
    answer_kind,
    holds_kind,
    numbers_of,
    question_parts,
    sentence_units,
    sentences_score,
)
from search.answering.answers import answer_create
from search.answering.extractive import extractive_answer
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


def test_a_starting_pool_whose_model_does_not_write_japanese_says_so_in_japanese(corpus):
    from django.utils import timezone

    workspace, _ = corpus
    provider = Provider.objects.create(
        name="gpu-pool",
        kind=Provider.Kind.LOCAL,
        devices=["http://127.0.0.1:9/v1"],
        model="SmolLM2-135M-Instruct",
        warming_since=timezone.now(),
    )
    Route.objects.create(name="gpu-pool", provider=provider, is_default=True, languages=["en"])

    answer = answer_create(workspace=workspace, question="セキュリティインシデントは何時間以内に報告しますか")
    assert (answer.mode, answer.status, answer.route_id) == ("extractive", "done", None)
    # Started or not, this model would not answer in Japanese: that is the reason given.
    assert answer.text.split("\n")[0] == "資料から抜粋しました（生成モデルが日本語で回答できないため）："
    assert answer.stats["why"] == "the generation model does not answer in Japanese"


def test_japanese_sentences_headings_numbers_and_kinds():
    units = sentence_units(TEXTS["経費精算規程.md"], 1)
    assert [(unit.sentence, unit.context) for unit in units] == [
        ("経費の精算は、支出日から30日以内に申請してください。", "第3条（申請期限）"),
        ("60日を過ぎた申請は精算しません。", "第3条（申請期限）"),
        ("国内出張の日当は1日あたり3,000円です。", "第5条（日当）"),
        ("日帰り出張の日当は2,000円とします。", "第5条（日当）"),
    ]
    # 万 and 億 count: 7億9,800万円 is one amount of yen.
    assert [(n.value, n.currency) for n in numbers_of("2026年度第１四半期の売上高は7億9,800万円")] == [
        (2026, False),
        (1, False),
        (798_000_000, True),
    ]
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


def test_a_japanese_amount_falls_within_the_range_a_table_row_states():
    asked = numbers_of("30万円の経費申請は誰が承認しますか")
    assert [(n.value, n.currency) for n in asked] == [(300_000, True)]
    rows = {
        "申請金額（税込）: 8万円以下; 承認者: 直属上長": set(),
        "申請金額（税込）: 8万円超 40万円以下; 承認者: 直属上長および部門長": {0},
        "申請金額（税込）: 40万円超 160万円以下; 承認者: 部門長および管理部長": set(),
        "申請金額（税込）: 160万円超; 承認者: 本社CFO": set(),
        "申請金額: 20万円〜50万円": {0},
        "20万円未満の申請": set(),
        "50万円以上の申請": set(),
        "10万円以上の申請": {0},
        "交通費は300,000円です": {0},
    }
    assert {row: _numbers_held(asked, row) for row in rows} == rows


def test_a_japanese_question_in_two_parts_is_split():
    assert question_parts("YubiKeyをなくしたらいつまでに届け出ればいいですか。再発行にはどのくらいかかりますか") == [
        "YubiKeyをなくしたらいつまでに届け出ればいいですか",
        "再発行にはどのくらいかかりますか",
    ]
    assert question_parts("2025年度第3四半期と2026年度第2四半期の売上高をそれぞれ教えてください") == [
        "2025年度第3四半期の売上高を教えてください",
        "2026年度第2四半期の売上高を教えてください",
    ]
    assert question_parts("東京と大阪の社員数はそれぞれ何人ですか") == [
        "東京の社員数は何人ですか",
        "大阪の社員数は何人ですか",
    ]
    one = "最新の売上報告は誰が作成し、いつ発行されましたか"
    assert question_parts(one) == [one]
    # A sentence that asks nothing is the circumstance of the question after it.
    told = "不審なメールの添付ファイルを開いてしまいました。いつまでに報告すればいいですか"
    assert question_parts(told) == [told]


def test_who_and_why_choose_the_sentence_that_names_someone_or_gives_a_reason():
    assert answer_kind("売上報告を書いたのは誰ですか").name == "person"
    assert answer_kind("第1四半期が減収になった理由は何ですか").name == "reason"
    assert answer_kind("Why was the quarter down?").name == "reason"
    person, reason = answer_kind("誰ですか"), answer_kind("なぜですか")
    assert holds_kind(person, "作成者：高橋 健太（営業企画部 課長）")
    assert holds_kind(person, "承認者: 直属上長および部門長")
    assert not holds_kind(person, "第4四半期の売上高は11億3,600万円でした。")
    assert holds_kind(reason, "主な要因は、検収が第2四半期にずれ込んだことです。")
    assert not holds_kind(reason, "第1四半期の売上高は7億9,800万円で、減収になりました。")
    assert answer_kind("休日の夜中にインシデントに気づいたら、どこに連絡すればいいですか").name == "contact"
    assert answer_kind("Who should I contact about a lost badge?").name == "contact"
    contact = answer_kind("連絡先を教えてください")
    assert holds_kind(contact, "夜間・休日：本社セキュリティホットライン +49 89 4100 7777")
    assert holds_kind(contact, "Slack の #it-help-jp へ。")
    assert not holds_kind(contact, "インシデントに気付いてから4時間以内に報告してください。")
    assert answer_kind("試用期間中ですが、在宅勤務はできますか").name == "permission"
    assert answer_kind("私物のPCを使ってもいいですか").name == "permission"
    # 「…中なんですが」 says nothing of why.
    assert answer_kind("試用期間中なんですが、在宅勤務はできますか").name == "permission"
    permission = answer_kind("できますか")
    assert holds_kind(permission, "在宅勤務は、試用期間を終えた社員が所属長の承認を得て行うことができる。")
    assert holds_kind(permission, "日本国外での在宅勤務は認めない。")
    assert not holds_kind(permission, "新たに採用した社員については、入社日から６か月を試用期間とする。")
    # They choose what is quoted; they never decline a question on their own.
    assert person.ranking_only and reason.ranking_only and not answer_kind("いくらですか").ranking_only


def _sources(*texts: str, title: str = "資料") -> list[Source]:
    return [
        Source(
            number,
            number,
            number,
            title=title,
            text=text,
            start_offset=100 * number,
            end_offset=100 * number + len(text),
            score=1.0,
        )
        for number, text in enumerate(texts, start=1)
    ]


def test_a_sentence_of_a_list_item_is_quoted_with_the_rest_of_its_item():
    text = (
        "## 第5条（領収書）\n\n"
        "1. 領収書は受領後7営業日以内に Expensely で登録する。\n"
        "2. 領収書を紛失した場合は「領収書紛失届」を Expensely で提出する。"
        "紛失届は1年に2回まで、1件あたり12,000円までとする。\n"
    )
    item = (
        "領収書を紛失した場合は「領収書紛失届」を Expensely で提出する。"
        "紛失届は1年に2回まで、1件あたり12,000円までとする。"
    )
    units = sentence_units(text, 1)
    assert [unit.item for unit in units] == ["", item, item]
    answer = extractive_answer(
        "領収書を紛失した場合はどうすればよいですか",
        _sources(text, title="経費精算規程"),
        embedding_model=None,
        text_search_config="search_japanese",
        language="ja",
    )
    assert answer.text.split("\n")[2:] == [f"- {units[1].item} [1]"]


def test_a_question_about_a_whole_report_is_answered_by_its_opening():
    text = (
        "2026年度 第2四半期 売上報告\n\n- 発行日：2026年10月15日\n- 作成者：山本 大輔\n\n## 1. サマリー\n\n"
        "第2四半期の売上高は12億7,500万円となり、四半期として過去最高を更新しました。"
        "地域別では九州・沖縄が最大となりました。\n\n"
        "## 5. 見通し\n\n下期の売上見通しは、11月の経営会議で改定予定のため本報告には記載していません。\n"
    )
    answer = extractive_answer(
        "最新の売上報告を教えてください",
        _sources(text, title="2026年度 第2四半期 売上報告"),
        embedding_model=None,
        text_search_config="search_japanese",
        language="ja",
    )
    assert [extract.sentence for extract in answer.extracts] == [
        "第2四半期の売上高は12億7,500万円となり、四半期として過去最高を更新しました。",
        "地域別では九州・沖縄が最大となりました。",
    ]


def test_the_section_whose_heading_names_the_question_is_preferred():
    # Both sentences hold 出張 and 日当 and state an amount: the heading above decides.
    first = (
        "## 第1条（適用範囲）\n\n欧州の社員が日本へ出張する場合の日当は、グループの規程で1日あたり10,000円とする。\n"
    )
    second = "## 第4条（国内出張の日当）\n\n宿泊を伴う出張の日当は1日あたり3,000円とする。\n"
    for sources in (_sources(first, second), _sources(second, first)):
        scored = sentences_score(
            "出張の日当はいくらですか", sources, embedding_model=None, text_search_config="search_japanese"
        )
        best = scored.units[int(scored.whole.ranking.argmax())]
        assert best.sentence == "宿泊を伴う出張の日当は1日あたり3,000円とする。"
        assert scored.whole.relevance[0] == scored.whole.relevance[1]  # deciding to answer is left as it was


def test_each_part_of_a_question_is_searched_for(db):
    from search.answering.answers import sources_retrieved
    from search.selectors import chunk_search

    workspace = workspace_create(name="部品", slug="parts")
    collection = collection_create(workspace=workspace, name="規程")
    ingest_texts(
        collection,
        {
            "出張規程.md": "# 出張規程\n\n国内出張の日当は1日あたり3,000円、宿泊費の上限は1泊12,000円とする。\n",
            "海外出張規程.md": "# 海外出張規程\n\n海外出張の日当は1日あたり8,000円、宿泊費の上限は1泊25,000円とする。",
            "役員出張規程.md": "# 役員出張規程\n\n役員の出張の日当は1日あたり5,000円、宿泊費は実費とする。\n",
            **TEXTS,
        },
    )
    question = "出張の日当と宿泊費の上限はいくらですか。インシデントは何時間以内に報告しますか"
    names = dict(Document.objects.values_list("pk", "source_name"))

    def top(query: str, k: int) -> list[str]:
        hits = chunk_search(query=query, workspace=workspace, mode="hybrid", top_k=k, snippets=False, syntax="question")
        return [names[hit.document_id] for hit in hits.hits]

    parts = ["出張の日当と宿泊費の上限はいくらですか", "インシデントは何時間以内に報告しますか"]
    assert top(parts[1], 1) == ["情報セキュリティ規程.md"]
    # The whole question's best, then each part's best not yet taken, then the second of each.
    expected = []
    for rank in range(3):
        for ranking in (top(question, 3), top(parts[0], 3), top(parts[1], 3)):
            if rank < len(ranking) and ranking[rank] not in expected:
                expected.append(ranking[rank])
    sources = sources_retrieved(question, workspace=workspace, collections=None, top_k=3)
    assert [names[source.document_id] for source in sources] == expected[:3]
    assert "情報セキュリティ規程.md" in expected[:3]
    assert [source.number for source in sources] == [1, 2, 3]


def test_a_question_for_the_latest_is_quoted_from_the_newest_document_only():
    older = "## サマリー\n\n当四半期の新規稼働サイトは5拠点です。\n"
    newest = "## 主要指標\n\n受注残高は21億4,000万円です。新規稼働サイトは7拠点でした。\n"
    sources = [
        Source(
            1,
            1,
            1,
            title="2026年度 第2四半期 売上報告",
            text=newest,
            start_offset=0,
            end_offset=len(newest),
            score=1.0,
            document_date="2026-10-15",
        ),
        Source(
            2,
            2,
            2,
            title="2025年度 第3四半期 売上報告",
            text=older,
            start_offset=0,
            end_offset=len(older),
            score=1.0,
            document_date="2026-01-15",
        ),
    ]
    asked = "直近の四半期に新しく稼働したサイトはいくつありますか"
    answer = extractive_answer(
        asked, sources, embedding_model=None, text_search_config="search_japanese", language="ja"
    )
    assert [(extract.number, extract.sentence) for extract in answer.extracts] == [(1, "新規稼働サイトは7拠点でした。")]
    # Asked without "latest", the closer wording wins.
    plain = extractive_answer(
        "四半期に新しく稼働したサイトはいくつありますか",
        sources,
        embedding_model=None,
        text_search_config="search_japanese",
        language="ja",
    )
    assert plain.extracts[0].number == 2
