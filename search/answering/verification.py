"""Verified citations: each sentence of a generated answer checked against the passages it was given.

``answer_verify(text, passages, embedding_model=..., text_search_config=...)`` takes an
answer and ``{source number: source text}`` (the sources of its prompt) and returns a
``Verification``: the corrected text, one ``SentenceCheck`` per sentence, and counts.

- A citation naming a number that no passage has is removed from the text (counted in
  ``removed_markers``: one per number removed, ``[2, 9]`` becomes ``[2]``).
- The text is cut into sentences (lines, list items, sentence ends; markers placed after
  the full stop belong to the sentence before them). Each is one of

  ``not_a_claim``   a greeting, a lead-in ("Here is what the sources say:"), a question, a heading;
  ``decline``       it says the sources do not answer ("The sources do not say ...");
  a claim, whose support by each passage is scored (0..1), and then
  ``kept``          a cited passage supports it (support >= ``THRESHOLD``);
  ``reattributed``  no cited passage does, another does by ``MARGIN`` more: its markers
                    are replaced by that passage's number;
  ``added``         it cited nothing and a passage supports it: that citation is appended;
  ``unsupported``   nothing supports it, or it only names sources or titles instead of saying
                    something ("Source 2: travel-and-expenses.md"): withheld from the text;
  ``repeated``      it was said before (a model that loops): withheld.

- The verified text holds the supported claims and, around them, the sentences that are not
  claims; what is withheld is listed in ``withheld``. ``StreamVerifier`` does this sentence by
  sentence while the answer is written, so that a streaming client is shown only what the
  stored answer says (docs/answers.md, "Verified while streaming").
- ``grounded`` is the share of claims that are supported (None without a claim);
  ``declined`` is true when the answer declines and makes no claim.

Support of a claim by a passage (0..1): ``DENSE_WEIGHT`` x the best cosine between the
claim and the passage's sentences (the collection's embedding model; the claims and all
passage sentences in one call) + the rest x the weighted share of the claim's content
lexemes, names and values (numbers, identifiers like "Atlas-7", days, months) that the
passage holds (lexemes of ``text_search_config`` as keyword search makes them, all texts
in one query), less ``VALUE_PENALTY`` x the share of its values and ``NAME_PENALTY`` x the
share of its names that the passage lacks. Without an embedding model, or when it fails,
the lexical part alone decides (``scorer`` says which). ``passages`` should be the text as
the prompt gave it, title line included: a chunk often names its subject only there.
Weights and thresholds: calibrated on ``tests/data/verification_claims.jsonl``;
docs/answers.md ("Verified citations") gives the figures and the reasons.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import cachetools
import numpy as np

from search.analysis import JAPANESE, japanese, language_of
from search.analysis.sentences import JAPANESE_CLOSERS, JAPANESE_SENTENCE_ENDS
from search.answering.prompting import CitationMarker, citation_markers
from search.bm25 import texts_lexemes
from search.embedders import EmbedderError, embedder_get, passage_embeddings

logger = logging.getLogger(__name__)

# Calibrated on tests/data/verification_claims.jsonl (docs/answers.md, "Verified citations").
DENSE_WEIGHT = 0.3
NAME_WEIGHT = 2.0
VALUE_WEIGHT = 4.0
VALUE_PENALTY = 1.0
NAME_PENALTY = 0.2
THRESHOLD = 0.62
MARGIN = 0.05
# The lexical part alone (no embedding model, or it failed).
LEXICAL_THRESHOLD = 0.62
LEXICAL_MARGIN = 0.05

SCORER = "minilm+lexical"
SCORER_LEXICAL = "lexical"

# Words that carry no claim (PostgreSQL's search_english keeps all but 33 stop words): left
# out of a claim's content before its lexemes are taken.
STOP_WORDS = frozenset(
    """a an and are as at be been but by can could did do does for from had has have how i if in into is it its
    may me might must my no not of on or our shall should so such than that the their them then there these
    they this those to us was we were what when where which who whom why will with would you your""".split()
)

# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class SentenceCheck:
    start: int  # character span of the sentence in Verification.text (the corrected text)
    end: int
    citations: list[int]  # source numbers cited by this sentence after verification
    support: float  # support score of the best cited passage (0..1), after verification
    supported: bool
    # "kept" | "reattributed" | "added" | "decline" | "not_a_claim"; "unsupported" where not withheld
    action: str

    def as_dict(self) -> dict:
        return {**asdict(self), "citations": list(self.citations), "support": round(float(self.support), 4)}


@dataclass(frozen=True)
class Verification:
    text: str  # the answer text after verification
    sentences: list[SentenceCheck]
    grounded: float | None  # share of claim sentences that are supported (None without a claim)
    removed_markers: int  # cited numbers that no source has, removed from the text
    reattributed: int
    added: int
    unsupported: int
    declined: bool  # the answer as a whole says that the sources do not answer
    scorer: str = SCORER  # what scored support: "minilm+lexical", or "lexical" without embeddings
    # Sentences left out of ``text``: {position (among the model's sentences), text, action
    # ("unsupported" or "repeated"), citations, support}.
    withheld: list[dict] = field(default_factory=list)

    @classmethod
    def from_dict(cls, record: dict, text: str) -> Verification:
        """The verification ``as_dict`` recorded, for ``text`` (what it verified to)."""
        return cls(
            text=text,
            sentences=[SentenceCheck(**sentence) for sentence in record["sentences"]],
            grounded=record["grounded"],
            removed_markers=record["removed_markers"],
            reattributed=record["reattributed"],
            added=record["added"],
            unsupported=record["unsupported"],
            declined=record["declined"],
            scorer=record["scorer"],
            withheld=list(record.get("withheld", [])),
        )

    def as_dict(self) -> dict:
        return {
            "sentences": [sentence.as_dict() for sentence in self.sentences],
            "withheld": list(self.withheld),
            "grounded": None if self.grounded is None else round(self.grounded, 4),
            "removed_markers": self.removed_markers,
            "reattributed": self.reattributed,
            "added": self.added,
            "unsupported": self.unsupported,
            "declined": self.declined,
            "scorer": self.scorer,
        }


CLAIM_ACTIONS = frozenset({"kept", "reattributed", "added", "unsupported"})

# --------------------------------------------------------------------------- sentences

# A sentence ends at . ! ? or an ellipsis, after closing quotes and brackets and any citation
# markers placed after the full stop ("... in 1889. [2] Then"), before white space.
_CITATION_RUN = r"(?:\s*\[\s*\d[\d\s,;\-\u2013]*\])*"
# Japanese ends a sentence at 。！？ with no space after (search.analysis.sentences says which marks).
_SENTENCE_END = re.compile(
    rf"[.!?\u2026]+[\"'\u201d\u2019)]*{_CITATION_RUN}(?:\s+|$)"
    rf"|[{re.escape(JAPANESE_SENTENCE_ENDS)}]+[{re.escape(JAPANESE_CLOSERS)}]*{_CITATION_RUN}\s*"
)
_LIST_PREFIX = re.compile(r"[ \t]*(?:[-*+\u2022\u2013]|\d{1,3}[.)]|[a-z][.)])[ \t]+")
# Words after which a full stop does not end a sentence ("No." and "Nr." only before a number;
# "etc." and "min." end sentences as often as not, so they are left out).
_ABBREVIATIONS = frozenset("e.g i.e eg ie dr mr mrs ms prof st vs approx incl cf fig".split())
_ABBREVIATIONS_BEFORE_NUMBERS = frozenset({"no", "nr"})
_TRAILING_PUNCTUATION = re.compile(r"[.!?\u2026:;]+[\"'\u201d\u2019)]*$")


@dataclass
class _Sentence:
    start: int  # span in the text after invalid markers were removed
    end: int
    list_item: bool
    lead_in: str = ""  # the line ending in ":" that this list item continues
    markers: list[CitationMarker] = field(default_factory=list)  # relative to start


def _sentence_spans(text: str) -> list[_Sentence]:
    """The sentences of an answer: each line (list markers left out of the span) cut at
    sentence ends; markers after a full stop stay with the sentence they follow."""
    sentences: list[_Sentence] = []
    lead_in = ""
    for line in re.finditer(r"[^\n]+", text):
        prefix = _LIST_PREFIX.match(line.group())
        list_item = prefix is not None
        begin = line.start() + (prefix.end() if prefix else 0)
        pieces: list[list[int]] = []
        cut = begin
        for end in _SENTENCE_END.finditer(text, begin, line.end()):
            before = text[cut : end.start()].rsplit(None, 1)
            word = before[-1].lower().rstrip(".") if before else ""
            following = text[end.end() : end.end() + 1]
            if (
                word in _ABBREVIATIONS
                or (word in _ABBREVIATIONS_BEFORE_NUMBERS and following.isdigit())
                or (len(word) == 1 and word.isalpha())  # an initial: "J. Smith"
                or following.islower()
            ):
                continue
            pieces.append([cut, end.end()])
            cut = end.end()
        pieces.append([cut, line.end()])
        line_sentences: list[_Sentence] = []
        for start, end in pieces:
            piece = text[start:end]
            start += len(piece) - len(piece.lstrip())
            end -= len(piece) - len(piece.rstrip())
            if end <= start:
                continue
            if line_sentences and not _strip_markers(text[start:end]).strip():
                line_sentences[-1].end = end  # "... in 1889. [2]": the markers of the sentence before
                continue
            line_sentences.append(_Sentence(start, end, list_item, lead_in if list_item else ""))
        sentences.extend(line_sentences)
        if not list_item:
            lead_in = _lead_in(line.group())
    for sentence in sentences:
        sentence.markers = citation_markers(text[sentence.start : sentence.end])
    return sentences


def _lead_in(line: str) -> str:
    """The last sentence of a line ending in ":" that introduces the list below it ("Every
    employee receives:"); none for a line that only announces the answer ("Here is what
    the sources say:")."""
    last = _plain(_strip_markers(line)).rstrip()
    if not last.endswith(":"):
        return ""
    last = re.split(r"(?<=[.!?])\s+", last)[-1]
    return "" if _FILLER.match(last) or _SOURCE_WORDS.search(last) else last


def _strip_markers(text: str) -> str:
    return _remove_spans(text, [(m.start, m.end) for m in citation_markers(text)])


def _plain(text: str) -> str:
    """A sentence as it is scored: Markdown emphasis and backticks out, spaces collapsed."""
    text = re.sub(r"[*_`]{1,3}", "", text)
    return " ".join(text.split())


# --------------------------------------------------------------------------- editing markers


def _remove_spans(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """``text`` without ``spans`` (markers), leaving no doubled or dangling spaces: the space
    before a marker goes with it unless a word follows right after."""
    for start, end in sorted(spans, reverse=True):
        left = start
        while left > 0 and text[left - 1] in " \t":
            left -= 1
        following = text[end : end + 1]
        if left < start and not following.isalnum():
            start = left
        elif left == start and (start == 0 or text[start - 1] == "\n"):
            while end < len(text) and text[end] in " \t":
                end += 1
        text = text[:start] + text[end:]
        # "claim ([9])." would leave "claim ()." behind.
        empty = re.compile(r"[ \t]*\([ \t]*\)").search(text, max(start - 16, 0), start + 16)
        if empty and empty.start() <= start <= empty.end():
            text = text[: empty.start()] + text[empty.end() :]
    return text


def _marker_text(numbers: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, numbers)) + "]"


def _drop_unknown(text: str, known: set[int]) -> tuple[str, int]:
    """Markers naming numbers that no passage has: those numbers removed (the marker too when
    nothing is left). Returns the text and how many numbers were removed."""
    removed = 0
    for marker in reversed(citation_markers(text)):
        valid = [number for number in marker.numbers if number in known]
        unknown = len(marker.numbers) - len(valid)
        if not unknown:
            continue
        removed += unknown
        if valid:
            text = text[: marker.start] + _marker_text(valid) + text[marker.end :]
        else:
            text = _remove_spans(text, [(marker.start, marker.end)])
    return text, removed


def _with_citation(sentence: str, markers: Sequence[CitationMarker], number: int) -> str:
    """``sentence`` citing ``number`` only: its markers replaced by one at the first one's
    place, or, without markers, one added before the closing punctuation."""
    if markers:
        first = markers[0]
        rest = _remove_spans(sentence[first.end :], [(m.start - first.end, m.end - first.end) for m in markers[1:]])
        return sentence[: first.start] + f"[{number}]" + rest
    tail = _TRAILING_PUNCTUATION.search(sentence)
    cut = tail.start() if tail else len(sentence)
    return sentence[:cut].rstrip() + f" [{number}]" + sentence[cut:]


# --------------------------------------------------------------------------- kinds of sentence

_DECLINES = [
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"\b(sources?|documents?|passages?|context|excerpts?|provided (text|information|material))\b[^.]{0,60}?"
        r"\b(do|does|did)\s*(n[o']t|not)\s+(say|state|contain|mention|specify|include|provide|cover|answer|"
        r"address|describe|give|list|indicate|explain|discuss|offer|have)\b",
        r"\bnot\s+(mentioned|specified|stated|covered|addressed|included|provided|given|found|described|"
        r"available|discussed|listed)\s+(in|by)\s+(any of\s+)?(the\s+)?(provided\s+|given\s+|available\s+)?"
        r"(sources?|documents?|passages?|context|excerpts?)",
        r"\b(i|we)\s+(could|can|was|were|am)\s*(n[o']t|not|unable to)\s+(find|locate|determine|answer|tell|see)",
        r"\b(i|we)\s+(do|did)\s*(n[o']t|not)\s+(know|find|have (enough |any )?information)",
        r"\b(unable|not able)\s+to\s+(find|answer|determine|tell)",
        r"\bnone of the (provided |given )?(sources|documents|passages|excerpts)\b",
        r"\bno (information|mention|details?|data|answer)\b[^.]{0,40}?\b(in|from) the (provided |given )?"
        r"(sources?|documents?|passages?|context)",
        r"\b(sources?|documents?|passages?)\s+(are silent|say nothing|contain no|hold no|give no|provide no)\b",
        r"^there is no (information|mention)\b",
        r"\bis not (in|part of|contained in|covered by) (any of )?the (provided |given )?"
        r"(sources?|documents?|passages?|context|excerpts?)",
    )
]
_FILLER = re.compile(
    r"^(i hope|hope this|let me know|feel free|happy to help|glad to help|great question|good question|"
    r"sure\b|certainly\b|of course\b|hi\b|hello\b|thanks\b|thank you|you're welcome|in summary:?$|"
    r"(here is|here's|here are|below is|below are)\b)",
    re.IGNORECASE,
)
_SOURCE_LABEL = re.compile(r"^(sources?|references?|citations?|documents?|see( also)?)\b\s*(\[?\d|:|-|\u2013)", re.I)
_FILE_NAME = re.compile(r"\b[\w.-]+\.(?:md|txt|html?|pdf|docx?|pptx?|xlsx?|csv|json)\b", re.IGNORECASE)
_SOURCE_WORDS = re.compile(r"\b(sources?|documents?|passages?|context|excerpts?)\b", re.IGNORECASE)
_DOCUMENT_WORDS = frozenset(
    """guide guides policy policies handbook handbooks faq faqs document documents doc docs file files manual
    source sources page pages section sections chapter readme notes article wiki""".split()
)
_WORD = re.compile(r"\w+(?:['\u2019.-]\w+)*")


