"""Split normalised document text into overlapping, token-bounded chunks for embedding.

The text is tokenised once by a caller-supplied tokenizer (the embedding model's, so token
counts are the model's), and chunk boundaries are then chosen among token boundaries, preferring
headings, paragraph breaks, sentence ends (English and Japanese: search.analysis.sentences) and line
breaks, in that order. Pure Python, no Django.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from search.analysis.sentences import ends_japanese_sentence

__all__ = ["TextChunk", "Tokenize", "chunk_text", "whitespace_tokenize"]

Tokenize = Callable[[str], list[tuple[int, int]]]
"""Returns the (start, end) character offsets of each token of a text, in order."""


@dataclass(frozen=True)
class TextChunk:
    """One chunk: ``text == document_text[start:end]``, holding ``token_count`` whole tokens."""

    ordinal: int
    text: str
    start: int
    end: int
    token_count: int


_WORD_RE = re.compile(r"\S+")


def whitespace_tokenize(text: str) -> list[tuple[int, int]]:
    """A fallback tokenizer: the offsets of each run of non-whitespace characters."""
    return [match.span() for match in _WORD_RE.finditer(text)]


# How good a boundary between two tokens is; higher is better.
_NOT_ALLOWED = -1  # the cut would split tokens whose spans overlap
_TOKEN = 0  # between two tokens of the same word
_SPACE = 1
_LINE = 2
_SENTENCE = 3
_PARAGRAPH = 4
_HEADING = 5

# Cut points are chosen in the last ~30% of a full window, so chunks stay reasonably full.
_WINDOW_TAIL = 0.3
# A heading starts a new chunk once the current chunk holds at least ~25% of max_tokens;
# below that, the heading simply joins the small chunk rather than producing a tiny one.
_HEADING_MIN_FILL = 0.25

_BLANK_LINE_RE = re.compile(r"\n[^\S\n]*\n")
_SENTENCE_PUNCTUATION = ".!?\u2026"  # ... and the ellipsis character
# Closing/opening quotes and brackets, including typographic quotes and guillemets.
_CLOSERS = "\"')]}\u201d\u2019\u00bb"
_OPENERS = "\"'([{\u201c\u2018\u00ab"
# Words ending in "." that rarely end a sentence. ("etc." often does, so it is not here.)
_ABBREVIATIONS = frozenset(
    {
        "e.g.",
        "i.e.",
        "cf.",
        "vs.",
        "dr.",
        "mr.",
        "mrs.",
        "ms.",
        "prof.",
        "sr.",
        "jr.",
        "st.",
        "mt.",
        "fig.",
        "figs.",
        "eq.",
        "approx.",
        "inc.",
        "ltd.",
        "corp.",
        "dept.",
        "vol.",
        "al.",
        "gen.",
        "rev.",
        "capt.",
        "col.",
        "lt.",
        "sgt.",
    }
)
_DOTTED_INITIALISM_RE = re.compile(r"(?:[A-Za-z]\.){2,}")  # e.g. "U.S.", "a.m."
_INITIAL_RE = re.compile(r"[A-Z]\.")  # "J. Smith"


def chunk_text(
    text: str,
    *,
    tokenize: Tokenize,
    max_tokens: int = 254,
    overlap_tokens: int = 32,
    headings: Sequence[int] = (),
) -> list[TextChunk]:
    """Split ``text`` into chunks of at most ``max_tokens`` tokens, consecutive ones overlapping.

    ``tokenize`` is called once on the whole text. Each chunk ends at the best boundary in the
    last ~30% of its window: a heading (as soon as the chunk is ~25% full), else a blank line,
    a sentence end, a line break, a space, or any token boundary. The next chunk starts about
    ``overlap_tokens`` tokens earlier, moved forward to a sentence start when the overlap holds
    one, and never reaching back across a heading; the overlap is capped at half of
    ``max_tokens`` so every chunk adds new text. ``headings`` are character offsets where
    heading lines start. Chunks are trimmed of surrounding whitespace, and together they contain
    every token. Runs in O(n log n) for n tokens.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if overlap_tokens < 0:
        raise ValueError("overlap_tokens must not be negative")
    first = len(text) - len(text.lstrip())
    last = len(text.rstrip())
    if first >= last:
        return []
    # Zero-width tokens (special and padding tokens, offsets (0, 0)) cover no text: drop them.
    spans = [(int(start), int(end)) for start, end in tokenize(text) if end > start]
    if any(spans[k][0] < spans[k - 1][0] for k in range(1, len(spans))):
        spans.sort()
    chunker = _Chunker(text, spans, max_tokens=max_tokens, overlap_tokens=overlap_tokens, headings=headings)
    return chunker.chunks(first, last)


