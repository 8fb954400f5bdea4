"""The analysis module reads Japanese: words with their offsets in the text as written,
lemmas as terms, sentences, languages, and hostile input handled."""

from __future__ import annotations

import pytest

from search import analysis
from search.analysis import japanese, languages, sentences
from search.analysis.highlight import snippet_html
from search.analysis.normalization import nfkc_mapped


def surfaces_hold(text: str) -> list[japanese.Token]:
    """Every token's surface is the text it spans, in order, without overlaps."""
    tokens = japanese.tokens(text)
    end = 0
    for token in tokens:
        assert text[token.start : token.end] == token.surface
        assert token.start >= end
        end = token.end
    return tokens


def test_terms_are_lemmas_of_content_words():
    assert japanese.terms("会議室を予約しました。") == ["会議", "室", "予約", "為る"]
    # Spelling variants fold to one lemma; a loanword loses UniDic's English gloss.
    assert japanese.terms("行なう") == japanese.terms("行う") == ["行う"]
    assert japanese.terms("コンピュータ") == ["コンピューター"]


def test_full_and_half_width_forms_match_but_stay_as_written():
    text = "ｶﾞｲﾄﾞﾗｲﾝとＡＢＣ１２３"
    tokens = surfaces_hold(text)
    assert [t.surface for t in tokens if t.term] == ["ｶﾞｲﾄﾞﾗｲﾝ", "ＡＢＣ", "１２３"]
    assert [t.term for t in tokens if t.term] == ["ガイドライン", "abc", "123"]
    assert japanese.terms("ガイドラインとABC123") == ["ガイドライン", "abc", "123"]


def test_combining_zero_width_and_emoji_keep_offsets():
    text = "か\u3099いと\u200bう🎉東京タワー👍🏽"
    normalised = nfkc_mapped(text)
    assert normalised.text.startswith("がいと")  # the combining voicing mark joins its kana
    tokens = surfaces_hold(text)
    assert "タワー" in [t.term for t in tokens]
    assert [t.surface for t in tokens if t.term == "タワー"] == ["タワー"]


def test_mixed_scripts_in_one_sentence():
    assert japanese.terms("PythonでAIモデルを開発する") == ["python", "ai", "モデル", "開発", "為る"]


def test_a_hundred_kilobytes_without_punctuation_or_line_breaks():
    text = "東京都特許許可局" * 4_200  # 33,600 characters, 100,800 bytes of UTF-8
    assert len(text.encode()) > 100_000
    tokens = surfaces_hold(text)
    assert tokens[-1].end == len(text)
    assert sum(len(t.surface) for t in tokens) == len(text)


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("最新の売上報告を教えてください", "ja"),
        ("What is the per-diem for a full day in Zürich?", "en"),
        ("The Tokyo (東京) office opens at nine every working day of the week.", "en"),
        ("2026年度のAWSとGitHub Copilotの費用について", "ja"),
        ("ｶﾀｶﾅ", "ja"),
        ("。。。！？", "en"),
        ("", "en"),
    ],
)
def test_language_of(text, language):
    assert languages.language_of(text) == language


def test_analysed_chooses_the_configuration_by_language():
    assert analysis.analysed("What is the per-diem?", language="auto", config="search_english") == (
        "search_english",
        None,
    )
    assert analysis.analysed("経費精算の期限", language="auto", config="search_english") == (
        "search_japanese",
        "経費 精算 期限",
    )
    # A fixed language wins over the text's own.
    assert analysis.analysed("経費精算", language="en", config="search_english") == ("search_english", None)
    assert analysis.analysed("per diem", language="ja", config="search_english") == ("search_japanese", "per diem")
    # Punctuation only: no term to rank.
    assert analysis.analysed("。、！？「」", language="ja", config="search_english") == ("search_japanese", "")


def test_sentences_end_at_japanese_marks_and_line_ends():
    text = "彼は「これは本だ。」と言った。次の文です！本当？English here. Next one\n改行で終わる"
    assert [text[a:b] for a, b in sentences.sentence_spans(text)] == [
        "彼は「これは本だ。」と言った。",
        "次の文です！",
        "本当？",
        "English here.",
        "Next one",
        "改行で終わる",
    ]


def test_snippet_marks_the_query_words_in_the_text_as_written():
    text = "東京都は日本の首都です。人口は約1400万人です。"
    assert snippet_html(text, japanese.terms("東京の人口")) == (
        "<mark>東京</mark>都は日本の首都です。<mark>人口</mark>は約1400万人です。"
    )
    # Markup in a passage is escaped, never interpreted.
    assert snippet_html("<b>東京</b>", ["トウキョウ"]) == "&lt;b&gt;<mark>東京</mark>&lt;/b&gt;"


def test_numbers_with_their_counters_are_terms_of_their_own():
    assert japanese.terms("2026年度第１四半期の売上高は7億9,800万円") == [
        "2026", "年度", "2026年度", "第", "1", "四半", "1四半", "期", "1四半期",
        "売り上げ", "高", "7", "億", "9", "800", "万", "円", "798000000円",
    ]  # fmt: skip
    assert japanese.terms("日当は3,000円、4時間以内") == [
        "日当",
        "3",
        "000",
        "円",
        "3000円",
        "4",
        "時間",
        "4時間",
        "以内",
    ]
    # A compound is a term, not a word; marked once in a snippet.
    assert analysis.words("第1四半期") == ["第", "1", "四半", "期"]
    assert snippet_html("第1四半期の売上", ["1四半期"]) == "第<mark>1四半期</mark>の売上"