def _title_words(passage: str) -> set[str]:
    first = passage.strip().split("\n", 1)[0]
    words = {w.lower() for w in _WORD.findall(_FILE_NAME.sub(lambda m: m.group().rsplit(".", 1)[0], first))}
    words |= {part for w in words for part in re.split(r"[-_.]", w) if part}
    return words - STOP_WORDS if len(first) <= 120 else set()


def _is_decline(plain: str) -> bool:
    return any(pattern.search(plain) for pattern in _DECLINES)


def _is_filler(plain: str) -> bool:
    """A greeting, a lead-in, a question: nothing to check."""
    words = _WORD.findall(plain)
    if plain.endswith("?") or not words:
        return True
    if plain.endswith(":") and not re.search(r"\d", plain):  # a lead-in to a list
        return True
    return bool(_FILLER.match(plain)) and len(words) <= 14 and not re.search(r"\d", plain)


def _names_sources(plain: str) -> bool:
    """Only a label of sources or file names: "Source 2: travel-and-expenses.md"."""
    if _SOURCE_LABEL.match(plain):
        return True
    if not _FILE_NAME.search(plain):
        return False
    rest = _WORD.findall(_FILE_NAME.sub(" ", plain))
    return len([w for w in rest if w.lower() not in STOP_WORDS and w.lower() not in _DOCUMENT_WORDS]) < 3