class _Chunker:
    """The state of one :func:`chunk_text` call: token arrays plus a cache of boundary ranks.

    A "cut" ``k`` is the boundary between token ``k - 1`` and token ``k``; a chunk is the token
    range ``[i, j)`` between two cuts.
    """

    def __init__(
        self,
        text: str,
        spans: list[tuple[int, int]],
        *,
        max_tokens: int,
        overlap_tokens: int,
        headings: Sequence[int],
    ) -> None:
        self.text = text
        self.starts = [start for start, _ in spans]
        self.ends = [end for _, end in spans]
        # reach[k]: the furthest character any of tokens 0..k covers. Cutting at k is only safe
        # when token k starts at or after reach[k - 1]; otherwise tokens would straddle the cut.
        self.reach: list[int] = []
        furthest = 0
        for end in self.ends:
            furthest = max(furthest, end)
            self.reach.append(furthest)
        self.n = len(spans)
        self.max_tokens = max_tokens
        self.overlap_tokens = min(overlap_tokens, max_tokens // 2)
        self.window_floor = max_tokens - max(1, round(max_tokens * _WINDOW_TAIL))
        self.heading_min_fill = max(1, math.ceil(max_tokens * _HEADING_MIN_FILL))
        self._ranks: list[int | None] = [None] * (self.n + 1)
        self.heading_cuts, self.heading_line_ends = self._heading_cuts(headings)
        self._heading_cut_set = set(self.heading_cuts)

    # -- boundaries ----------------------------------------------------------------------------

    def _heading_cuts(self, headings: Sequence[int]) -> tuple[list[int], list[int]]:
        """Token cuts where a heading line starts, and the character offset where each line ends."""
        cuts: dict[int, int] = {}
        for offset in headings:
            k = bisect_left(self.starts, offset)
            # Ignore offsets after the last token or inside a token. A heading at token 0 is kept:
            # it is never a cut, but the next chunk must not start inside its line either.
            if k < self.n and (k == 0 or self.reach[k - 1] <= offset <= self.starts[k]):
                line_end = self.text.find("\n", self.starts[k])
                cuts[k] = len(self.text) if line_end < 0 else line_end
        ordered = sorted(cuts)
        return ordered, [cuts[k] for k in ordered]

    def rank(self, k: int) -> int:
        """How good cut ``k`` (0 < k < n) is as a chunk boundary; cached, so O(1) amortised."""
        cached = self._ranks[k]
        if cached is not None:
            return cached
        previous_end, next_start = self.reach[k - 1], self.starts[k]
        if next_start < previous_end:
            result = _NOT_ALLOWED
        elif k in self._heading_cut_set:
            result = _HEADING
        else:
            gap = self.text[previous_end:next_start]
            has_space = any(char.isspace() for char in gap)
            has_newline = "\n" in gap
            if has_newline and _BLANK_LINE_RE.search(gap):
                result = _PARAGRAPH
            elif (
                has_space
                and self._ends_sentence(previous_end)
                and (has_newline or _starts_sentence(self.text[next_start]))
            ):
                result = _SENTENCE
            elif ends_japanese_sentence(self.text, previous_end):
                # 。！？ end a Japanese sentence with no space after them.
                result = _SENTENCE
            elif has_newline:
                result = _LINE
            elif has_space:
                result = _SPACE
            else:
                result = _TOKEN
        self._ranks[k] = result
        return result

    def _ends_sentence(self, position: int) -> bool:
        """Whether the text just before ``position`` ends a sentence (". ! ?" not in "e.g.", "Dr.")."""
        text = self.text
        index = position - 1
        # Look through closing quotes/brackets: 'He said "Stop." Then' ends after the quote.
        for _ in range(3):
            if index >= 0 and text[index] in _CLOSERS:
                index -= 1
        if index < 0 or text[index] not in _SENTENCE_PUNCTUATION:
            return False
        if text[index] != ".":
            return True
        word_start = index
        limit = max(0, index - 24)  # words longer than this are not abbreviations
        while word_start > limit and not text[word_start - 1].isspace():
            word_start -= 1
        word = text[word_start : index + 1].lstrip(_OPENERS)
        if word.lower() in _ABBREVIATIONS or _DOTTED_INITIALISM_RE.fullmatch(word) or _INITIAL_RE.fullmatch(word):
            return False
        return True

    # -- chunk placement -------------------------------------------------------------------------

    def _choose_end(self, i: int, previous_end: int) -> int:
        """The exclusive end token of the chunk starting at token ``i``.

        The end always lies beyond ``previous_end`` (the last chunk's end), so every chunk adds
        new tokens and the loop terminates.
        """
        n, hi = self.n, i + self.max_tokens
        floor = max(previous_end, i) + 1
        # A heading once the chunk is ~25% full (the first such one: sections stay apart).
        position = bisect_left(self.heading_cuts, max(i + self.heading_min_fill, floor))
        if position < len(self.heading_cuts) and self.heading_cuts[position] <= hi:
            return self.heading_cuts[position]
        if hi >= n:
            return n
        best, best_rank = -1, _NOT_ALLOWED
        for k in range(max(i + self.window_floor, floor), hi + 1):
            rank = self.rank(k)
            if rank >= best_rank and rank > _NOT_ALLOWED:  # ">=": the later of equal boundaries
                best, best_rank = k, rank
        if best > 0:
            return best
        # Nothing allowed in the tail of the window (tokens overlapping each other): take the
        # latest allowed cut before it, or cut at the window's end as a last resort.
        for k in range(max(i + self.window_floor, floor) - 1, floor - 1, -1):
            if self.rank(k) > _NOT_ALLOWED:
                return k
        return hi

    def _choose_next_start(self, i: int, j: int) -> int:
        """The first token of the chunk after ``[i, j)``: about ``overlap_tokens`` before ``j``."""
        if self.overlap_tokens == 0 or j in self._heading_cut_set:
            return j  # a heading starts a fresh section: no overlap backwards across it
        target = max(j - self.overlap_tokens, i + 1)
        # A heading inside the overlap: start there rather than repeat the previous section.
        position = bisect_right(self.heading_cuts, j - 1) - 1
        if position >= 0 and self.heading_cuts[position] >= target:
            return self.heading_cuts[position]
        # Never start in the middle of a heading line: back to the heading, or past its line.
        if position >= 0 and self.heading_line_ends[position] > self.starts[target]:
            heading = self.heading_cuts[position]
            if heading > i:
                return heading
            after_line = bisect_left(self.starts, self.heading_line_ends[position], target, j)
            return after_line
        for minimum in (_SENTENCE, _SPACE, _TOKEN):
            for k in range(target, j):
                if self.rank(k) >= minimum:
                    return k
        return j

    def chunks(self, first: int, last: int) -> list[TextChunk]:
        """All chunks of the text whose non-whitespace content spans ``[first, last)``."""
        if self.n <= self.max_tokens:
            only = self._make_chunk(0, first, last)
            return [only] if only is not None else []
        ranges: list[tuple[int, int]] = []
        i = previous_end = 0
        while True:
            j = self._choose_end(i, previous_end)
            ranges.append((i, j))
            if j >= self.n:
                break
            i, previous_end = self._choose_next_start(i, j), j
        result: list[TextChunk] = []
        for i, j in ranges:
            start = min(self.starts[i], first) if i == 0 else self.starts[i]
            end = max(self.reach[j - 1], last) if j == self.n else self.reach[j - 1]
            chunk = self._make_chunk(len(result), start, end)
            if chunk is not None:
                result.append(chunk)
        return result

    def _make_chunk(self, ordinal: int, start: int, end: int) -> TextChunk | None:
        text = self.text
        # Trim whitespace that belongs to tokens (some tokenizers attach the leading space).
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if start >= end:
            return None
        # token_count counts the tokens lying wholly inside [start, end).
        low, high = bisect_left(self.starts, start), bisect_right(self.starts, end)
        count = sum(1 for k in range(low, high) if self.ends[k] <= end)
        return TextChunk(ordinal=ordinal, text=text[start:end], start=start, end=end, token_count=count)


def _starts_sentence(char: str) -> bool:
    return char.isupper() or char.istitle() or char.isdigit() or char in _OPENERS
