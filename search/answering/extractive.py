"""The answer without a generation model: the sentences of the sources that answer the question.

Used when no generation model serves, so that a fresh install with only the embedded stack still
answers. The text quotes whole sentences of the sources (``search.answering.abstention.sentence_units``:
never a heading, no bullets, a table row with its column names), one a line, each followed by
its source's ``[n]``, under a line saying that it is extracted, not generated.

Sentences are ranked by ``search.answering.abstention.sentences_score`` (``Against.ranking``), less 0.02
per rank of their source so that ties go to the better chunk. Which are quoted depends on the
question, not on a count (``max_sentences`` at most):

- for a question in parts ("What is X, and how long is Y?"), the best sentence for each part,
  scored against that part alone, in the order of the parts;
- else the best sentence, then others, best first, only while they hold question terms that no
  quoted sentence (nor its heading) holds yet, score within ``CLOSE_TO_BEST`` of the best and
  would pass for an answer alone;
- with either, the next sentence under the same heading when it scores within ``SIBLING_CLOSE``;
- a sentence of a short list item is quoted with the rest of its item (``Unit.item``);
- a question that names a document and nothing in it ("Tell me about the travel policy") gets
  the document's opening sentences (``_document_lead``); one that asks for the latest, only
  sentences of the newest dated document among the sources (``_not_latest``).

When ``search.answering.abstention`` finds that the sources do not answer the question, nothing is quoted:
the answer says so (``NOT_ANSWERED``) and lists the closest passages by title and ``[n]``.
docs/answers.md, "Extractive answers and abstention", has the reasons and the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from search import analysis
from search.answering import wording
from search.answering.abstention import (
    CLOSEST_LEAD,
    NOT_ANSWERED,
    Against,
    Scored,
    Unit,
    abstain_below,
    declined_text,
    question_parts,
    relevance_of,
    sentence_units,
    sentences_of,
    sentences_score,
)
from search.answering.prompting import Source

__all__ = [
    "CLOSEST_LEAD",
    "LEAD",
    "NOTHING_FOUND",
    "NOT_ANSWERED",
    "Extract",
    "ExtractiveAnswer",
    "extractive_answer",
    "question_parts",
    "sentence_units",
    "sentences_of",
]

MAX_SENTENCES = 3
RANK_PENALTY = 0.02
CLOSE_TO_BEST = 0.1
# A sentence under the same heading as the best one, scoring this close to it, is quoted too:
# an FAQ's answer is often two sentences ("10 hours of typical operation", "7.5 hours under
# heavy load").
SIBLING_CLOSE = 0.05
# How many opening sentences answer a question about a whole document (``_document_lead``).
LEAD_SENTENCES = 2
# A list item of several sentences is quoted whole up to this length (``Unit.item``).
MAX_ITEM_CHARS = 300
# A part of a question that the sources answer less well than the whole question still gets
# its best sentence down to this far below the abstention threshold: its words are fewer, so
# its sentences score lower ("What should I do if I lose my YubiKey" against "Lost or stolen
# security keys must be reported ...").
PART_MARGIN = 0.3
LEAD = wording.said("extracted", analysis.ENGLISH, why=wording.NO_MODEL)
NOTHING_FOUND = wording.said("nothing_found", analysis.ENGLISH)


@dataclass(frozen=True)
class Extract:
    number: int
    sentence: str
    score: float


@dataclass(frozen=True)
class ExtractiveAnswer:
    text: str
    extracts: list[Extract]
    abstained: bool = False
    # The nearest passages, best first: {number, chunk_id, document_id, title, score}.
    closest: list[dict] = field(default_factory=list)
    relevance: float | None = None  # search.answering.abstention's score of the sources (None: no source)
    decided_by: dict = field(default_factory=dict)  # ``Relevance.decided_by``: the reader, or why not


def extractive_answer(
    question: str,
    sources: Sequence[Source],
    *,
    embedding_model: str | None,
    text_search_config: str | None = None,
    max_sentences: int = MAX_SENTENCES,
    lead: str = LEAD,
    language: str = analysis.ENGLISH,
) -> ExtractiveAnswer:
    """The sentences of ``sources`` that answer ``question``, under ``lead``; or, when the
    sources do not answer it, ``NOT_ANSWERED`` and the closest passages (``abstained``), said
    in the question's ``language``."""
    scored = sentences_score(question, sources, embedding_model=embedding_model, text_search_config=text_search_config)
    if not scored.units:
        return ExtractiveAnswer(text=wording.said("nothing_found", language), extracts=[], abstained=True)
    relevance = relevance_of(scored)
    if relevance.abstain:
        return ExtractiveAnswer(
            text=declined_text(relevance.closest, language),
            extracts=[],
            abstained=True,
            closest=relevance.closest,
            relevance=relevance.score,
            decided_by=relevance.decided_by(),
        )
    threshold = abstain_below(scored.embedding_model, lexical_only=relevance.lexical_only, read=bool(relevance.reader))
    # What each unit's place costs it: RANK_PENALTY per rank of its source, and everything
    # when the question asks for the latest and its document is not (``_not_latest``).
    place_costs = RANK_PENALTY * np.array([unit.number - 1 for unit in scored.units], dtype=np.float64)
    if analysis.asks_for_latest(question):
        place_costs = place_costs + np.where(_not_latest(scored), np.inf, 0.0)
    chosen = _choose(scored, place_costs, threshold, max(max_sentences, 1))
    scores = scored.whole.ranking - place_costs
    extracts: list[Extract] = []
    for i in chosen:
        quoted = _quoted(scored.units[i])
        if not any(extract.number == scored.units[i].number and extract.sentence == quoted for extract in extracts):
            extracts.append(Extract(scored.units[i].number, quoted, round(float(scores[i]), 4)))
    return ExtractiveAnswer(
        text="\n".join([lead, "", *(f"- {extract.sentence} [{extract.number}]" for extract in extracts)]),
        extracts=extracts,
        abstained=False,
        closest=relevance.closest,
        relevance=relevance.score,
        decided_by=relevance.decided_by(),
    )