def _is_title(plain: str, has_marker: bool, lead_in: str, titles: Sequence[set[str]]) -> bool:
    """A bare title or document name instead of a statement ("[9] onboarding guide",
    "Travel and Expenses Policy [1]"): small models answer with what they read, not what it
    says. A short list item under a lead-in ("Created automatically: - Slack [1]") is a
    claim, unless it is the title of a passage."""
    words = _WORD.findall(plain)
    content = [w.lower() for w in words if w.lower() not in STOP_WORDS]
    if not content or len(words) > 12:
        return False
    if any(set(content) <= title for title in titles):
        return True
    if lead_in or len(words) > 8 or re.search(r"\d", plain) or plain.endswith((".", "!")):
        return False
    if any(word in _DOCUMENT_WORDS for word in content):
        return True
    # "Travel and Expenses Policy": every content word capitalised (one alone only if cited).
    capitalised = all(w[:1].isupper() for w in words if w.lower() not in STOP_WORDS)
    return capitalised and (len(content) >= 2 or has_marker)


# --------------------------------------------------------------------------- evidence

# Number words, from two: "one" is as often a pronoun ("not the default one") as a number.
_NUMBER_WORDS = {
    word: str(value)
    for value, word in enumerate(
        """two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
        seventeen eighteen nineteen twenty""".split(),
        start=2,
    )
} | {"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "ninety": "90", "hundred": "100"}
# A clock time, else a number with thousands separators and decimals, or joined to others by
# hyphens or slashes ("3691-4", "2006/42": one identifier, in which "4" is no count); not
# inside a word ("SEV1", "LiFePO4") nor joined to one ("Atlas-7"): those are names.
_NUMBER = re.compile(
    r"(?<![A-Za-z\d.])(?<!\w-)(?:\d{1,2}:\d{2}(?![\d:])|\d+(?:,\d{3})*(?:\.\d+)?(?:[-/]\d+(?:\.\d+)?)*)"
)
# Section and list numbers at the start of a line ("5. Data classification") say nothing.
_LINE_NUMBER = re.compile(r"(?m)^[ \t]*(?:\d{1,2}(?:\.\d{1,2})*[.)])+[ \t]+")
_NUMBER_WORD = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)
_DAYS_AND_MONTHS = frozenset(
    """monday tuesday wednesday thursday friday saturday sunday january february march april june july august
    september october november december""".split()
)
_IDENTIFIER = re.compile(r"(?<![\w#@.-])(?=[\w.-]*\d)(?=[\w.-]*[A-Za-z])\w+(?:[.-]\w+)*")
# Not identifiers: a number and its unit or suffix ("3-year", "14-inch", "20th", "1990s").
_NUMBER_COMPOUND = re.compile(r"\d+(?:[.,]\d+)?(?:-?[a-z]+)+|\d+(?:st|nd|rd|th|s)", re.IGNORECASE)


