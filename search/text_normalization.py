"""One rule, shared by Python and SQL, for how text is split before full-text indexing.

PostgreSQL's default parser keeps hyphenated compounds, decimals and path-like strings
as single tokens (``high-speed`` -> ``high-spe``, ``high``, ``speed``; ``m=2.5`` -> one
token). Splitting ASCII punctuation first, as Lucene's standard tokenizer and BM25
libraries do, raised BM25 nDCG@10 on Cranfield from 0.364 to 0.375 (docs/search.md).
Letters outside ASCII are untouched, so other languages keep their words.

The ``search_english`` configuration (the default) analyses English as Lucene's
``EnglishAnalyzer`` and bm25s do: these 33 stop words are removed as words, before
stemming, and every other word is stemmed (Snowball). PostgreSQL's own ``english``
configuration drops 127 words after its own rules; docs/search.md says why BM25 follows
the reference convention instead.
"""

from __future__ import annotations

import re
import string

# string.punctuation: the 32 ASCII punctuation characters.
ASCII_PUNCTUATION = string.punctuation
_PUNCTUATION_RE = re.compile("[" + re.escape(ASCII_PUNCTUATION) + "]+")

# The configuration whose stop words are removed before PostgreSQL parses the text.
SEARCH_ENGLISH = "search_english"
# Japanese chunks and queries: words analysed in Python (search.analysis), then read as search_english reads.
SEARCH_JAPANESE = "search_japanese"
# Lucene's ENGLISH_STOP_WORDS_SET, which is also bm25s's "en" list. The SQL function
# search_tsvector holds the same words (a test keeps them equal).
ENGLISH_STOP_WORDS = (
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not",
    "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was",
    "will", "with",
)  # fmt: skip
# Whole words only: \w on both sides, as PostgreSQL's \m and \M see word boundaries.
_STOP_WORDS_RE = re.compile(r"(?<!\w)(?:" + "|".join(ENGLISH_STOP_WORDS) + r")(?!\w)", re.IGNORECASE)


def punctuation_split(text: str) -> str:
    """Python twin of the SQL function ``search_text_normalize``."""
    return _PUNCTUATION_RE.sub(" ", text)


def text_prepare(text: str, config: str) -> str:
    """Python twin of what ``search_tsvector(config, text)`` feeds ``to_tsvector``: the
    punctuation split, then (``search_english`` only) the stop words removed."""
    text = punctuation_split(text)
    if config in (SEARCH_ENGLISH, SEARCH_JAPANESE):
        text = _STOP_WORDS_RE.sub(" ", text)
    return text
