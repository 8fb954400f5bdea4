"""What a user typed, split into what ranks and what filters.

Plain words are optional: a chunk matching any of them is a candidate and BM25 ranks
by how well it matches (requiring every word of a natural-language question, as
``websearch_to_tsquery`` does, scores 0.02 nDCG@10 on Cranfield against 0.37 for BM25).

Two kinds of input. A search-box query honours syntax a user types on purpose:
``"quoted phrases"`` must appear, ``-word`` and ``-"phrase"`` must not, and ``OR``
between words is accepted (it is what plain words already mean). A question (answers,
``/v1/chat/completions``, evaluation, and a search-box query that reads as a sentence)
has no syntax: its quotation marks quote, its hyphens join, and every word ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from search.text_normalization import text_prepare

SYNTAXES = ("auto", "search", "question")
# A search-box query of this many words reads as a sentence (typed syntax is short:
# `"boundary layer" transition -laminar`); so does one that ends with a question mark.
QUESTION_MIN_WORDS = 8

_TOKEN = re.compile(r'(-?)"([^"]*)"|(\S+)')
# A question mark (ASCII or full-width) and then only closing quotes, brackets or spaces.
_QUESTION_END = re.compile("[?\uff1f][\"'\u201d\u2019\u00bb)\\]\\s]*$")


@dataclass(frozen=True)
class ParsedQuery:
    optional: list[str] = field(default_factory=list)
    phrases: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    # What the text was read as: "search" (typed syntax honoured) or "question".
    syntax: str = "search"

    @property
    def rank_text(self) -> str:
        """The words BM25 scores, repeats kept: optional words and the words of required phrases."""
        return " ".join(self.optional + self.phrases)

    def analysed(self, analyse: Callable[[str], str]) -> ParsedQuery:
        """The same query with each word and phrase replaced by ``analyse``'s terms for it (a
        language PostgreSQL cannot split, search.analysis); what has no term is dropped."""
        return ParsedQuery(
            optional=[terms for word in self.optional if (terms := analyse(word))],
            phrases=[terms for phrase in self.phrases if (terms := analyse(phrase))],
            excluded=[terms for word in self.excluded if (terms := analyse(word))],
            syntax=self.syntax,
        )

    def required_websearch(self, config: str) -> str:
        """A ``websearch_to_tsquery`` string for what must (not) match.

        Each phrase is prepared exactly as the indexed text is (``search_tsvector``:
        punctuation split, and the configuration's stop words removed), so that
        ``"high-speed flow"`` matches the lexemes ``high speed flow`` in sequence.
        """
        parts = [f'"{words}"' for phrase in self.phrases if (words := _words(phrase, config))]
        parts += [f'-"{words}"' for term in self.excluded if (words := _words(term, config))]
        return " ".join(parts)


def _words(text: str, config: str) -> str:
    # Also removes the characters that websearch_to_tsquery reads as syntax (" - ( )).
    return " ".join(text_prepare(text, config).split())


def reads_as_question(text: str) -> bool:
    """Whether a search-box query is a sentence rather than typed syntax."""
    return bool(_QUESTION_END.search(text)) or len(text.split()) >= QUESTION_MIN_WORDS


def query_parse(text: str, *, syntax: str = "search") -> ParsedQuery:
    """Split a query; ``syntax`` is ``search``, ``question`` or ``auto`` (a search-box
    query, read as a question when it reads as a sentence)."""
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown query syntax {syntax!r}: use one of {', '.join(SYNTAXES)}")
    if syntax == "auto":
        syntax = "question" if reads_as_question(text) else "search"
    if syntax == "question":
        return ParsedQuery(optional=text.split(), syntax="question")
    optional: list[str] = []
    phrases: list[str] = []
    excluded: list[str] = []
    for match in _TOKEN.finditer(text):
        negated, phrase, word = match.groups()
        if phrase is not None:
            phrase = " ".join(phrase.split())
            if phrase:
                (excluded if negated else phrases).append(phrase)
        elif word == "OR":
            continue
        elif word.startswith("-") and len(word) > 1:
            excluded.append(word[1:])
        elif word not in {"-"}:
            optional.append(word)
    return ParsedQuery(optional=optional, phrases=phrases, excluded=excluded, syntax="search")