def _values(text: str) -> set[str]:
    """What a claim must get exactly right: its numbers, normalised ("3,000" = "3000",
    "2.0" = "2", "09:00" = "9:00", "seven" = "7"), identifiers with digits ("Atlas-7",
    "SEV1", "WPA2") and names of days and months."""
    text = _LINE_NUMBER.sub(" ", _fold(text))
    found = set()
    # A Japanese amount is one value (2億500万円: 205000000), not its pieces (2, 500). Its
    # other numbers are read as English ones: with their counters (5回 against 5拠点) a claim
    # that words a count otherwise would lose it, and measured on the Japanese labelled set
    # that cost more than it caught (docs/answers.md, "Verified citations").
    for match in japanese.AMOUNT.finditer(text):
        found.add(_plain_number(japanese.amount_value(match.group("amount"))))
    text = japanese.AMOUNT.sub(" ", text)
    for match in _NUMBER.finditer(text):
        token = match.group()
        if ":" in token:
            hours, minutes = token.split(":")
            found.add(f"{int(hours)}:{minutes}")
            continue
        token = token.replace(",", "")
        if "." in token and not re.search(r"[-/]", token):
            token = token.rstrip("0").rstrip(".")
        found.add(token.lstrip("0") or "0")
    found.update(_NUMBER_WORDS[match.group().lower()] for match in _NUMBER_WORD.finditer(text))
    found.update(
        match.group().lower() for match in _IDENTIFIER.finditer(text) if not _NUMBER_COMPOUND.fullmatch(match.group())
    )
    for match in re.finditer(r"\b[A-Z][a-z]+\b", text):
        word = match.group().lower()
        if word in _DAYS_AND_MONTHS or word.removesuffix("s") in _DAYS_AND_MONTHS:
            found.add(word.removesuffix("s") if word not in _DAYS_AND_MONTHS else word)
    # "May" is a month only next to a day or a year ("10 May 2024").
    found.update("may" for _ in re.finditer(r"\d\s+May\b|\bMay\s+\d", text))
    return found


def _plain_number(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _is_japanese(text: str) -> bool:
    return language_of(text) == JAPANESE


def _tokens(text: str) -> set[str]:
    """Words as written (lower-cased, possessives cut), for matching names; a Japanese text's
    are its morphemes (a run of kanji is not one word)."""
    found = {_possessive_cut(word.lower()) for word in re.findall(r"#?\w+(?:['\u2019.-]\w+)*", _fold(text))}
    if _is_japanese(text):
        found |= {token.surface.lower() for token in japanese.tokens(_fold(text)) if not token.symbol}
    return found


def _possessive_cut(word: str) -> str:
    return re.sub(r"['\u2019]s$", "", word)


# Kana and kanji (and half-width katakana): a word holding any is not read by capitals.
_KANA_OR_KANJI = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff\uff66-\uff9f]")


def _names(text: str) -> set[str]:
    """Names: capitalised words past the first word of a sentence, words with capitals
    inside ("TravelDesk", "LastPass"), channel names ("#finance-help"). Identifiers with
    digits are values (``_values``), not names."""
    names = set()
    text = _fold(text)
    if _is_japanese(text):
        # Japanese has no capitals: UniDic's proper nouns (山本, 関西, 東京) are the names.
        names |= japanese.proper_nouns(text)
    for sentence in re.split(r"(?<=[.!?:])\s+|\n+", text):
        for index, match in enumerate(re.finditer(r"#?\w+(?:['\u2019.-]\w+)*", sentence)):
            word = match.group()
            if any(c.isdigit() for c in word):
                continue
            lower = _possessive_cut(word.lower())
            if lower in _DAYS_AND_MONTHS or lower.removesuffix("s") in _DAYS_AND_MONTHS:
                continue
            if _KANA_OR_KANJI.search(word):
                continue  # a run of kanji and kana after "C社": Japanese names come from its analysis
            if word.startswith("#") or any(c.isupper() for c in word[1:]):
                names.add(lower)
            elif index > 0 and word[:1].isupper() and lower not in STOP_WORDS:
                names.add(lower)
    return names


def _fold(text: str) -> str:
    """Unicode compatibility forms folded ("ﬁ", non-breaking spaces), accents kept."""
    return unicodedata.normalize("NFKC", text)


def _content(text: str) -> str:
    """``text`` without ``STOP_WORDS`` (a wider list than the configuration's): what is left
    is what a claim says."""
    return " ".join(w for w in _WORD.findall(_fold(text)) if w.lower() not in STOP_WORDS)


