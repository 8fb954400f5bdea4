"""One rule, shared by Python and SQL, for how text is split before full-text indexing.

PostgreSQL's default parser keeps hyphenated compounds, decimals and path-like strings
as single tokens (``high-speed`` -> ``high-spe``, ``high``, ``speed``; ``m=2.5`` -> one
token). Splitting ASCII punctuation first, as Lucene's standard tokenizer and BM25
libraries do, raised BM25 nDCG@10 on Cranfield from 0.364 to 0.375 (docs/search.md).
Letters outside ASCII are untouched, so other languages keep their words.
"""

from __future__ import annotations

import re
import string

# string.punctuation: the 32 ASCII punctuation characters.
ASCII_PUNCTUATION = string.punctuation
_PUNCTUATION_RE = re.compile("[" + re.escape(ASCII_PUNCTUATION) + "]+")


def punctuation_split(text: str) -> str:
    """Python twin of the SQL function ``search_text_normalize``."""
    return _PUNCTUATION_RE.sub(" ", text)
