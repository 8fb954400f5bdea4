"""Japanese words by morphological analysis: MeCab (fugashi) with UniDic (unidic-lite).

Chosen on measurements (docs/search.md, "Japanese"): on JSQuAD it ranks best of the
analysers that ship as wheels (BM25 nDCG@10 0.940 against Sudachi's 0.937) at about twice
Sudachi's speed, and UniDic's lemma already folds spelling variants (行なう -> 行う,
コンピュータ -> コンピューター). Text is NFKC-normalised first, so half-width katakana and
full-width letters are read as words, and every token keeps its offsets in the text as
written.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from search.analysis.normalization import nfkc_mapped

# Content words rank; particles, auxiliaries and symbols do not. UniDic's first-level parts of
# speech: nouns, verbs, adjectives, adverbs, adjectival nouns (形状詞: 静か, 必要) and pronouns.
CONTENT_POS = frozenset({"名詞", "動詞", "形容詞", "副詞", "形状詞", "代名詞", "接頭辞", "接尾辞"})
# The polite verbs of requests (ください, いただく, ございます) say nothing about a topic: left out
# at index and query time alike, or 「…を教えてください」 ranks first every document that asks its
# reader to do something. Lucene's wider list (する, ある, こと...) cost 0.002-0.003 nDCG@10 on
# JSQuAD: BM25's IDF already weighs those down.
STOP_LEMMAS = frozenset("下さる 頂く 致す 御座る 呉れる 貰う".split())
AFFIX_POS = frozenset({"接頭辞", "接尾辞"})
SYMBOL_POS = frozenset({"補助記号", "記号", "空白"})
# What a question says about the answer it wants rather than what it is about (lemmas): left
# out of a question's terms when its sentences are compared with the sources'.
QUESTION_TERMS = frozenset(
    "何 何故 いつ 何時 どこ 何処 誰 幾ら 幾つ 如何 どう どの どれ どんな".split()
    + "教える 下さる 為る 有る 居る 成る 言う 知る 分かる 出来る".split()
    # The grammar of asking: かもしれません (知れる), しないといけませんか (行く), 良いですか.
    + "知れる 行く 良い".split()
    # "The latest" is answered by a document's date (search.selectors), not by its words.
    + "最新 直近 最近".split()
    # How people ask in conversation rather than what they ask about: auxiliaries (なくしてしまい
    # ました: 仕舞う; 欲しい), formal nouns (こと, もの, とき, ほう, ため, よう, はず, わけ) and
    # adverbs of tone (すぐ, ふつう, だいたい, ちょっと, もう, まだ, ついでに, それぞれ).
    + "仕舞う 欲しい 事 物 時 方 為 様 筈 訳 所 序で 直ぐ 普通 大体 一寸 もう 未だ 結構 本当 其々 具体".split()
    # Degree: 最も大きかった, 一番売れた ask for the top one; the answer says 最大, 首位, 1位.
    + "最も 一番".split()
)
# Text goes to MeCab in pieces of at most this many characters: its lattice grows with the
# input, and a document of 100 KB without a line break must not hold it all at once.
PIECE_CHARS = 2000
# Where a piece prefers to end: after a sentence end or a line break, else after a space.
_PIECE_END = re.compile(r"[。！？!?\n]|\s")
# UniDic writes a loanword's lemma with its source word (コンピューター-computer) and tells
# homographs apart after a hyphen (円-助数詞): the word is what comes before.
_LEMMA_GLOSS = re.compile(r"(?<=.)-[^-]+$")

_local = threading.local()


@dataclass(frozen=True)
class Token:
    """A word: ``text[start:end]`` as written; ``term`` what it matches as (its lemma,
    lower-cased), or None for a word that does not rank (a particle, a symbol)."""

    start: int
    end: int
    surface: str
    term: str | None
    # Punctuation, brackets, symbols and spaces: not words at all.
    symbol: bool = False
    # A number with its counter (第1四半期 -> "1四半期", 7億9,800万円 -> "798000000円"), over the
    # words it joins: an extra term, not another word.
    compound: bool = False
    # A prefix or suffix (第, 高 of 売上高): part of a word, telling little of a question's topic.
    affix: bool = False
    # A person's name (UniDic's 固有名詞-人名: 高橋, 健太).
    person: bool = False
    # Any proper noun: a person, a place, an organisation (関西, 東京, 山本).
    proper: bool = False
    # A numeral (2, 500, 億, 万): a number's part, not a word.
    number: bool = False


def _tagger():
    tagger = getattr(_local, "tagger", None)
    if tagger is None:
        import fugashi  # imported on first use: about 0.2 s and 50 MB of dictionary

        tagger = _local.tagger = fugashi.Tagger()
    return tagger


def _pieces(text: str):
    """(offset, piece) of ``text`` cut at sentence ends, line breaks or spaces near
    ``PIECE_CHARS``, or hard at ``PIECE_CHARS`` where there are none."""
    start, length = 0, len(text)
    while start < length:
        end = min(length, start + PIECE_CHARS)
        if end < length:
            window = text[start + PIECE_CHARS // 2 : end]
            cuts = [m.end() for m in _PIECE_END.finditer(window)]
            if cuts:
                end = start + PIECE_CHARS // 2 + cuts[-1]
        yield start, text[start:end]
        start = end


def _term(word) -> str | None:
    feature = word.feature
    if feature.pos1 not in CONTENT_POS or feature.lemma in STOP_LEMMAS:
        return None
    lemma = feature.lemma
    if not lemma or lemma == "*":
        lemma = word.surface  # unknown to the dictionary: an ASCII word, a new name
    else:
        lemma = _LEMMA_GLOSS.sub("", lemma)
    return lemma.lower()


def tokens(text: str) -> list[Token]:
    """Every word of ``text`` with its offsets in ``text``, in order; after a number and its
    counter, their compound (``Token.compound``)."""
    normalised = nfkc_mapped(text)
    tagger = _tagger()
    found: list[Token] = []
    for offset, piece in _pieces(normalised.text):
        position = offset
        words: list[tuple[str, str, str, str]] = []
        read: list[Token] = []  # the words' tokens, as ``words``: compounds are not words
        for word in tagger(piece):
            surface = word.surface
            at = normalised.text.find(surface, position, offset + len(piece))
            if at < 0 or not surface:
                continue
            position = at + len(surface)
            start, end = normalised.span(at, position)
            feature = word.feature
            words.append((surface, feature.pos1, feature.pos2, feature.pos3))
            read.append(
                Token(
                    start,
                    end,
                    text[start:end],
                    _term(word),
                    symbol=feature.pos1 in SYMBOL_POS,
                    affix=feature.pos1 in AFFIX_POS,
                    person=feature.pos2 == "固有名詞" and feature.pos3 == "人名",
                    proper=feature.pos2 == "固有名詞",
                    number=feature.pos2 == "数詞",
                )
            )
            found.append(read[-1])
            compound = _number_compound(words, read)
            if compound is not None:
                found.append(compound)
    return found


_MULTIPLIERS = {"万": 10**4, "億": 10**8, "兆": 10**12}


def _number_compound(words: list[tuple[str, str, str, str]], read: list[Token]) -> Token | None:
    """The compound of a number and the counter just read (``words[-1]``), when it ends one.

    Questions name quarters, years, amounts and durations (2026年度第1四半期, 4時間以内); MeCab
    reads the digits apart (and BM25 drops a single digit), so "第1四半期" matched every
    quarter's report alike. The number is written plainly (7億9,800万 -> 798000000)."""
    _, pos1, pos2, pos3 = words[-1]
    if not _counts(pos1, pos2):
        return None
    # The counter is one word (円, 時間, 年度), or two whose second may count (四半 + 期).
    counter_words = 1
    if len(words) >= 3 and _counts(words[-2][1], words[-2][2]) and pos3 == "助数詞可能":
        counter_words = 2
    end = len(words) - counter_words
    begin = end
    while begin > 0 and (words[begin - 1][2] == "数詞" or (words[begin - 1][0] in ",." and begin > 1)):
        begin -= 1
    parts = [word[0] for word in words[begin:end]]
    if not parts or words[begin][2] != "数詞" or words[end - 1][2] != "数詞":
        return None
    value = _number_value(parts)
    if value is None:
        return None
    joined = read[begin:]
    counter = "".join(word[0] for word in words[end:])
    return Token(joined[0].start, joined[-1].end, "", f"{value}{counter}".lower(), compound=True)