@dataclass(frozen=True)
class _Evidence:
    """What a text says, as compared: its lexemes (numbers left out: they are values), names
    and values, and its words as written (a claim's names are looked up there)."""

    lexemes: frozenset[str]
    names: frozenset[str]
    values: frozenset[str]
    tokens: frozenset[str]
    # A claim's: its words (``_fallback_terms``, numbers left out) and values. A passage's:
    # for each value, the terms of the units (sentences, lines, table rows) that hold it.
    terms: frozenset[str] = frozenset()
    value_terms: dict[str, frozenset[str]] = field(default_factory=dict)


def _fallback_terms(text: str) -> set[str]:
    """Without a text-search configuration: lower-cased words on their first five letters."""
    return {word[:5] for word in re.findall(r"\w+", text.lower()) if word not in STOP_WORDS and len(word) > 1}


def _lexemes(texts: list[str], config: str | None) -> list[set[str]]:
    """Each text's lexemes under a text-search configuration, as keyword search analyses
    text (``search_tsvector``), all texts in one query."""
    if not config:
        return [_fallback_terms(text) for text in texts]
    return [set(row) for row in texts_lexemes(texts, config)]


def _unit_terms(text: str) -> frozenset[str]:
    """The words a value stands beside, and the values: a Japanese text's words are its lemmas
    less numbers and their counters (円 beside every amount says nothing of whose it is)."""
    if _is_japanese(text):
        return frozenset(japanese.words_beside_numbers(_fold(text))) | _values(text)
    return frozenset(term for term in _fallback_terms(text) if not term.isdigit()) | _values(text)


def _value_terms(units: list[str]) -> dict[str, frozenset[str]]:
    """For each value of a passage, the terms of its ``units`` that hold it: a value is stated
    of what stands beside it (a table row, a list item, a sentence), not of the whole passage."""
    found: dict[str, set[str]] = {}
    for unit in units:
        terms = _unit_terms(unit)
        for value in _values(unit):
            found.setdefault(value, set()).update(terms)
    return {value: frozenset(terms - {value}) for value, terms in found.items()}


def _evidence(
    texts: list[str], content_texts: list[str], config: str | None, *, claims: int = 0, units: list[list[str]] = ()
) -> list[_Evidence]:
    """The first ``claims`` texts are claims (their terms kept), the rest passages (the
    context of each of their values kept, from their ``units``: ``passage_units``)."""
    lexeme_sets = _lexemes(content_texts, config)
    return [
        _Evidence(
            lexemes=frozenset(lexeme for lexeme in lexemes if not lexeme.isdigit()),
            names=frozenset(_names(text)),
            values=frozenset(_values(text)),
            tokens=frozenset(_tokens(text)),
            terms=_unit_terms(text) if index < claims else frozenset(),
            value_terms=_value_terms(units[index - claims]) if index >= claims else {},
        )
        for index, (text, lexemes) in enumerate(zip(texts, lexeme_sets, strict=True))
    ]


@dataclass(frozen=True)
class Overlap:
    """How much of a claim a passage holds: the claim's lexemes, names and values, and how
    many of each the passage has too."""

    words: int
    words_found: int
    names: int
    names_found: int
    values: int
    values_found: int

    def coverage(self, name_weight: float = NAME_WEIGHT, value_weight: float = VALUE_WEIGHT) -> float:
        total = self.words + name_weight * self.names + value_weight * self.values
        if not total:
            return 0.0
        return (self.words_found + name_weight * self.names_found + value_weight * self.values_found) / total

    def values_missing(self) -> float:
        return (self.values - self.values_found) / self.values if self.values else 0.0

    def names_missing(self) -> float:
        return (self.names - self.names_found) / self.names if self.names else 0.0


def _value_found(value: str, claim: _Evidence, passage: _Evidence) -> bool:
    """The passage states ``value`` of what the claim says: a unit holding it shares another
    of the claim's terms. "The per-diem in Zürich is €28" read from the row "Germany | €52 |
    €28" is not found, though the passage holds "28". A claim with nothing but the value, or
    a value the passage's units do not show (split differently), is found by presence alone."""
    if value not in passage.values:
        return False
    context = passage.value_terms.get(value)
    others = claim.terms - {value}
    return context is None or not others or bool(others & context)


def _overlap(claim: _Evidence, passage: _Evidence) -> Overlap:
    return Overlap(
        words=len(claim.lexemes),
        words_found=len(claim.lexemes & passage.lexemes),
        names=len(claim.names),
        names_found=sum(1 for name in claim.names if name in passage.tokens or name in passage.names),
        values=len(claim.values),
        values_found=sum(1 for value in claim.values if _value_found(value, claim, passage)),
    )


def _union(evidence: Sequence[_Evidence]) -> _Evidence:
    value_terms: dict[str, frozenset[str]] = {}
    for e in evidence:
        for value, terms in e.value_terms.items():
            value_terms[value] = value_terms.get(value, frozenset()) | terms
    return _Evidence(
        lexemes=frozenset().union(*(e.lexemes for e in evidence)),
        names=frozenset().union(*(e.names for e in evidence)),
        values=frozenset().union(*(e.values for e in evidence)),
        tokens=frozenset().union(*(e.tokens for e in evidence)),
        terms=frozenset().union(*(e.terms for e in evidence)),
        value_terms=value_terms,
    )


def support_score(
    dense: float | None,
    overlap: Overlap,
    *,
    dense_weight: float = DENSE_WEIGHT,
    name_weight: float = NAME_WEIGHT,
    value_weight: float = VALUE_WEIGHT,
    value_penalty: float = VALUE_PENALTY,
    name_penalty: float = NAME_PENALTY,
) -> float:
    """Support of a claim by a passage, 0..1: the cosine part (when there is one) and the
    lexical part, less the share of the claim's values (numbers) and names the passage lacks."""
    lexical = overlap.coverage(name_weight, value_weight)
    score = lexical if dense is None else dense_weight * max(dense, 0.0) + (1 - dense_weight) * lexical
    score -= value_penalty * overlap.values_missing() + name_penalty * overlap.names_missing()
    return float(min(max(score, 0.0), 1.0))


