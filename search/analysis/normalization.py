"""NFKC for matching, with a map back to the text as written.

Japanese documents mix full-width and half-width forms (``ＡＢＣ１２３``, ``ｶﾀｶﾅ``); NFKC
folds them so that a query typed either way matches. The text shown and cited stays as
written, so every normalised character keeps the offset of the characters it came from.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

# Half-width katakana voicing marks: NFKC joins them with the kana before them (ｶﾞ -> ガ).
_HALF_WIDTH_VOICING = "\uff9e\uff9f"


@dataclass(frozen=True)
class Normalised:
    """``text`` is the NFKC form of ``original``; ``starts[i]`` and ``ends[i]`` are the span
    of ``original`` that ``text[i]`` came from (a character that NFKC expands, ``㈱`` ->
    ``(株)``, gives each of its characters the same span)."""

    original: str
    text: str
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The span of ``original`` behind ``text[start:end]`` (``end > start``)."""
        return self.starts[start], self.ends[end - 1]


def nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def nfkc_mapped(text: str) -> Normalised:
    """``text`` in NFKC with each character's origin. Normalised cluster by cluster (a base
    character with the combining marks after it), which is what NFKC composes over."""
    if text.isascii():
        offsets = tuple(range(len(text)))
        return Normalised(text, text, offsets, tuple(i + 1 for i in offsets))
    pieces: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    index, length = 0, len(text)
    while index < length:
        end = index + 1
        while end < length and (unicodedata.combining(text[end]) or text[end] in _HALF_WIDTH_VOICING):
            end += 1
        piece = unicodedata.normalize("NFKC", text[index:end])
        pieces.append(piece)
        starts.extend([index] * len(piece))
        ends.extend([end] * len(piece))
        index = end
    return Normalised(text, "".join(pieces), tuple(starts), tuple(ends))
