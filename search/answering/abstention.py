"""Whether the retrieved sources answer a question at all, decided before any answer is written.

Shared by the extractive answer (``search.answering.extractive``) and the generated one: both call
``relevance`` (or score once with ``sentences_score`` and read ``relevance_of``) and decline
with ``NOT_ANSWERED`` when it says ``abstain``.

A source's retrieval score cannot decide this: hybrid search fuses ranks (RRF), so the best
hit of a question the collection cannot answer scores as well as that of one it can. The
sources are read instead, sentence by sentence (``sentence_units``: whole sentences, list
items, table rows with their column names; headings and questions are never sentences, only
context), and each sentence is scored against the question:

- the cosine of the sentence to the question with the collection's embedding model;
- plus ``COVERAGE_WEIGHT`` x the share of the question's content terms that the sentence
  holds, or its heading or list lead-in at ``CONTEXT_WEIGHT``, each term weighed by how rare
  it is among the sources' sentences (a term none of them holds weighs most: it is what the
  sources lack): PostgreSQL lexemes under the collection's text-search configuration
  (keyword search's stemmer), question words left out, numbers compared as numbers (3,000
  euros falls within "€2,500.01 - €10,000");
- less ``ANSWER_KIND_PENALTY`` when the question's words say what it asks for and the
  sentence cannot be it ("How much does X cost?" and no amount of money; ``answer_kind``).

The relevance of the sources is their best sentence's score, for the whole question or for any
of its parts ("What is X, and how long is Y?"); below ``ABSTAIN_BELOW`` the question is
declined. Without embeddings (the embedder cannot run) the coverage alone decides, against
``ABSTAIN_BELOW_LEXICAL``. The calibration and what it costs: docs/answers.md, "Extractive
answers and abstention".
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from django.core.cache import cache
from django.db import DatabaseError

from search import analysis
from search.analysis.japanese import AMOUNT, QUESTION_TERMS, affixes, amount_value, names_someone
from search.analysis.sentences import sentence_spans
from search.answering import reader, wording
from search.answering.prompting import Source
from search.bm25 import texts_lexemes
from search.embedders import EmbedderError, embedder_get, query_embedding
from search.models import Chunk

logger = logging.getLogger(__name__)

NOT_ANSWERED = wording.said("not_answered", analysis.ENGLISH)
CLOSEST_LEAD = wording.said("closest_lead", analysis.ENGLISH)

COVERAGE_WEIGHT = 0.5
CONTEXT_WEIGHT = 0.5  # a term found only in the sentence's heading or list lead-in counts half
CIRCUMSTANCE_WEIGHT = 0.5  # a term of what the question tells before it asks (``circumstance_of``)
# Taken from a sentence that cannot answer what the question asks for (no amount of money
# for "How much does X cost?", no quantity for "How many ...?").
ANSWER_KIND_PENALTY = 0.3
# Calibrated on questions nobody tuned the rules for as well as on the demo QA set
# (docs/answers.md, "Calibration"): at most 5 % of the calibration sets' answerable questions
# fall below it, and 94 % or more of their questions asked without their own source.
ABSTAIN_BELOW = 0.65
# The same line for a collection embedded by another model: cosines are on each model's own
# scale (multilingual-e5-small's of related texts sit near 0.85, all-MiniLM-L6-v2's near 0.5).
# Calibrated on JSQuAD's even half and the Japanese demo QA sets, and lowered from 1.04 where
# Japanese questions asked as people ask were declined (docs/answers.md, "Calibration").
ABSTAIN_BELOW_BY_MODEL = {"multilingual-e5-small": 1.0}
ABSTAIN_BELOW_LEXICAL = 0.45  # coverage alone, when the embedder cannot run
# With the reader: each sentence's relevance gains READER_WEIGHT x the reader's probability that
# it answers, and the lines move with it. Weight and lines chosen on the pairs and sets the reader
# was trained on (JSQuAD's even half, the demo's tuned sets; docs/answers.md, "The reader").
READER_WEIGHT = 0.3
READER_ABSTAIN_BELOW = 0.81
READER_ABSTAIN_BELOW_BY_MODEL = {"multilingual-e5-small": 1.15}
READER_ABSTAIN_BELOW_LEXICAL = 0.65
# Without embeddings the coverage is the share of at most this many of the question's terms,
# unweighted: a sentence that holds 5 terms of a 12-term query (Cranfield's) covers it as well
# as a 5-term question (weighed by rarity, coverage alone declined 15 % of Cranfield's answerable
# queries where this declines 2.7 %).
LEXICAL_COVERAGE_TERMS = 5
CLOSEST = 3
# Only in choosing which sentence to quote (``Against.ranking``), not in deciding to abstain.
PASSAGE_WEIGHT = 0.3
HEADING_WEIGHT = 0.15
LABEL_BONUS = 0.1
SENTENCE_CACHE_SECONDS = 24 * 3600

MIN_SENTENCE_CHARS = 12
MIN_SENTENCE_WORDS = 3
MAX_SENTENCE_CHARS = 600
HEADING_MAX_WORDS = 12

# Words that say what kind of answer is wanted, not what it is about: left out of the
# question's terms (PostgreSQL's search_english keeps all but 33 stop words).
QUESTION_STOP_WORDS = frozenset(
    """a about an and any are as at be been being but by can could did do does doing done for from get gets
    got had has have having he her his how i if in into is it its me much many long soon often my no not
    of on or our ours please she shall should so some tell than that the their them then there these they
    this those to us was we were what whats when where which while who whom whose why will with would
    you your yours may might must need needs""".split()
    # The filler of a question as people type it: what it is about is elsewhere ("How long does
    # that normally take to go through?", "Can I get my codes by text instead?", "I'll").
    + """get gets getting go goes going gone take takes taking normally usually typically generally roughly
    approximately exactly specifically actually really just still instead also ever even currently anyway until
    kind sort through ll ve re d m s t im ive id youre dont doesnt cant wont isnt arent whos wheres hows hi hello
    thanks thank able abl couple coupl bit lot thing things something anything someone anyone way want wanted
    like know wondering wonder sure okay ok up nobody anybody somebody everybody everyone""".split()
)

_WORD = re.compile(r"\w+")
_BULLET = re.compile(r"^(?:[-*+\u2022\u2023\u25e6\u25aa\u2013\u2014]\s+)+")
_NUMBERED = re.compile(r"^\d{1,3}[.)]\s+")
_SECTION_NUMBER = re.compile(r"^\d{1,3}(?:\.\d{1,3})*\.?\s+")
_ATX_HEADING = re.compile(r"^#{1,6}\s")
_TERMINAL = ".!?\u2026\u3002\uff01\uff1f"
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?\u2026\u3002\uff01\uff1f])[\"'\u201d\u2019)\]]?\s+")
_LABEL = re.compile(r"^([^\W\d][^:;.!?：]{0,40}?)(?::\s|：)")
# A Japanese sentence end inside a line (search.analysis.sentences splits there).
_JAPANESE_END = re.compile("[。！？](?!$)")
_ABBREVIATIONS = frozenset(
    "dr mr mrs ms prof st no nr vs etc e.g i.e eg ie approx cf fig inc ltd co corp jr sr dept ca".split()
)
# Numbers: 5,000 / 2,500.01 / 7.5 / 10; not the digits of a name (Atlas-7, SEV1, 1Password).
_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# Not the digits of a name (Atlas-7, SEV1, 1Password): no Latin letter or digit on either side.
# A Japanese number stands between words (第3四半期, 3,000円): kanji and kana may touch it.
_NUMBER_RE = re.compile(
    rf"(?<![A-Za-z0-9_\-.,])(?P<cur>[€$£¥])?\s?(?P<n>{_NUMBER})(?![A-Za-z0-9_\-])"
    r"(?:\s?(?P<unit>%|euros?\b|eur\b|chf\b|円|万円|億円))?",
    re.I,
)
_CURRENCY_BEFORE = re.compile(r"(?:eur|chf|usd)\s?$", re.I)
_RANGE_RE = re.compile(
    rf"(?P<a>{_NUMBER})(?!\d)\s?(?:%|euros?)?\s?(?:\u2013|\u2014|-|to)\s?(?:[€$£]|eur\s|chf\s)?\s?(?P<b>{_NUMBER})",
    re.I,
)
_AT_MOST_RE = re.compile(rf"\b(?:up to|at most|max(?:imum)?)\s(?:[€$£]|eur\s|chf\s)?\s?(?P<n>{_NUMBER})", re.I)
_ABOVE_RE = re.compile(rf"\b(?:above|over|more than|exceeding|beyond)\s(?:[€$£]|eur\s|chf\s)?\s?(?P<n>{_NUMBER})", re.I)
_BELOW_RE = re.compile(rf"\b(?:below|under|less than)\s(?:[€$£]|eur\s|chf\s)?\s?(?P<n>{_NUMBER})", re.I)


@dataclass(frozen=True)
class Unit:
    """A quotable sentence of a source: its text as quoted, and what stands above it."""

    number: int  # the source's [n]
    sentence: str
    context: str = ""  # the heading or list lead-in above it, for scoring only
    # The whole list item when the sentence is one of several in it: a rule's item says one
    # thing in its sentences together (「領収書を紛失した場合は紛失届を提出する。紛失届は年2回まで」).
    item: str = ""

    @property
    def label(self) -> str:
        """What a "Label: value" sentence names ("Core hours: 09:00 - 13:00 UTC"), else ""."""
        match = _LABEL.match(self.sentence)
        return match.group(1) if match else ""


@dataclass(frozen=True)
class Number:
    value: float
    currency: bool


@dataclass(frozen=True)
class Against:
    """The units of the sources scored against one question (or one part of it)."""

    question: str
    terms: frozenset[str]  # its content lexemes
    numbers: tuple[Number, ...]
    kind: AnswerKind | None  # what it asks for (``answer_kind``)
    held: list[frozenset[str]]  # per unit: its terms (a number as "#i") the sentence holds
    context_held: list[frozenset[str]]  # ... that only the unit's heading or lead-in holds
    dense: np.ndarray | None  # per unit: cosine to the question (None without embeddings)
    relevance: np.ndarray  # per unit: dense + COVERAGE_WEIGHT * weighted coverage, less ANSWER_KIND_PENALTY
    ranking: np.ndarray  # per unit: which to quote (see ``_against``)

    @property
    def best(self) -> float:
        return float(self.relevance.max()) if len(self.relevance) else -1.0


@dataclass
class Scored:
    """Every quotable unit of the sources, scored against the question and its parts."""

    units: list[Unit]
    lexemes: list[frozenset[str]]  # each unit's lexemes
    context_lexemes: list[frozenset[str]]  # ... its context's
    label_lexemes: list[frozenset[str]]  # ... and its label's
    vectors: np.ndarray | None  # each unit's embedding, None without embeddings
    passage_vectors: np.ndarray | None  # each unit's chunk's embedding (stored), None where unknown
    embedding_model: str | None
    text_search_config: str | None
    sources: Sequence[Source]
    whole: Against | None = None
    parts: list[Against] = field(default_factory=list)  # for a question in parts, each part
    title_lexemes: dict[int, frozenset[str]] = field(default_factory=dict)  # per source [n], its title's
    reader: str | None = None  # the reader's version when it scored the units
    unread: str | None = None  # why the reader did not, when it could not run

    @property
    def lexical_only(self) -> bool:
        return self.vectors is None

    @property
    def best(self) -> float:
        """The relevance of the sources: their best sentence for the question or for any of
        its parts (a question in two parts is answered part by part)."""
        return max([self.whole.best, *(part.best for part in self.parts)]) if self.whole else -1.0


@dataclass(frozen=True)
class Relevance:
    score: float  # the best sentence's relevance (-1 when the sources hold no sentence)
    closest: list[dict]  # the nearest sources: {number, chunk_id, document_id, title, score}
    abstain: bool
    lexical_only: bool = False  # decided without embeddings
    reader: str | None = None  # decided by this version of the reader (None: by the signals)
    unread: str | None = None  # why the reader could not decide

    def decided_by(self) -> dict:
        """For an answer's stats: the reader's version, or that the signals decided and why."""
        if self.reader:
            return {"reader": self.reader}
        return {"reader": None, "reader_unavailable": self.unread} if self.unread else {"reader": None}


# Where a question asks a second thing: ", and how ...", "; what ...", "? When ...".
_PART_SPLIT = re.compile(
    r"\?\s+|;\s+|,?\s+(?:and|also|plus)\s+(?=(?:what|how|who|whom|whose|when|where|which|why|is|are|was|were|"
    r"do|does|did|can|could|must|should|will|would|may|has|have|if)\b)",
    re.IGNORECASE,
)


# Japanese asks a second question after 。 or ？ with no space ("…届け出ればいいですか。再発行には
# どのくらいかかりますか"), and two things at once with と … それぞれ ("AとBの売上高をそれぞれ").
_PART_SPLIT_JA = re.compile(r"(?<=[。？！?!])\s*(?=\S)")
_BOTH_JA = re.compile(
    r"^(?P<a>[^、。と]+?)と(?P<b>[^、。]+?)の(?P<asked>[^。？?]*?)(?:を|は)?(?:それぞれ|各々|おのおの)(?P<rest>.*)$"
)
_QUESTION_END = " ,.?、。？!！"
# A statement before the question asks: up to a dash, a colon or a sentence's end, then a
# question word.
_CIRCUMSTANCE = re.compile(
    r"^(.{8,}?)\s*(?:\s[\u2013\u2014-]\s|[:.!]\s+)(?=(?:what|how|who|whom|whose|when|where|which|why|is|are|do|does|"
    r"can|could|should|must|will|would|may)\b)",
    re.IGNORECASE,
)
# A Japanese sentence that asks: it ends in か or a question mark, or asks for something.
_ASKS_JA = re.compile(
    r"(?:か|かな|の)[。？?]?$|[？?]$|何|いつ|どこ|誰|だれ|どなた|いくら|どう|どの|どれ|なぜ|教えて|ください[。]?$"
)


def question_parts(question: str) -> list[str]:
    """The things a question asks, in order ("What is X, and how long is Y?": two); one part
    for a simple question."""
    if analysis.language_of(question) == analysis.JAPANESE:
        parts = []
        for piece in _PART_SPLIT_JA.split(question.strip()):
            # What comes before a question without asking anything is its circumstance
            # (「添付ファイルを開いてしまいました。いつまでに報告すればいいですか」): one part with it.
            if parts and not _ASKS_JA.search(parts[-1]):
                parts[-1] += piece
            else:
                parts.append(piece)
        parts = [part.strip(_QUESTION_END) for part in parts]
        if len(parts) == 1 and (both := _BOTH_JA.match(parts[0])):
            rest = both["rest"]
            particle = "" if not rest else "は" if re.match("何|いくら|いつ|誰|どの|どれ|どこ", rest) else "を"
            asked = f"{both['asked']}{particle}{rest}"
            parts = [f"{both['a']}の{asked}", f"{both['b']}の{asked}"]
        parts = [part for part in parts if len(analysis.words(part)) >= 2]
        return parts if len(parts) > 1 else [question]
    parts = [part.strip(_QUESTION_END) for part in _PART_SPLIT.split(question)]
    parts = [part for part in parts if len(_WORD.findall(part)) >= 2]
    if len(parts) < 2:
        return [question]
    # What the first part says before it asks ("I'm spending a week at the Zürich office —
    # what's the address, and what per-diem do I get there?") is every part's circumstance.
    circumstance = _CIRCUMSTANCE.match(parts[0])
    if circumstance:
        parts = [parts[0], *(f"{circumstance.group(1)} {part}" for part in parts[1:])]
    return parts


def circumstance_of(question: str) -> str:
    """What a question tells before it asks ("I left my YubiKey on a train", 「経費の領収書をなく
    してしまいました。」), as written; "" when it asks at once."""
    if analysis.language_of(question) == analysis.JAPANESE:
        told = []
        for piece in _PART_SPLIT_JA.split(question.strip())[:-1]:
            if _ASKS_JA.search(piece):
                break
            told.append(piece)
        return "".join(told)
    match = _CIRCUMSTANCE.match(question.strip())
    return match.group(1) if match else ""


# --------------------------------------------------------------------------- sentences


def sentences_of(text: str) -> list[str]:
    """The quotable sentences of a chunk, in order (see ``sentence_units``)."""
    return [unit.sentence for unit in sentence_units(text)]


def sentence_units(text: str, number: int = 0) -> list[Unit]:
    """A chunk's text as quotable units, in order.

    What parsers leave of a document's structure is lines: Markdown and HTML headings stand
    alone on theirs (markers dropped: "2. Rotation", "How long does the battery last?"),
    list items keep their bullets in Markdown and text ("- ", "1. ") and lose them in HTML,
    table rows keep their pipes. So, paragraph by paragraph:

    - a heading (a line without final punctuation that reads as a title, all capitals, or a
      question) is never quoted; it becomes the context of the sentences under it;
    - a line is split into sentences (not at "Dr." or "e.g."), each quoted whole;
    - a sentence ending with ":" introduces a list: items that are sentences of their own
      are quoted alone, and items that are only phrases ("Germany", "Slack") are quoted
      together after it, joined by "; ", since one of them alone says nothing;
    - a table row is quoted with its column names ("Claim total: ...; Approver: ..."),
      its header row never;
    - bullets are dropped; a line that starts in lower case continues the line before (PDF
      text wraps at the page's width).
    """
    reader = _Reader(number)
    for block in re.split(r"\n\s*\n", text):
        reader.block(_joined_lines(block))
    return reader.units


class _Reader:
    """The state of ``sentence_units`` across a chunk's paragraphs."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.units: list[Unit] = []
        self.heading = ""
        self.lead = ""  # a sentence ending with ":", waiting for its list
        self.items: list[str] = []  # list items that are phrases, waiting to be joined

    def emit(self, text: str, context: str, *, split: bool = False) -> None:
        self.units.extend(_units_of(text, self.number, context, split=split))

    def flush(self) -> None:
        if self.items:
            joined = "; ".join(self.items)
            if self.lead:
                self.emit(f"{self.lead} {joined}", self.heading)
            elif len(self.items) > 1 or not _is_heading(joined):
                self.emit(joined, self.heading)
            self.items.clear()

    def block(self, lines: list[str]) -> None:
        header: list[str] | None = None
        in_table = False
        for raw in lines:
            if _is_table_row(raw):
                self.flush()
                cells = [cell.strip() for cell in raw.strip().strip("|").split("|")]
                if not in_table:
                    in_table = True
                    if _is_header_row(cells):
                        header = cells
                        continue
                self.emit(_row_sentence(cells, header), _context(self.heading, self.lead))
                continue
            if in_table:
                in_table, header, self.lead = False, None, ""
            self.line(raw)
        self.flush()
        if in_table:
            self.lead = ""
        # Otherwise a lead-in survives the blank line: HTML puts a list after its own paragraph.

    def line(self, raw: str) -> None:
        symbol = bool(_BULLET.match(raw))
        line = (_BULLET.sub("", raw) if symbol else raw).strip()
        if not line:
            return
        if _is_strong_heading(line) or (not symbol and not self.lead and _is_heading(line)):
            self.flush()
            self.heading, self.lead = _heading_text(line), ""
            return
        numbered = bool(_NUMBERED.match(line))
        if numbered:
            line = _NUMBERED.sub("", line, count=1).strip()
        # A list goes on while lines are bulleted, or are phrases under a lead-in (HTML's
        # items lose their bullets); a sentence without a bullet ends it.
        if (symbol or numbered or (self.lead and not _ends_sentence(line))) and not line.endswith(":"):
            if _ends_sentence(line):  # an item that is a sentence of its own
                self.flush()
                self.emit(line, _context(self.heading, self.lead), split=True)
            else:
                self.items.append(line)
            return
        self.flush()
        sentences = _split_sentences(line)
        self.lead = sentences.pop() if sentences and sentences[-1].endswith(":") else ""
        for sentence in sentences:
            self.emit(sentence, self.heading)


def _joined_lines(block: str) -> list[str]:
    lines: list[str] = []
    for raw in block.split("\n"):
        line = raw.strip()
        if not line:
            continue
        previous = lines[-1] if lines else ""
        if (
            previous
            and not _is_table_row(previous)
            and not _is_table_row(line)
            and not (_BULLET.match(line) or _NUMBERED.match(line))
            and previous[-1] not in _TERMINAL + ":"
            and (line[0].islower() or previous[-1] in ",;(\u2013\u2014-")
        ):
            lines[-1] = f"{previous} {line}"
        else:
            lines.append(line)
    return lines


def _is_table_row(line: str) -> bool:
    stripped = line.strip()
    return stripped.startswith("|") and stripped.count("|") >= 2


def _is_header_row(cells: list[str]) -> bool:
    return all(len(cell.split()) <= 5 and not re.search(r"\d", cell) for cell in cells if cell)


def _row_sentence(cells: list[str], header: list[str] | None) -> str:
    if header and len(header) == len(cells):
        return "; ".join(f"{name}: {cell}" if name else cell for name, cell in zip(header, cells, strict=True) if cell)
    return "; ".join(cell for cell in cells if cell)


def _ends_sentence(line: str) -> bool:
    return line.rstrip("\"'\u201d\u2019)]*")[-1:] in _TERMINAL


def _heading_text(line: str) -> str:
    return _SECTION_NUMBER.sub("", line.lstrip("#").strip()).strip()


def _is_strong_heading(line: str) -> bool:
    """A heading whatever surrounds it: Markdown's "#", all capitals, or a question."""
    if _ATX_HEADING.match(line) or line.endswith(("?", "？")):
        return True
    letters = [c for c in _heading_text(line) if c.isalpha()]
    return len(letters) >= 2 and all(c.isupper() for c in letters) and not _ends_sentence(line)


def _is_heading(line: str) -> bool:
    """A line that titles what follows rather than saying something."""
    line = line.strip()
    if _ATX_HEADING.match(line):
        return True
    if line.endswith(("?", "？")):  # an FAQ's heading; a question never answers one
        return True
    body = _heading_text(line)
    if not body or _ends_sentence(body) or body.endswith(":"):
        return False
    if re.search(r"(?::\s*|：)\S", body):  # "Owner: People Operations", 「担当：人事部」 say something
        return False
    letters = [c for c in body if c.isalpha()]
    if len(letters) >= 2 and all(c.isupper() for c in letters):
        return True
    return len(analysis.words(body)) <= HEADING_MAX_WORDS


def _context(heading: str, lead: str) -> str:
    return f"{heading} {lead}".strip()


def _split_sentences(line: str) -> list[str]:
    pieces = [piece.strip() for piece in _SENTENCE_SPLIT.split(line) if piece.strip()]
    # Japanese puts no space after 。！？: such a piece holds several sentences (search.analysis).
    pieces = [
        piece[start:end]
        for piece in pieces
        for start, end in (sentence_spans(piece) if _JAPANESE_END.search(piece) else [(0, len(piece))])
    ]
    sentences: list[str] = []
    for piece in pieces:
        if sentences and _continues(sentences[-1], piece):
            sentences[-1] = f"{sentences[-1]} {piece}"
        else:
            sentences.append(piece)
    return sentences


def _continues(previous: str, piece: str) -> bool:
    """Whether a split after ``previous`` was wrong: "Dr. Léa", "e.g. a", "J. Smith"."""
    last = previous.rsplit(None, 1)[-1].rstrip(".").lower()
    if last in _ABBREVIATIONS or (len(last) == 1 and last.isalpha()):
        return True
    # "word. next" in lower case is an abbreviation we do not know; "word . next" (Cranfield)
    # is a sentence end.
    return piece[0].islower() and not previous.endswith(" .") and previous.endswith(".")


def _units_of(text: str, number: int, context: str, *, split: bool = False) -> list[Unit]:
    sentences = _split_sentences(text) if split else [text]
    item = " ".join(text.split()) if len(sentences) > 1 else ""
    units = []
    for sentence in sentences:
        sentence = " ".join(sentence.split())
        if (
            len(sentence) < MIN_SENTENCE_CHARS
            or len(analysis.words(sentence)) < MIN_SENTENCE_WORDS
            or sentence.endswith(("?", "？"))
            or sentence.endswith(":")
        ):
            continue
        for piece in _fit(sentence):
            units.append(Unit(number=number, sentence=piece, context=context, item=item))
    return units


def _fit(sentence: str) -> list[str]:
    """A sentence too long to quote, cut at its semicolons (else left out)."""
    if len(sentence) <= MAX_SENTENCE_CHARS:
        return [sentence]
    pieces, current = [], ""
    for part in sentence.split("; "):
        candidate = f"{current}; {part}" if current else part
        if len(candidate) <= MAX_SENTENCE_CHARS:
            current = candidate
        else:
            if current:
                pieces.append(current)
            current = part if len(part) <= MAX_SENTENCE_CHARS else ""
    if current:
        pieces.append(current)
    return pieces


# --------------------------------------------------------------------------- terms and numbers


def _fallback_terms(text: str) -> set[str]:
    """Words on their first five letters, a plural's "s" dropped: a stemmer's poor cousin,
    for sources without a text-search configuration."""
    words = _WORD.findall(text.lower())
    return {
        (w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w)[:5]
        for w in words
        if len(w) > 1 and not w.isdigit()
    }


# Snowball stems words, not irregular forms: "lost" would never meet "lose".
_IRREGULAR = {
    "lost": "lose",
    "paid": "pay",
    "bought": "buy",
    "sent": "send",
    "kept": "keep",
    "held": "hold",
    "taken": "take",
    "took": "take",
    "given": "give",
    "gave": "give",
    "chosen": "choos",
    "chose": "choos",
    "made": "make",
    "found": "find",
    "told": "tell",
    "got": "get",
    "gotten": "get",
    "stolen": "steal",
    "stole": "steal",
    "written": "write",
    "wrote": "write",
    "known": "know",
    "knew": "know",
    "spent": "spend",
    "brought": "bring",
    "begun": "begin",
    "began": "begin",
    "broken": "break",
    "broke": "break",
    "driven": "drive",
    "drove": "drive",
    "flown": "fli",
    "flight": "fli",  # "flying" is "fli" to the stemmer, "flights" "flight"
    "flew": "fli",
    "forgotten": "forget",
    "forgot": "forget",
    "sold": "sell",
    "worn": "wear",
}


# A run of capitalised words, "of"/"and"/"&" allowed between them ("Chief Information Security
# Officer", "Department of Finance").
_CAPITALISED_RUN = re.compile(r"\b[A-Z][\w'-]*(?:\s+(?:(?:of|and|&|for)\s+)?[A-Z][\w'-]*)+")


def _initialisms(sentence: str) -> set[str]:
    """The acronyms a sentence spells out, lower-cased as lexemes are: "Chief Information
    Security Officer" holds "ciso", "Multi-Factor Authentication" "mfa"."""
    found = set()
    for run in _CAPITALISED_RUN.finditer(sentence):
        initials = "".join(w[0] for w in re.split(r"[\s-]+", run.group()) if w and w[0].isupper()).lower()
        # Any stretch of the run: a name may follow the title it spells ("... Officer Dr. Léa").
        found.update(initials[i:j] for i in range(len(initials)) for j in range(i + 2, min(len(initials), i + 6) + 1))
    return found


# What a superlative asks for, as a rule states it: "the heaviest load" is the "maximum
# payload", "the shortest password" is "at least 14 characters".
_EXTREMES = {
    **dict.fromkeys("heaviest largest biggest longest highest fastest greatest max".split(), "maximum"),
    **dict.fromkeys("shortest smallest lowest fewest least min".split(), "minimum"),
}


def _lexemes(texts: list[str], config: str | None) -> list[set[str]]:
    """Each text's lexemes under a text-search configuration (one query for all), digits
    left out (numbers are compared as numbers)."""
    if not config:
        return [_fallback_terms(text) for text in texts]
    return [
        {_EXTREMES.get(lexeme, _IRREGULAR.get(lexeme, lexeme)) for lexeme in row}
        for row in texts_lexemes(texts, config, numbers=False)
    ]


def _question_content(question: str) -> str:
    """The question's words that say what it is about ("how large" says what kind of answer)."""
    question = re.sub(_ASKS_QUANTITY, " ", question)
    question = _SPOKEN_MINUTES.sub(" ", question)  # a number, compared as one
    return " ".join(word for word in re.split(r"(\W+)", question) if word.lower() not in QUESTION_STOP_WORDS)


_MINUTES = {"half an hour": 30.0, "quarter of an hour": 15.0, "an hour and a half": 90.0}
_SPOKEN_MINUTES = re.compile(r"\b(?:" + "|".join(_MINUTES) + r")\b", re.IGNORECASE)


def numbers_of(text: str) -> list[Number]:
    return [number for _, _, number in _numbers_at(unicodedata.normalize("NFKC", text))]


def _numbers_at(text: str) -> list[tuple[int, int, Number]]:
    """The numbers of an NFKC-normalised text with their spans, in order."""
    found = [
        (match.start(), match.end(), Number(amount_value(match.group("amount")), bool(match.group("yen"))))
        for match in AMOUNT.finditer(text)
    ]
    # The rest of the text, amounts blanked out so that their digits are not read again.
    rest = AMOUNT.sub(lambda match: " " * len(match.group(0)), text)
    for match in _NUMBER_RE.finditer(rest):
        value = float(match.group("n").replace(",", ""))
        unit = (match.group("unit") or "").lower()
        currency = (
            bool(match.group("cur"))
            or unit.startswith(("eur", "chf"))
            or unit.endswith("円")
            or bool(_CURRENCY_BEFORE.search(text[: match.start()]))
        )
        found.append((match.start(), match.end(), Number(value, currency)))
    # Minutes said in words ("if nobody acknowledges for half an hour": the 30-minute step).
    for match in _SPOKEN_MINUTES.finditer(text):
        found.append((match.start(), match.end(), Number(_MINUTES[match.group().lower()], False)))
    return sorted(found, key=lambda item: item[0])


# Japanese bounds follow their number: 8万円超 40万円以下, 3万円未満, 10,000円以上, 5〜10日.
_LOWER_JA = re.compile(r"\s?(?:超|以上|を超え|より多)")
_UPPER_JA = re.compile(r"\s?(?:以下|未満|まで|以内)")
_BETWEEN_JA = re.compile(r"^\s?(?:[〜~\-–]|から)\s?$")


def _intervals_ja(text: str) -> list[tuple[float, float, bool]]:
    """The ranges a Japanese text states, as (low, high, currency)."""
    spans = _numbers_at(text)
    intervals = []
    index = 0
    while index < len(spans):
        _, end, number = spans[index]
        following = spans[index + 1] if index + 1 < len(spans) else None
        if following and _BETWEEN_JA.match(text[end : following[0]]):
            intervals.append((number.value, following[2].value, number.currency or following[2].currency))
            index += 2
            continue
        if _LOWER_JA.match(text, end):
            bound_end = _LOWER_JA.match(text, end).end()
            if following and not text[bound_end : following[0]].strip() and _UPPER_JA.match(text, following[1]):
                intervals.append((number.value, following[2].value, number.currency or following[2].currency))
                index += 2
                continue
            intervals.append((number.value, math.inf, number.currency))
        elif _UPPER_JA.match(text, end):
            intervals.append((-math.inf, number.value, number.currency))
        index += 1
    return intervals


def _numbers_held(question_numbers: Sequence[Number], text: str) -> set[int]:
    """Which of the question's numbers ``text`` states, or falls within a range it states."""
    if not question_numbers:
        return set()
    text = unicodedata.normalize("NFKC", text)
    stated = numbers_of(text)
    intervals: list[tuple[float, float, bool]] = []  # low, high, currency
    for match in _RANGE_RE.finditer(text):
        low, high = (float(match.group(key).replace(",", "")) for key in ("a", "b"))
        if low < high:
            intervals.append((low, high, "€" in match.group(0) or "eur" in match.group(0).lower()))
    for pattern, bound in ((_AT_MOST_RE, "high"), (_BELOW_RE, "high"), (_ABOVE_RE, "low")):
        for match in pattern.finditer(text):
            value = float(match.group("n").replace(",", ""))
            currency = "€" in match.group(0) or "eur" in match.group(0).lower()
            intervals.append((-math.inf, value, currency) if bound == "high" else (value, math.inf, currency))
    intervals.extend(_intervals_ja(text))
    held = set()
    for index, number in enumerate(question_numbers):
        if any(n.value == number.value and (n.currency == number.currency or not number.currency) for n in stated):
            held.add(index)
        elif number.currency and any(low <= number.value <= high and cur for low, high, cur in intervals):
            held.add(index)
    return held


# What a question asks for, where its words say so (English): an amount of money, a duration,
# a count of something, or a quantity.
_ASKS_MONEY = re.compile(
    r"\bhow much\b.*\b(?:cost|costs|price|pay|paid|charge|charged|fee|worth|spend)\b|"
    r"\b(?:price|cost|fee)s? (?:of|for)\b|\bwhat does\b.*\bcost\b",
    re.IGNORECASE,
)
_ASKS_DURATION = re.compile(
    r"\bhow long (?:does|do|did|will|would|can|could|may|should|must|is it|until|before|after)\b|"
    r"\bhow (?:soon|often)\b|\b(?:after|within) how (?:long|many (?:seconds|minutes|hours|days|weeks|months|years))\b",
    re.IGNORECASE,
)
_ASKS_COUNT = re.compile(
    r"\bhow many ((?:[\w-]+ ){0,2}?[\w-]+?)s?\b(?= (?:are|is|do|does|can|could|must|will|would|"
    r"should|may|did|have|has|per|in|of|before|after|lock|i|we|you)\b|\?|$)",
    re.IGNORECASE,
)
_ASKS_INSTRUCTION = re.compile(
    r"\bwhat (?:should|must|do|can|shall) (?:i|we|you|an? \w+|employees?|staff) do\b|\bwhat happens if\b",
    re.IGNORECASE,
)
_INSTRUCTS = re.compile(
    r"\b(?:must|should|shall|have to|has to|need to|needs to|required?|requires|may not|never|always|do not|don't|"
    r"is allowed|are allowed|report|contact|call|ask)\b",
    re.IGNORECASE,
)
_ASKS_QUANTITY = re.compile(
    r"\bhow (?:much|many|long|soon|often|large|big|far|old|fast|high|heavy|tall|wide)\b|\bwhat percentage\b",
    re.IGNORECASE,
)
_QUANTITY_WORDS = re.compile(
    r"\b(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen|twenty|thirty|sixty|hundred|"
    r"thousand|million|once|twice|daily|weekly|monthly|yearly|annually|half|dozen|same (?:working |business )?day)\b",
    re.IGNORECASE,
)
_NUMBER_WORDS = r"\d+(?:[.,]\d+)?|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen|twenty|thirty"
_DURATION = re.compile(
    rf"\b(?:{_NUMBER_WORDS})[\s-]?(?:(?:working|business|calendar|consecutive)\s)?"
    r"(?:seconds?|secs?|s|minutes?|mins?|hours?|hrs?|h|days?|weeks?|months?|years?|yrs?)\b|"
    r"\b(?:daily|weekly|monthly|yearly|annually|once|twice|immediately|same (?:working |business )?day|"
    r"next (?:working |business )?day)\b",
    re.IGNORECASE,
)
_MONEY = re.compile(
    r"[€$£¥]\s?\d|\d\s?(?:[€$£¥]|euros?\b|eur\b|chf\b|usd\b|gbp\b|dollars?\b|francs?\b|pounds?\b)|"
    r"\b(?:eur|chf|usd|gbp)\s?\d",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class AnswerKind:
    """What a question asks for: ``money``, ``duration``, ``instruction`` (a rule: "What should I do
    if ...?"), ``count`` (of ``counted``), ``quantity``, ``person`` (誰), ``reason`` (なぜ, why),
    ``contact`` (whom to call) or ``permission`` (may I: a rule that allows or forbids)."""

    name: str
    counted: str = ""  # for a count: the thing counted, singular ("minute", "robot")

    @property
    def ranking_only(self) -> bool:
        """Whether the kind only chooses which sentence to quote, not whether to decline: a
        person or a reason is said in too many ways (a role, 「…により」) to rule a sentence out."""
        return self.name in ("person", "reason", "contact", "permission")


# The same in Japanese: いくら (money), 何日 (a duration), 何人 (a count of 人), どのくらい.
_ASKS_MONEY_JA = re.compile(r"いくら|幾ら|金額|費用|料金|価格|値段|売上高|売り上げ|日当|手当|何円")
_ASKS_DURATION_JA = re.compile(r"何(?:日|時間|分|週間|か月|ヶ月|カ月|年)|いつまで|どのくらいの期間|期限")
_ASKS_COUNT_JA = re.compile(r"何(人|件|台|個|回|名|社|店|冊|枚)|いくつ")
_ASKS_QUANTITY_JA = re.compile(r"どのくらい|どれくらい|何パーセント|何%|割合|比率")
_MONEY_JA = re.compile(r"\d\s?(?:円|万円|億円|ドル|ユーロ)|[¥￥]\s?\d")
_DURATION_JA = re.compile(r"\d\s?(?:日|時間|分|週間|か月|ヶ月|カ月|年|営業日)|即時|直ちに|速やかに|毎日|毎週|毎月")


_ASKS_REASON = re.compile(r"\bwhy\b|\bfor what reason\b|なぜ|何故|どうして|なんで(?!す)|理由|原因|要因", re.IGNORECASE)
_GIVES_REASON = re.compile(
    r"\b(?:because|due to|owing to|since|as a result|caused by|reasons?|so that)\b|"
    r"ため|により|によって|による|要因|原因|理由|ので|から、",
    re.IGNORECASE,
)
_ASKS_PERSON_JA = re.compile(r"誰|だれ|どなた|何者")
# Whom to contact: 「どこに連絡すればいいですか」, "Who should I contact ...?" The answer is a
# channel: an address, a number, a Slack channel, a desk.
_ASKS_CONTACT = re.compile(
    r"(?:どこ|誰|だれ|どなた)(?:に|へ)(?:連絡|問い合わせ|問合せ|報告|相談|電話|申し出|届け出)|連絡先|問い合わせ先|問合せ先|"
    r"\bwho(?:m)? (?:do|should|can|must) (?:i|we|you) (?:contact|call|ask|email|notify|tell)\b|"
    r"\bwhere (?:do|should|can) (?:i|we|you) report\b",
    re.IGNORECASE,
)
# May I: 「在宅勤務はできますか」「使ってもいいですか」, "Can I ...?" The answer is a rule that allows
# or forbids.
_ASKS_PERMISSION = re.compile(
    r"(?:でき|出来)(?:ます|る)(?:か|の)|(?:て|で)も(?:いい|良い|よい|大丈夫|構わない|かまわない)|可能(?:です)?か|"
    r"許可され(?:ます|る)か|(?<!how )\b(?:can|may) (?:i|we|employees?|staff)\b|\b(?:am|are) (?:i|we) allowed\b",
    re.IGNORECASE,
)
_GIVES_PERMISSION = re.compile(
    r"でき(?:る|ない|ます|ません)|出来|認め|可能|不可|禁止|許可|ならない|いけない|してはならない|限る|のみ|"
    r"\b(?:may|must|can|cannot|can't|allowed|permitted|prohibited|forbidden|not allowed|only)\b",
    re.IGNORECASE,
)
_GIVES_CONTACT = re.compile(
    r"[\w.+-]+@[\w-]+\.[\w.-]+|\+?\d[\d ()-]{6,}\d|内線\s?\d|#[a-z][\w-]+|https?://|窓口|ヘルプデスク|ホットライン|"
    r"\b(?:service desk|help ?desk|hotline|extension|ext\.)",
    re.IGNORECASE,
)


def answer_kind(question: str) -> AnswerKind | None:
    """What the question's words ask for ("How much does X cost?": money; "How long does it
    take?": a duration; "How many robots ...?": a count of robots; "How large ...?": a
    quantity; 「なぜ」: a reason; 「誰が」: a person), or None when they do not say."""
    question = unicodedata.normalize("NFKC", question)
    if _ASKS_REASON.search(question):
        return AnswerKind("reason")
    if _ASKS_CONTACT.search(question):
        return AnswerKind("contact")
    if _ASKS_PERMISSION.search(question):
        return AnswerKind("permission")
    if _ASKS_PERSON_JA.search(question):
        return AnswerKind("person")
    if _ASKS_MONEY.search(question) or _ASKS_MONEY_JA.search(question):
        return AnswerKind("money")
    if _ASKS_INSTRUCTION.search(question):
        return AnswerKind("instruction")
    if _ASKS_DURATION.search(question) or _ASKS_DURATION_JA.search(question):
        return AnswerKind("duration")
    count = _ASKS_COUNT.search(question)
    if count:
        return AnswerKind("count", counted=count.group(1).split()[-1].lower())
    count = _ASKS_COUNT_JA.search(question)
    if count:
        return AnswerKind("count", counted=count.group(1) or "")
    if _ASKS_QUANTITY.search(question) or _ASKS_QUANTITY_JA.search(question):
        return AnswerKind("quantity")
    return None


def holds_kind(kind: AnswerKind | None, sentence: str) -> bool:
    """Whether a sentence can be the answer to a question asking for ``kind``: it states an
    amount of money, a duration, a number of the thing counted (within three words: "10
    failed login attempts"), or any quantity."""
    if kind is None:
        return True
    sentence = unicodedata.normalize("NFKC", sentence)
    if kind.name == "money":
        return bool(_MONEY.search(sentence) or _MONEY_JA.search(sentence))
    if kind.name == "duration":
        return bool(_DURATION.search(sentence) or _DURATION_JA.search(sentence))
    if kind.name == "instruction":
        return bool(_INSTRUCTS.search(sentence))
    if kind.name == "reason":
        return bool(_GIVES_REASON.search(sentence))
    if kind.name == "person":
        return names_someone(sentence)
    if kind.name == "contact":
        return bool(_GIVES_CONTACT.search(sentence))
    if kind.name == "permission":
        return bool(_GIVES_PERMISSION.search(sentence))
    if kind.name == "count" and (not kind.counted or not kind.counted.isascii()):
        return bool(re.search(rf"\d\s?{re.escape(kind.counted)}", sentence))
    if kind.name == "count":
        counted = re.escape(kind.counted[:5])
        return bool(re.search(rf"\b(?:{_NUMBER_WORDS})\b(?:\W+\w+){{0,3}}?\W+{counted}", sentence, re.IGNORECASE))
    return bool(re.search(r"\d", sentence) or _QUANTITY_WORDS.search(sentence))


# --------------------------------------------------------------------------- scoring


def sentences_score(
    question: str,
    sources: Sequence[Source],
    *,
    embedding_model: str | None,
    text_search_config: str | None = None,
    read: bool = True,
) -> Scored:
    """Every quotable unit of the sources (repeats across overlapping chunks once), scored
    against the question and, for a question in parts, against each part, by the signals
    below; with the reader's reading added (``_read``) when it is on and ``read``."""
    units: list[Unit] = []
    as_read: dict[int, list[Unit]] = {}  # per source [n]: its units as the reader reads them
    seen: set[str] = set()
    # A Japanese document's title is context for every sentence in it: reports, rules and
    # minutes name what they are about there (「売上報告（2026年度第2四半期）」) and their
    # sentences do not ("第2四半期の売上高は…"). English keeps its calibration without it.
    titled = analysis.language_of(question) == analysis.JAPANESE
    for source in sources:
        for unit in sentence_units(source.text, source.number):
            key = " ".join(unit.sentence.lower().split())
            if key not in seen:
                seen.add(key)
                as_read.setdefault(source.number, []).append(unit)
                if titled and source.title and source.title not in unit.context:
                    unit = replace(unit, context=f"{source.title} {unit.context}".strip())
                units.append(unit)
    scored = Scored(
        units=units,
        lexemes=[],
        context_lexemes=[],
        label_lexemes=[],
        passage_vectors=None,
        vectors=None,
        embedding_model=embedding_model,
        text_search_config=text_search_config,
        sources=sources,
    )
    if not units:
        return scored
    parts = question_parts(question)
    questions = [question, *parts] if len(parts) > 1 else [question]
    # Headings, lead-ins and labels are few and shared: each is analysed once.
    extras = sorted(
        {unit.context for unit in units if unit.context}
        | {unit.label for unit in units if unit.label}
        | {source.title for source in sources if source.title}
    )
    # What the question tells before it asks ("I left my YubiKey on a train. How long until I get
    # a replacement?") weighs CIRCUMSTANCE_WEIGHT: an answer need not say it again.
    circumstance = circumstance_of(question)
    asked = [q.replace(circumstance, " ", 1) for q in questions] if circumstance else []
    lexemes = _lexemes(
        [*(_question_content(q) for q in [*questions, *asked]), *(unit.sentence for unit in units), *extras],
        text_search_config,
    )
    asked_lexemes = lexemes[len(questions) : len(questions) + len(asked)]
    question_lexemes, lexemes = lexemes[: len(questions)], lexemes[len(questions) + len(asked) :]
    # Japanese question words (いくら, 教えてください) say what kind of answer is wanted; the
    # pieces of a number's compound (2026年度: 年度) are said by the compound itself.
    # Prefixes and suffixes (第, 高) are held by every sentence of a kind and say nothing of the topic.
    question_lexemes = [
        _without_compound_parts(
            set(terms) - QUESTION_TERMS - (affixes(q) if analysis.language_of(q) == analysis.JAPANESE else set())
        )
        for q, terms in zip(questions, question_lexemes, strict=True)
    ]
    by_text = dict(zip(extras, lexemes[len(units) :], strict=True))
    # An acronym of the question ("CISO") is held by a sentence that spells it out ("Chief
    # Information Security Officer Dr. Léa Fontaine").
    scored.lexemes = [
        frozenset(held | _initialisms(unit.sentence)) for held, unit in zip(lexemes[: len(units)], units, strict=True)
    ]
    scored.context_lexemes = [frozenset(by_text.get(unit.context, ())) for unit in units]
    scored.label_lexemes = [frozenset(by_text.get(unit.label, ())) for unit in units]
    scored.title_lexemes = {source.number: frozenset(by_text.get(source.title, ())) for source in sources}
    if embedding_model:
        try:
            scored.vectors = _normalised(sentence_vectors(embedding_model, [unit.sentence for unit in units]))
        except (EmbedderError, OSError, RuntimeError, ValueError) as exc:
            logger.warning("sentences scored without embeddings (%s)", exc)
        else:
            scored.passage_vectors = _passage_vectors(embedding_model, sources, units)
    told = [frozenset()] * len(questions)
    if asked:
        told = [frozenset(terms - set(own)) for terms, own in zip(question_lexemes, asked_lexemes, strict=True)]
    against = [
        _against(scored, q, frozenset(terms), circumstance_terms)
        for q, terms, circumstance_terms in zip(questions, question_lexemes, told, strict=True)
    ]
    if read:
        against = _read(scored, against, as_read)
    scored.whole, scored.parts = against[0], against[1:]
    return scored


def _read(scored: Scored, against: list[Against], as_read: dict[int, list[Unit]]) -> list[Against]:
    """The units' relevance and ranking with the reader's reading beside them: READER_WEIGHT x
    the probability that the sentence, read in its passage, answers the question (or the part).
    Unchanged, and the reason kept in ``scored.unread``, when the reader cannot run."""
    passages = [(source.title, as_read[source.number]) for source in scored.sources if source.number in as_read]
    readings = []
    for one in against:
        read = reader.answers(one.question, passages)
        if read is None:
            scored.unread = reader.reader_unavailable() or "the reader could not run"
            return against
        readings.append(np.array([p for per_passage in read for p in per_passage], dtype=np.float64))
    scored.reader = reader.reader_get().version
    return [
        replace(one, relevance=one.relevance + READER_WEIGHT * read, ranking=one.ranking + READER_WEIGHT * read)
        for one, read in zip(against, readings, strict=True)
    ]


def sentence_vectors(embedding_model: str, sentences: list[str]) -> np.ndarray:
    """The sentences' embeddings, cached in Redis as query embeddings are: the same chunks
    come back question after question, and embedding the ~50 sentences of 8 chunks costs
    more than the retrieval (0.13 s at the median on two cores, up to 1.6 s while they were
    shared, against 4 to 16 ms)."""
    keys = ["semb:" + hashlib.sha256(f"{embedding_model}\0{sentence}".encode()).hexdigest() for sentence in sentences]
    try:
        cached = cache.get_many(keys)
    except Exception:  # a cache outage must not take answers down with it
        cached = {}
    missing = [i for i, key in enumerate(keys) if key not in cached]
    vectors: list[np.ndarray | None] = [
        np.frombuffer(cached[key], dtype=np.float32) if key in cached else None for key in keys
    ]
    if missing:
        computed = np.asarray(
            embedder_get(embedding_model).embed_documents([sentences[i] for i in missing]), dtype=np.float32
        )
        for i, vector in zip(missing, computed, strict=True):
            vectors[i] = vector
        try:
            cache.set_many({keys[i]: vectors[i].tobytes() for i in missing}, SENTENCE_CACHE_SECONDS)
        except Exception:
            logger.warning("sentence embedding cache unavailable", exc_info=True)
    return np.stack(vectors)


def _normalised(vectors) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms == 0, 1.0, norms)


def _passage_vectors(embedding_model: str, sources: Sequence[Source], units: list[Unit]) -> np.ndarray | None:
    """The stored embedding of each unit's chunk (rows of zeros where there is none)."""
    ids = {source.number: source.chunk_id for source in sources}
    try:
        rows = dict(
            Chunk.objects.filter(pk__in=set(ids.values()), embedding_model=embedding_model).values_list(
                "pk", "embedding"
            )
        )
    except DatabaseError as exc:
        logger.warning("passages scored without their embeddings (%s)", exc)
        return None
    if not rows:
        return None
    size = len(next(iter(rows.values())))
    zero = np.zeros(size, dtype=np.float32)
    vectors = [np.asarray(rows.get(ids.get(unit.number), zero), dtype=np.float32) for unit in units]
    if any(len(vector) != size for vector in vectors):
        return None
    return _normalised(np.stack(vectors))


# A number and its counter as one term (search.analysis.japanese: "2026年度", "3四半期").
_COMPOUND = re.compile(r"^[0-9][0-9.]*[^0-9.]+$")
_COMPOUND_NUMBER = re.compile(r"^[0-9]+(?:\.[0-9]+)?")


CONFLICT_PENALTY = 0.3
# In the ranking only: a sentence stating other numbers of the kind the question names.
NUMBER_CONFLICT_PENALTY = 0.15


def _counter(compound: str) -> str:
    return compound.lstrip("0123456789.")


def _names_another(question_terms: frozenset[str], context_terms: frozenset[str]) -> bool:
    """Whether the context names, with a counter the question uses (年度, 四半期), only other
    numbers than the question's."""
    asked: dict[str, set[str]] = {}
    for term in question_terms:
        if _COMPOUND.match(term):
            asked.setdefault(_counter(term), set()).add(term)
    for counter, wanted in asked.items():
        named = {term for term in context_terms if _COMPOUND.match(term) and _counter(term) == counter}
        if named and not named & wanted:
            return True
    return False


_NUMERALS_JA = frozenset("万 億 兆".split())


def _without_compound_parts(terms: set[str]) -> set[str]:
    """A question's terms less the pieces of its number compounds (2026年度: 年度), and less its
    amounts of money (300000円) and their 万/億: those are compared as numbers, which also reads
    a range ("8万円超 40万円以下")."""
    compounds = [term for term in terms if _COMPOUND.match(term)]
    return {
        term
        for term in terms
        if not any(term != c and term in c for c in compounds)
        and term not in _NUMERALS_JA
        and not (_COMPOUND.match(term) and _counter(term) == "円")
    }


def _compounds_held(terms: frozenset[str], lexemes: frozenset[str]) -> set[str]:
    """The English terms a sentence holds as the end of a compound: "load" in "payload",
    "book" in "handbook" (four letters or more, three more in the compound)."""
    compounds = [word for word in lexemes if word.isascii()]
    return {
        term
        for term in terms
        if len(term) >= 4 and term.isascii() and any(len(w) >= len(term) + 3 and w.endswith(term) for w in compounds)
    }


def _term_weights(scored: Scored, terms: frozenset[str], numbers: int) -> dict[str, float]:
    """How informative each question term is among these sources: a term that most of their
    sentences hold ("call" in an on-call handbook) tells them apart less than a rare one."""
    count = max(len(scored.units), 1)
    # A term of a heading or a document's title is held by every sentence under it.
    seen = [own | around for own, around in zip(scored.lexemes, scored.context_lexemes, strict=True)]
    weights = {term: math.log(1 + count / (1 + sum(term in lexemes for lexemes in seen))) for term in terms}
    top = max(weights.values(), default=1.0)
    weights.update({f"#{i}": top for i in range(numbers)})  # a number asked for is as telling as any term
    return weights


def _against(scored: Scored, question: str, terms: frozenset[str], told: frozenset[str] = frozenset()) -> Against:
    """The units scored against one question.

    ``relevance`` (what abstention is calibrated on): cosine + ``COVERAGE_WEIGHT`` x the share
    of the question's terms held, each weighed by how rare it is among the sources' sentences
    (``_term_weights``; a term only in the heading or lead-in counts ``CONTEXT_WEIGHT``), less
    ``ANSWER_KIND_PENALTY`` where the sentence cannot be what the question asks for.
    ``ranking`` (which sentence to quote): the same, plus ``PASSAGE_WEIGHT`` x the
    cosine of the sentence's whole chunk, which says what a short sentence is about when its
    own words do not ("Lost or stolen security keys ..." in a chunk about YubiKeys).
    """
    # A number a compound term already holds (2026年度: 2026) is not counted twice.
    compounded = {float(_COMPOUND_NUMBER.match(term).group()) for term in terms if _COMPOUND.match(term)}
    numbers = tuple(number for number in numbers_of(question) if number.value not in compounded)
    kind = answer_kind(question)
    weights = _term_weights(scored, terms, len(numbers))
    weights.update({term: CIRCUMSTANCE_WEIGHT * weights[term] for term in told & terms})
    total_weight = sum(weights.values()) or 1.0
    size = max(min(len(terms) + len(numbers), LEXICAL_COVERAGE_TERMS), 1)
    held, context_held, coverage, weighted, headed, fits = [], [], [], [], [], []
    other_numbers = []
    for unit, own, around in zip(scored.units, scored.lexemes, scored.context_lexemes, strict=True):
        numbers_held = _numbers_held(numbers, unit.sentence)
        unit_held = (terms & own) | {f"#{i}" for i in numbers_held} | _compounds_held(terms - own, own)
        # It states numbers of the kind the question names, and not the question's: another case
        # ("10 minutes without acknowledgement" when half an hour is asked about).
        other_numbers.append(
            bool(numbers)
            and not numbers_held
            and any(n.currency == q.currency for n in numbers_of(unit.sentence) for q in numbers)
        )
        context_only = (terms & around) - unit_held
        held.append(frozenset(unit_held))
        context_held.append(frozenset(context_only))
        coverage.append(min((len(unit_held) + CONTEXT_WEIGHT * len(context_only)) / size, 1.0))
        share = sum(weights[t] for t in unit_held) + CONTEXT_WEIGHT * sum(weights[t] for t in context_only)
        weighted.append(share / total_weight)
        headed.append(sum(weights[t] for t in terms & around) / total_weight)
        fits.append(holds_kind(kind, unit.sentence))
    unfit = np.where(np.array(fits, dtype=bool), 0.0, ANSWER_KIND_PENALTY)
    penalty = np.zeros(len(fits)) if kind is not None and kind.ranking_only else unfit
    # What stands above a sentence (its heading, a Japanese document's title) names another
    # year or quarter than the question ("2026年度第1四半期" asked, "第2四半期 売上報告" above):
    # the sentence is about that one.
    conflicts = [_names_another(terms, around) for around in scored.context_lexemes]
    penalty = penalty + np.where(np.array(conflicts, dtype=bool), CONFLICT_PENALTY, 0.0)
    dense = passage = None
    if scored.vectors is not None and scored.embedding_model:
        try:
            query = _normalised(query_embedding(scored.embedding_model, question))
        except (EmbedderError, OSError, RuntimeError, ValueError) as exc:
            logger.warning("question scored without embeddings (%s)", exc)
        else:
            dense = (scored.vectors @ query).astype(np.float64)
            if scored.passage_vectors is not None:
                passage = (scored.passage_vectors @ query).astype(np.float64)
    if dense is not None:
        relevance = dense + COVERAGE_WEIGHT * np.array(weighted, dtype=np.float64) - penalty
        ranking = relevance.copy()
    else:  # the coverage is the whole score (ABSTAIN_BELOW_LEXICAL is on that scale)
        relevance = np.array(coverage, dtype=np.float64) - penalty
        ranking = np.array(weighted, dtype=np.float64) - penalty
    if kind is not None and kind.ranking_only:
        ranking = ranking - unfit
    ranking = ranking - np.where(np.array(other_numbers, dtype=bool), NUMBER_CONFLICT_PENALTY, 0.0)
    if passage is not None:
        ranking = ranking + PASSAGE_WEIGHT * passage
    # A section whose heading names what the question asks about answers it more surely than a
    # sentence elsewhere that holds the same words (「第4条（国内出張の日当・宿泊費）」 above the
    # table of per-diems, not the article on who the rules apply to): a title field, as BM25F has.
    ranking = ranking + HEADING_WEIGHT * np.array(headed, dtype=np.float64)
    # "Core hours: 09:00 - 13:00 UTC" answers "What are the core hours?" more directly than
    # "Outside core hours you organise your own schedule", which holds the same terms.
    labelled = np.array([bool(label) and label <= terms for label in scored.label_lexemes], dtype=bool)
    ranking = ranking + np.where(labelled, LABEL_BONUS, 0.0)
    return Against(
        question=question,
        terms=terms,
        numbers=numbers,
        kind=kind,
        held=held,
        context_held=context_held,
        dense=dense,
        relevance=np.asarray(relevance, dtype=np.float64),
        ranking=np.asarray(ranking, dtype=np.float64),
    )


def abstain_below(embedding_model: str | None, *, lexical_only: bool = False, read: bool = False) -> float:
    """The relevance below which the sources are taken not to answer, for sentences scored
    by the reader (``read``), or else with ``embedding_model`` (or without embeddings)."""
    if read and lexical_only:
        return READER_ABSTAIN_BELOW_LEXICAL
    if read:
        return READER_ABSTAIN_BELOW_BY_MODEL.get(embedding_model or "", READER_ABSTAIN_BELOW)
    if lexical_only:
        return ABSTAIN_BELOW_LEXICAL
    return ABSTAIN_BELOW_BY_MODEL.get(embedding_model or "", ABSTAIN_BELOW)


def relevance_of(scored: Scored, *, threshold: float | None = None) -> Relevance:
    """Whether the scored sources answer the question, and which come closest."""
    lexical_only = scored.lexical_only or (scored.whole is not None and scored.whole.dense is None)
    if threshold is None:
        threshold = abstain_below(scored.embedding_model, lexical_only=lexical_only, read=bool(scored.reader))
    if scored.whole is None:
        return Relevance(score=-1.0, closest=[], abstain=True, lexical_only=lexical_only, unread=scored.unread)
    best_by_number: dict[int, float] = {}
    for against in [scored.whole, *scored.parts]:
        for unit, value in zip(scored.units, against.relevance, strict=True):
            best_by_number[unit.number] = max(best_by_number.get(unit.number, -math.inf), float(value))
    by_number = {source.number: source for source in scored.sources}
    ranked = sorted(best_by_number.items(), key=lambda item: (-item[1], item[0]))[:CLOSEST]
    closest = [
        {
            "number": number,
            "chunk_id": by_number[number].chunk_id,
            "document_id": by_number[number].document_id,
            "title": by_number[number].title,
            "score": round(value, 4),
        }
        for number, value in ranked
        if number in by_number
    ]
    score = scored.best
    return Relevance(
        score=round(score, 4),
        closest=closest,
        abstain=score < threshold,
        lexical_only=lexical_only,
        reader=scored.reader,
        unread=scored.unread,
    )


def declined_text(closest: list[dict], language: str = analysis.ENGLISH) -> str:
    """What an answer that abstains says, in the question's ``language``: ``NOT_ANSWERED``,
    then the closest passages, one line a document with its passages' numbers, nearest first
    ("- Remote Work Policy [2][5]")."""
    by_title: dict[str, list[int]] = {}
    for passage in closest:
        by_title.setdefault(passage["title"], []).append(passage["number"])
    not_answered = wording.said("not_answered", language)
    if not by_title:
        return not_answered
    listed = [f"- {title} " + "".join(f"[{number}]" for number in numbers) for title, numbers in by_title.items()]
    return "\n".join([not_answered, "", wording.said("closest_lead", language), *listed])


def relevance(
    question: str,
    sources: Sequence[Source],
    *,
    embedding_model: str | None,
    text_search_config: str | None = None,
    threshold: float | None = None,
) -> Relevance:
    """Whether ``sources`` answer ``question``: decline (``abstain``) below the threshold."""
    scored = sentences_score(question, sources, embedding_model=embedding_model, text_search_config=text_search_config)
    return relevance_of(scored, threshold=threshold)