def passage_units(text: str) -> list[str]:
    """A passage's sentences (and lines: list items, table rows), each embedded on its own;
    a claim is compared with the closest one."""
    units = []
    for line in text.splitlines():
        line = _plain(line.strip().strip("|").replace("|", " "))
        if not re.search(r"\w", line):
            continue
        cut = 0
        for end in _SENTENCE_END.finditer(line):
            units.append(line[cut : end.end()].strip())
            cut = end.end()
        units.append(line[cut:].strip())
    return [unit for unit in units if len(_WORD.findall(unit)) >= 2] or [_plain(text)]


@dataclass(frozen=True)
class SupportTable:
    """The features of each (claim, passage) pair: the best cosine between the claim and
    the passage's sentences (``dense``, None without embeddings) and the lexical overlap."""

    dense: np.ndarray | None  # claims x passages
    overlaps: list[list[Overlap]]
    claims: list[_Evidence]
    passages: list[_Evidence]

    def score(self, claim: int, passage: int) -> float:
        dense = None if self.dense is None else float(self.dense[claim, passage])
        return support_score(dense, self.overlaps[claim][passage])

    def score_together(self, claim: int, passages: Sequence[int]) -> float:
        """Support by several cited passages at once: a sentence may join facts of two."""
        if len(passages) == 1:
            return self.score(claim, passages[0])
        dense = None if self.dense is None else float(self.dense[claim, list(passages)].max())
        return support_score(dense, _overlap(self.claims[claim], _union([self.passages[p] for p in passages])))


class PassageSet:
    """The passages an answer was given, analysed once (their sentences' lexemes, names,
    values and embeddings), against which claims are scored as they come (``table``). The
    passages are analysed with the first claims: one lexeme query for both."""

    def __init__(self, passages: list[str], *, embedding_model: str | None, text_search_config: str | None):
        self.texts = passages
        self.embedding_model = embedding_model
        self.text_search_config = text_search_config
        self.read = [_passage_read_get(text, text_search_config) for text in passages]
        self.units = [
            read.units if read else passage_units(text) for read, text in zip(self.read, passages, strict=True)
        ]
        self.owner = np.array([index for index, group in enumerate(self.units) for _ in group], dtype=np.int64)
        self.evidence: list[_Evidence] | None = None
        self.vectors: np.ndarray | None = None  # each passage sentence's, normalised
        self.embeddings_failed = not embedding_model

    def table(self, claims: list[str]) -> SupportTable:
        """The claims scored against every passage: one lexeme query (the passages' too, the
        first time), one embedding call per claim (and one for the passages' sentences not
        cached yet, the first time)."""
        if not claims or not self.texts:
            return SupportTable(dense=None, overlaps=[[] for _ in claims], claims=[], passages=[])
        contents = [_content(text) for text in claims]
        if self.evidence is None:
            unread = [index for index, read in enumerate(self.read) if read is None]
            texts = [self.texts[index] for index in unread]
            evidence = _evidence(
                claims + texts,
                contents + texts,
                self.text_search_config,
                claims=len(claims),
                units=[self.units[index] for index in unread],
            )
            claim_evidence = evidence[: len(claims)]
            for index, found in zip(unread, evidence[len(claims) :], strict=True):
                self.read[index] = _PassageRead(units=self.units[index], evidence=found)
                _passage_read_put(self.texts[index], self.text_search_config, self.read[index])
            self.evidence = [read.evidence for read in self.read]
        else:
            claim_evidence = _evidence(claims, contents, self.text_search_config, claims=len(claims))
        return SupportTable(
            dense=self._dense(claims),
            overlaps=[[_overlap(c, p) for p in self.evidence] for c in claim_evidence],
            claims=claim_evidence,
            passages=self.evidence,
        )

    def _dense(self, claims: list[str]) -> np.ndarray | None:
        """Claims x passages: the best cosine between each claim and each passage's sentences."""
        if self.embeddings_failed:
            return None
        try:
            # One claim at a time: a batch pads its texts to the longest, and its vectors differ from
            # a lone text's in the fourth decimal. A claim's score must not depend on which others
            # its piece of the stream completed with it: the same answer verifies the same way
            # however it arrives.
            embedder = embedder_get(self.embedding_model)
            vectors = _normalised(np.concatenate([embedder.embed_documents([claim]) for claim in claims]))
            if self.vectors is None:
                self.vectors = _unit_vectors(self.embedding_model, [unit for group in self.units for unit in group])
        except (EmbedderError, OSError, RuntimeError, ValueError) as exc:
            logger.warning("citations verified without embeddings (%s)", exc)
            self.embeddings_failed = True
            return None
        cosines = self.vectors @ vectors.T  # passage sentences x claims
        by_passage = np.full((len(self.texts), len(claims)), -1.0, dtype=np.float32)
        np.maximum.at(by_passage, self.owner, cosines)  # each passage's best sentence, per claim
        return by_passage.T


# Passages recur from answer to answer (a collection's most asked-about chunks): what was read
# from a passage's text, and its sentences' vectors, are kept in the process, bounded, in
# front of the vectors' Redis cache (``passage_embeddings``). Both are functions of the text
# alone (and of the configuration or model named in the key): a passage changed is a new key.
PASSAGES_READ_KEPT = 2048
UNIT_VECTORS_KEPT = 8192


@dataclass(frozen=True)
class _PassageRead:
    units: list[str]
    evidence: _Evidence


_passages_read: cachetools.LRUCache = cachetools.LRUCache(PASSAGES_READ_KEPT)
_unit_vectors_kept: cachetools.LRUCache = cachetools.LRUCache(UNIT_VECTORS_KEPT)
_kept_lock = threading.Lock()  # the remote worker verifies in threads; an LRU's reads reorder it


def passages_forget() -> None:
    """Forget what this process kept of passages (for a measurement from cold)."""
    with _kept_lock:
        _passages_read.clear()
        _unit_vectors_kept.clear()


