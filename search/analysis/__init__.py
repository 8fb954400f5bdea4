"""What a word and a sentence are, per language: the one module that reads words.

Lucene's analyzers are the model: one chain per language, the same at index and at query
time. English (and any language a PostgreSQL configuration splits by spaces) is analysed
inside PostgreSQL by ``search_tsvector`` under the collection's configuration. Japanese
has no spaces between words and PostgreSQL no Japanese parser, so a Japanese text is
analysed here (``japanese``: MeCab with UniDic, after NFKC), and its terms, joined by
spaces, are what PostgreSQL indexes under ``search_japanese`` (a copy of
``search_english``: Latin words inside Japanese text are stemmed as in English text, so
the two languages share one term space). docs/search.md, "Japanese".
"""

from __future__ import annotations

import re

# japanese loads MeCab's dictionary on its first Japanese text, not when imported.
from search.analysis import japanese
from search.analysis.languages import AUTO, ENGLISH, JAPANESE, LANGUAGES, language_of

__all__ = [
    "AUTO",
    "ENGLISH",
    "JAPANESE",
    "JAPANESE_CONFIG",
    "LANGUAGES",
    "analysed",
    "asks_for_latest",
    "language_of",
    "language_resolved",
    "words",
]

# The text-search configuration of Japanese chunks and queries: its input is this module's terms.
JAPANESE_CONFIG = "search_japanese"


def language_resolved(setting: str, text: str) -> str:
    """The language ``text`` is analysed in under a collection's ``setting`` (``auto``: its own)."""
    return language_of(text) if setting == AUTO else setting


def analysed(text: str, *, language: str, config: str) -> tuple[str, str | None]:
    """How ``text`` is indexed or queried: (text-search configuration, pre-analysed terms).

    ``language`` is a collection's setting (``auto``, ``ja``, ``en``), ``config`` its
    configuration for text PostgreSQL splits itself. The terms are None when PostgreSQL
    analyses the text itself; for Japanese they are the words' lemmas joined by spaces.
    """
    if language_resolved(language, text) != JAPANESE:
        return config, None
    return JAPANESE_CONFIG, " ".join(japanese.terms(text))


_LATIN_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The words of ``text`` as written, in order: a Japanese text's by morphological
    analysis (symbols left out), any other's runs of word characters."""
    if language_of(text) != JAPANESE:
        return _LATIN_WORD.findall(text)
    return [token.surface for token in japanese.tokens(text) if not token.symbol and not token.compound]


# A question that asks for the newest of several documents of one kind: 「最新の売上報告」,
# "the latest sales report". Search then puts dated documents newest first (search.selectors).
_LATEST = re.compile(r"最新|直近|一番新しい|最も新しい|\blatest\b|\bmost recent\b|\bnewest\b", re.IGNORECASE)


def asks_for_latest(text: str) -> bool:
    return bool(_LATEST.search(text))