def _quoted(unit: Unit) -> str:
    """What is quoted for a unit: its whole list item when it is one sentence of a short item
    (the item's sentences say one rule together), else the sentence."""
    return unit.item if unit.item and len(unit.item) <= MAX_ITEM_CHARS else unit.sentence


def _not_latest(scored: Scored) -> np.ndarray:
    """Per unit: whether its source is a dated document older than the newest one among the
    sources. 「直近の四半期に新しく稼働したサイトは」 is answered from the latest report, not from
    an older one whose sentence words it more closely (「当四半期の新規稼働サイトは5拠点です」)."""
    dates = {source.number: source.document_date for source in scored.sources}
    newest = max((date for date in dates.values() if date), default=None)
    return np.array([bool(dates.get(unit.number)) and dates[unit.number] != newest for unit in scored.units])


def _document_lead(scored: Scored, limit: int) -> list[int]:
    """For a question that names a document and nothing in it (「最新の売上報告を教えてください」,
    "Tell me about the travel policy": every term of the question is in the best source's
    title, and it asks for no kind of answer), the document's opening sentences, as a
    summary (what reports, rules and minutes put first); else nothing."""
    whole = scored.whole
    if whole.kind is not None or scored.parts or not whole.terms or not scored.sources:
        return []
    best = scored.sources[0]
    if not whole.terms <= scored.title_lexemes.get(best.number, frozenset()):
        return []
    starts = {source.number: source.start_offset for source in scored.sources if source.document_id == best.document_id}
    # Labelled lines ("発行日：…", a table row with its column names) are the document's
    # particulars, not what it says.
    opening = [i for i, unit in enumerate(scored.units) if unit.number in starts and not unit.label]
    return sorted(opening, key=lambda i: (starts[scored.units[i].number], i))[: min(limit, LEAD_SENTENCES)]


def _choose(scored: Scored, place_costs: np.ndarray, threshold: float, limit: int) -> list[int]:
    """The units to quote, in the order they are quoted."""
    lead = _document_lead(scored, limit)
    if lead:
        return lead
    if scored.parts:
        # Each part on its own: the best sentence for the whole question often answers one
        # part only ("payload" outweighs "battery"). A part the sources do not answer gets
        # nothing rather than its nearest miss.
        chosen: list[int] = []
        for part in scored.parts:
            if part.best < threshold - PART_MARGIN:
                continue
            for index in _best_with_siblings(scored, part, place_costs):
                if index not in chosen and len(chosen) < limit:
                    chosen.append(index)
        if chosen:
            return chosen
    whole = scored.whole
    scores = whole.ranking - place_costs
    chosen = _best_with_siblings(scored, whole, place_costs)[:limit]
    covered = set().union(*(whole.held[i] | whole.context_held[i] for i in chosen))
    for index in sorted(range(len(scores)), key=lambda i: (-scores[i], i)):
        if len(chosen) >= limit or scores[index] < scores[chosen[0]] - CLOSE_TO_BEST:
            break
        # Another sentence only for what the quoted ones leave out, not to say it again, and
        # only one that would pass for an answer by itself.
        if index not in chosen and whole.held[index] - covered and whole.relevance[index] >= threshold:
            chosen.append(index)
            covered |= whole.held[index] | whole.context_held[index]
    return chosen


def _best_with_siblings(scored: Scored, against: Against, place_costs: np.ndarray) -> list[int]:
    """The best unit for a question, and the next one if it stands under the same heading and
    scores nearly as well; in the sources' order."""
    scores = against.ranking - place_costs
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    best = order[0]
    chosen = [best]
    if len(order) > 1:
        second, first = scored.units[order[1]], scored.units[best]
        same_heading = second.number == first.number and second.context and second.context == first.context
        if same_heading and scores[order[1]] >= scores[best] - SIBLING_CLOSE:
            chosen = sorted([best, order[1]])
    return chosen