def _passage_read_get(text: str, config: str | None) -> _PassageRead | None:
    with _kept_lock:
        return _passages_read.get((config, text))


def _passage_read_put(text: str, config: str | None, read: _PassageRead) -> None:
    with _kept_lock:
        _passages_read[(config, text)] = read


def _unit_vectors(model: str, units: list[str]) -> np.ndarray:
    """The normalised vectors of passage sentences: kept in the process, else from Redis or
    the model (``passage_embeddings``, which caches them in Redis)."""
    with _kept_lock:
        vectors = [_unit_vectors_kept.get((model, unit)) for unit in units]
    missing = [index for index, vector in enumerate(vectors) if vector is None]
    if missing:
        found = _normalised(passage_embeddings(model, [units[index] for index in missing]))
        with _kept_lock:
            for index, vector in zip(missing, found, strict=True):
                vectors[index] = _unit_vectors_kept[(model, units[index])] = vector
    return np.stack(vectors) if vectors else np.zeros((0, embedder_get(model).dimensions), dtype=np.float32)


def _normalised(vectors) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms == 0, 1.0, norms)


def support_table(
    claims: list[str], passages: list[str], *, embedding_model: str | None, text_search_config: str | None
) -> SupportTable:
    """Claims scored against passages, all at once (``PassageSet.table``)."""
    if not claims:
        return SupportTable(dense=None, overlaps=[], claims=[], passages=[])
    return PassageSet(passages, embedding_model=embedding_model, text_search_config=text_search_config).table(claims)


# --------------------------------------------------------------------------- verification


def answer_verify(
    text: str,
    passages: dict[int, str],
    *,
    embedding_model: str | None,
    text_search_config: str | None = None,
    withhold: bool = True,
) -> Verification:
    """Check every sentence of ``text`` against the ``passages`` its prompt gave (numbered as
    in the prompt) and correct its citations (see the module's docstring): the whole text at
    once, as ``StreamVerifier`` checks it piece by piece."""
    verifier = StreamVerifier(
        passages, embedding_model=embedding_model, text_search_config=text_search_config, withhold=withhold
    )
    verifier.finish(text)  # every sentence decided at once: one lexeme query, one embedding call
    return verifier.result()


@dataclass
class _Decided:
    """A sentence checked, waiting to be written into the verified text."""

    gap: str  # what stood between it and the sentence before it (spaces, a line break, a list marker)
    text: str  # the sentence as verified (its citations corrected)
    citations: list[int]
    support: float
    action: str


# What the start of a citation marker looks like before it is closed: "[", "[1", "[1, 2".
_MARKER_START = re.compile(r"\s*\[[\d\s,;\-\u2013]*")


