"""Snippets of a Japanese passage with the query's words marked.

PostgreSQL's ``ts_headline`` marks English (its parser finds the words); in a Japanese
passage it sees one "word" per run of text, so here the analysis module's tokens, with
their offsets in the text as written, say which words match the query's terms.
"""

from __future__ import annotations

import html

from search.analysis import japanese

# About two lines of Japanese: ts_headline's 20-40 English words hold about as much.
SNIPPET_CHARS = 120
ELLIPSIS = "…"


def snippet_html(text: str, terms: list[str]) -> str:
    """The stretch of ``text`` holding the most of ``terms``, HTML-escaped, matches in ``<mark>``."""
    wanted = {term.lower() for term in terms}
    tokens = japanese.tokens(text)
    matched = [token for token in tokens if token.term and token.term in wanted]
    start = _best_start(text, matched)
    end = min(len(text), start + SNIPPET_CHARS)
    parts = [ELLIPSIS] if start > 0 else []
    position = start
    for token in matched:
        if token.start < start or token.end > end or token.start < position:
            continue  # outside the window, or inside a compound already marked
        parts.append(_escaped(text[position : token.start]))
        parts.append(f"<mark>{_escaped(text[token.start : token.end])}</mark>")
        position = token.end
    parts.append(_escaped(text[position:end]))
    if end < len(text):
        parts.append(ELLIPSIS)
    return "".join(parts).strip()


def _best_start(text: str, matched) -> int:
    """Where the window with the most distinct matched terms starts (0 with none)."""
    best, best_count = 0, 0
    for index, first in enumerate(matched):
        seen = {token.term for token in matched[index:] if token.end <= first.start + SNIPPET_CHARS}
        if len(seen) > best_count:
            best, best_count = first.start, len(seen)
    if best and best_count:
        # Begin at the sentence or line the first match is in, when that is near.
        window = text[max(0, best - SNIPPET_CHARS // 4) : best]
        cut = max(window.rfind(mark) for mark in "。！？\n")
        best = best - len(window) + cut + 1 if cut >= 0 else best
    # A window that would run past the end starts earlier, so the snippet stays full.
    return min(best, max(0, len(text) - SNIPPET_CHARS))


def _escaped(piece: str) -> str:
    return html.escape(" ".join(piece.split()) if piece.strip() else (" " if piece else ""))