def _counts(pos1: str, pos2: str) -> bool:
    """Whether a word can be (part of) a number's counter: a noun (年度, 時間, 件) or a noun-like
    suffix (日, 人), not another number."""
    return (pos1 == "名詞" and pos2 != "数詞") or (pos1 == "接尾辞" and pos2 == "名詞的")


def _number_value(parts: list[str]) -> str | None:
    """Digits, commas, a decimal point and 万/億/兆 as one number, written plainly; None for a
    number in kanji (三), left as MeCab reads it."""
    total, current = 0, ""
    for part in parts:
        if part in _MULTIPLIERS:
            if not current:
                return None
            total += int(float(current) * _MULTIPLIERS[part])
            current = ""
        elif part == ",":
            continue
        elif part == "." or part.isdigit():
            current += part
        else:
            return None
    if current.endswith(".") or current.count(".") > 1:
        return None
    if not total:
        return current or None
    return str(total + (int(float(current)) if current else 0))


def affixes(text: str) -> set[str]:
    """The terms of ``text`` that are prefixes or suffixes of its words (第, 高)."""
    return {token.term for token in tokens(text) if token.affix and token.term}


# An amount as Japanese writes it, in 万 (10^4), 億 (10^8) and 兆 (10^12): 7億9,800万 is 798,000,000.
_DECIMAL = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
AMOUNT = re.compile(rf"(?<![0-9.,])(?P<amount>(?:(?:{_DECIMAL})[兆億万])+(?:{_DECIMAL})?)(?P<yen>\s?円)?")


