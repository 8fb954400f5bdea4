"""What a user typed, split into what ranks and what filters.

Plain words are optional: a chunk matching any of them is a candidate and BM25 ranks
by how well it matches (requiring every word of a natural-language question, as
``websearch_to_tsquery`` does, scores 0.02 nDCG@10 on Cranfield against 0.37 for BM25).
Syntax a user types on purpose is honoured as a filter: ``"quoted phrases"`` must
appear, ``-word`` and ``-"phrase"`` must not, and ``OR`` between words is accepted (it is
what plain words already mean).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from search.text_normalization import punctuation_split

_TOKEN = re.compile(r'(-?)"([^"]*)"|(\S+)')


@dataclass(frozen=True)
class ParsedQuery:
    optional: list[str] = field(default_factory=list)
    phrases: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)

    @property
    def rank_text(self) -> str:
        """The words BM25 scores: optional words and the words of required phrases."""
        return " ".join(self.optional + self.phrases)

    @property
    def required_websearch(self) -> str:
        """A ``websearch_to_tsquery`` string for what must (not) match.

        Punctuation is split exactly as in the indexed text (``search_text_normalize``),
        so ``"high-speed flow"`` matches the lexemes ``high speed flow`` in sequence.
        """
        parts = [f'"{_words(phrase)}"' for phrase in self.phrases if _words(phrase)]
        parts += [f'-"{_words(term)}"' for term in self.excluded if _words(term)]
        return " ".join(parts)

    @property
    def optional_websearch(self) -> str:
        """A ``websearch_to_tsquery`` string matching any optional word."""
        return " or ".join(piece for word in self.optional for piece in _words(word).split())

    @property
    def highlight_websearch(self) -> str:
        """Every positive word, for marking matches in snippets."""
        return " or ".join(_words(self.rank_text).split())


def _words(text: str) -> str:
    # Also removes the characters that websearch_to_tsquery reads as syntax (" - ( )).
    return " ".join(punctuation_split(text).split())


def query_parse(text: str) -> ParsedQuery:
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
    return ParsedQuery(optional=optional, phrases=phrases, excluded=excluded)