class StreamVerifier:
    """An answer checked sentence by sentence while it is written.

    ``feed(delta)`` takes the model's next piece of text and returns the verified text that
    can be shown from it: a sentence is checked once it is complete (the next one has begun,
    so that the markers after its full stop are known), and then

    - a supported claim (``kept``, ``reattributed``, ``added``) is shown with its citations
      corrected, after whatever was held back before it;
    - an unsupported claim, a bare listing of sources, or a sentence said again is withheld:
      it never enters the text (``withheld`` keeps it, with why);
    - a sentence that is not a claim (a lead-in, a decline) is shown once a supported claim
      has been, and held back until then: an answer that supports nothing is replaced as a
      whole when it is stored (declined, or the sources quoted instead).

    With ``withhold=False`` (a route that does not abstain: its model answers whatever was
    found) an unsupported claim is shown too, flagged, and nothing is held back; citations are
    corrected all the same.

    ``finish()`` checks the last sentence and returns the rest; ``result()`` is the
    ``Verification``, whose ``text`` starts with everything ``feed`` and ``finish`` returned:
    the text a streaming client assembled is the stored answer's. Each sentence is decided
    once, from itself, its lead-in and the passages, so the order of arrival changes nothing.
    """

    def __init__(
        self,
        passages: dict[int, str],
        *,
        embedding_model: str | None,
        text_search_config: str | None = None,
        withhold: bool = True,
    ):
        self.withhold = withhold
        self.numbers = sorted(passages)
        self.column = {number: index for index, number in enumerate(self.numbers)}
        # The words of each passage's first line: its title as the prompt gives it.
        self.titles = [_title_words(passages[number]) for number in self.numbers]
        self.passages = PassageSet(
            [passages[number] for number in self.numbers],
            embedding_model=embedding_model,
            text_search_config=text_search_config,
        )
        self.embedding_model = embedding_model
        self.raw = ""
        self.decided = 0  # sentences of the text so far already decided
        self.finished = False
        self.shown: list[str] = []  # the verified text so far, piece by piece
        self.length = 0
        self.held: list[_Decided] = []  # not claims, before the first supported one
        self.checks: list[SentenceCheck] = []
        self.withheld: list[dict] = []
        self.kinds: list[str] = []
        self.seen: set[str] = set()  # the sentences said so far, as compared
        self.supported = 0
        self.lexical_only = not embedding_model

    # ------------------------------------------------------------------ reading

    def feed(self, delta: str) -> str:
        """Take the next piece of the model's text; returns the verified text it completes."""
        if self.finished:
            raise RuntimeError("the answer was finished")
        self.raw += delta
        return self._decide(final=False)

    def finish(self, delta: str = "") -> str:
        """The model's text is complete (``delta``: its last piece): the last sentences
        checked; returns the rest shown."""
        if self.finished:
            return ""
        self.raw += delta
        shown = self._decide(final=True)
        self.finished = True
        if self.supported:
            shown += self._release_held()
        return shown

    def _decide(self, *, final: bool) -> str:
        text, _ = _drop_unknown(self.raw, set(self.numbers))
        sentences = _sentence_spans(text)
        # The last sentence of an unfinished text may still grow, or gain the markers after its
        # full stop; and while the last piece could still become a marker ("[", "[1"), so may
        # the one before it.
        complete = len(sentences)
        if not final:
            complete -= 1
            if sentences and _MARKER_START.fullmatch(_strip_markers(text[sentences[-1].start : sentences[-1].end])):
                complete -= 1
        # Every sentence completed by this piece classified first, their claims scored together.
        kinds = []
        for index in range(self.decided, complete):
            sentence = sentences[index]
            kinds.append(self._kind(text[sentence.start : sentence.end], sentence))
        claims = [claim for kind, claim in kinds if kind == "claim"]
        table = self.passages.table(claims)
        shown, claim = [], 0
        for index, (kind, _) in zip(range(self.decided, complete), kinds, strict=True):
            before = sentences[index - 1].end if index else 0
            sentence = sentences[index]
            decided = self._check(text, sentence, text[before : sentence.start], kind, table, claim)
            claim += kind == "claim"
            shown.append(self._place(decided, index))
        self.decided = max(self.decided, complete)
        return "".join(shown)

    # ------------------------------------------------------------------ one sentence

    def _kind(self, raw: str, sentence: _Sentence) -> tuple[str, str]:
        """What the sentence is (``claim``, ``decline``, ``listing``, ``not_a_claim``,
        ``repeated``) and, for a claim, what is scored (its lead-in before it)."""
        plain = _plain(_strip_markers(raw))
        key = plain.lower()
        if key and key in self.seen:
            return "repeated", ""  # a model that loops says it again: once is enough
        self.seen.add(key)
        if not re.search(r"\w", plain):
            return ("listing" if sentence.markers else "not_a_claim"), ""
        if _is_decline(plain):
            return "decline", ""
        if _names_sources(plain):
            return "listing", ""
        if _is_filler(plain) or raw.lstrip().startswith("#"):
            return "not_a_claim", ""
        if _is_title(plain, bool(sentence.markers), sentence.lead_in, self.titles):
            return "listing", ""
        # A list item under "Every employee receives:" says something only with its lead-in.
        return "claim", (f"{sentence.lead_in} {plain}".strip() if sentence.lead_in else plain)

    def _check(self, text: str, sentence: _Sentence, gap: str, kind: str, table: SupportTable, claim: int) -> _Decided:
        raw = text[sentence.start : sentence.end]
        self.kinds.append(kind)
        cited = list(dict.fromkeys(n for m in sentence.markers for n in m.numbers if n in self.column))
        if kind == "listing":
            return _Decided(gap, raw, cited, 0.0, "unsupported")
        if kind != "claim":
            return _Decided(gap, raw, cited, 0.0, kind)
        lexical = table.dense is None
        self.lexical_only = self.lexical_only or lexical
        threshold = LEXICAL_THRESHOLD if lexical else THRESHOLD
        margin = LEXICAL_MARGIN if lexical else MARGIN
        numbers = self.numbers
        scores = [table.score(claim, self.column[number]) for number in numbers]
        if cited:
            support = table.score_together(claim, [self.column[n] for n in cited])
            others = [k for k in range(len(numbers)) if numbers[k] not in cited]
            other = max(others, key=lambda k: (scores[k], -k)) if others else None
            if support >= threshold:
                return _Decided(gap, raw, cited, support, "kept")
            if other is not None and scores[other] >= threshold and scores[other] >= support + margin:
                moved = _with_citation(raw, sentence.markers, numbers[other])
                return _Decided(gap, moved, [numbers[other]], scores[other], "reattributed")
            return _Decided(gap, raw, cited, support, "unsupported")
        best = max(range(len(numbers)), key=lambda k: (scores[k], -k)) if numbers else None
        if best is not None and scores[best] >= threshold:
            added = _with_citation(raw, [], numbers[best])
            return _Decided(gap, added, [numbers[best]], scores[best], "added")
        return _Decided(gap, raw, cited, 0.0 if best is None else scores[best], "unsupported")

    # ------------------------------------------------------------------ the verified text

    def _place(self, decided: _Decided, position: int) -> str:
        """Where a decided sentence goes: shown now, held back, or withheld."""
        if decided.action == "repeated" or (decided.action == "unsupported" and self.withhold):
            self.withheld.append(
                {
                    "position": position,  # among the sentences of the model's text
                    "text": decided.text,
                    "action": decided.action,
                    "citations": decided.citations,
                    "support": round(float(decided.support), 4),
                }
            )
            return ""
        if decided.action not in ("kept", "reattributed", "added"):
            if not self.supported and self.withhold:
                self.held.append(decided)
                return ""
            return self._show(decided)
        self.supported += 1
        return self._release_held() + self._show(decided)

    def _release_held(self) -> str:
        held, self.held = self.held, []
        return "".join(self._show(decided) for decided in held)

    def _show(self, decided: _Decided) -> str:
        gap = decided.gap if self.length else decided.gap.lstrip()  # the answer starts with its first sentence
        start = self.length + len(gap)
        piece = gap + decided.text
        self.shown.append(piece)
        self.length += len(piece)
        self.checks.append(
            SentenceCheck(
                start=start,
                end=start + len(decided.text),
                citations=list(decided.citations),
                support=round(float(decided.support), 4),
                supported=decided.action in ("kept", "reattributed", "added"),
                action=decided.action,
            )
        )
        return piece

    def result(self) -> Verification:
        """What the check found; ``text`` is what was shown, then (when nothing it says was
        supported) what was held back."""
        if not self.finished:
            raise RuntimeError("finish() first")
        if not self.supported:
            self._release_held()
        _, removed = _drop_unknown(self.raw, set(self.numbers))
        unsupported = sum(item["action"] == "unsupported" for item in self.withheld) + sum(
            check.action == "unsupported" for check in self.checks
        )
        claims = self.supported + unsupported
        real_claims = self.kinds.count("claim")
        return Verification(
            text="".join(self.shown),
            sentences=list(self.checks),
            grounded=self.supported / claims if claims else None,
            removed_markers=removed,
            reattributed=sum(check.action == "reattributed" for check in self.checks),
            added=sum(check.action == "added" for check in self.checks),
            unsupported=unsupported,
            # Declining and listing the sources consulted is still declining.
            declined="decline" in self.kinds and not real_claims,
            scorer=SCORER_LEXICAL if self.lexical_only else SCORER,
            withheld=list(self.withheld),
        )