def amount_value(amount: str) -> float:
    """The value of ``AMOUNT``'s ``amount`` group (digits, commas, 兆/億/万)."""
    total, current = 0.0, ""
    for char in amount:
        if char in _MULTIPLIERS:
            total += float(current.replace(",", "") or 1) * _MULTIPLIERS[char]
            current = ""
        else:
            current += char
    return total + float(current.replace(",", "") or 0)


def words_beside_numbers(text: str) -> set[str]:
    """The terms of ``text`` that say what its numbers are about: not the numbers, not their
    counters (円, 年, 時間: the words a number compound joins), not affixes or symbols."""
    found = tokens(text)
    compounds = [(token.start, token.end) for token in found if token.compound]
    return {
        token.term
        for token in found
        if token.term
        and not (token.compound or token.number or token.affix or token.symbol)
        and not any(start <= token.start and token.end <= end for start, end in compounds)
    }


def proper_nouns(text: str) -> set[str]:
    """The proper nouns of ``text`` as written, lower-cased: people, places, organisations."""
    return {token.surface.lower() for token in tokens(text) if token.proper}


# Words that name who does something by their role: 上長, 部門長 (長), 作成者 (者), 担当.
ROLE_SUFFIXES = frozenset("者 長 員 係 官".split())
ROLE_NOUNS = frozenset("上長 上司 担当 窓口 社長 部長 課長 係長 室長 役員 本人 管理者 責任者 担当者".split())


def names_someone(text: str) -> bool:
    """Whether ``text`` names a person or a role (高橋 健太, 直属上長, 情報システム担当)."""
    return any(
        token.person or (token.affix and token.surface in ROLE_SUFFIXES) or token.surface in ROLE_NOUNS
        for token in tokens(text)
    )


def terms(text: str) -> list[str]:
    """The ranked words of ``text``, in order, repeats kept."""
    return [token.term for token in tokens(text) if token.term]
