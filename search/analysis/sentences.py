"""Where sentences end, in Japanese and English.

English ends a sentence at ``. ! ?`` (and the ellipsis) before a space; Japanese at
``。！？`` (or ``．``, ``!``, ``?``), with no space after, and a closing bracket or quote
(``」』）``) after the mark still belongs to the sentence it closes. A ``。`` inside
``「…」`` or ``『…』`` ends the quoted sentence, not the one that quotes it.
"""

from __future__ import annotations

import re

JAPANESE_SENTENCE_ENDS = "。！？．"
# What may follow a sentence's end and still belong to it.
JAPANESE_CLOSERS = "」』）〕】》〉\"'”’)]"
JAPANESE_OPENERS = "「『（〔【《〈"
_JAPANESE_PAIRS = {"「": "」", "『": "』", "（": "）", "〔": "〕", "【": "】", "《": "》", "〈": "〉"}
# An English end: the mark, closing quotes, then a space. The caller's rules for
# abbreviations (chunking) or labels (abstention) refine it.
_LATIN_END = re.compile(r"[.!?\u2026][\"'\u201d\u2019)\]]*(?=\s)")


def ends_japanese_sentence(text: str, position: int) -> bool:
    """Whether ``text[:position]`` ends with a Japanese sentence end (closers looked through)."""
    index = position - 1
    while index >= 0 and text[index] in JAPANESE_CLOSERS:
        index -= 1
    return index >= 0 and (
        text[index] in JAPANESE_SENTENCE_ENDS or (text[index] in "!?" and index > 0 and not text[index - 1].isascii())
    )


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) of each sentence of ``text``, trimmed, in order. A line break ends a
    sentence; so do the marks above, outside brackets."""
    spans: list[tuple[int, int]] = []
    start, depth, closing = 0, 0, []
    index, length = 0, len(text)

    def close(end: int) -> None:
        nonlocal start
        piece = text[start:end]
        left = len(piece) - len(piece.lstrip())
        right = len(piece.rstrip())
        if right > left:
            spans.append((start + left, start + right))
        start = end

    while index < length:
        char = text[index]
        if char in _JAPANESE_PAIRS:
            closing.append(_JAPANESE_PAIRS[char])
            depth += 1
        elif closing and char == closing[-1]:
            closing.pop()
            depth -= 1
        if char == "\n":
            close(index + 1)
            closing.clear()
            depth = 0
        elif depth == 0 and (char in JAPANESE_SENTENCE_ENDS or char in "!?"):
            end = index + 1
            while end < length and text[end] in JAPANESE_CLOSERS:
                end += 1
            if char in JAPANESE_SENTENCE_ENDS or end >= length or not text[end].isspace() or not char.isascii():
                close(end)
                index = end
                continue
            close(end)
            index = end
            continue
        elif depth == 0 and char in ".\u2026":
            match = _LATIN_END.match(text, index)
            if match and (char != "." or not _abbreviation_before(text, index)):
                close(match.end())
                index = match.end()
                continue
        index += 1
    close(length)
    return spans


_ABBREVIATION = re.compile(r"(?:\b(?:e\.g|i\.e|cf|vs|dr|mr|mrs|ms|prof|st|fig|approx|inc|ltd|no)|\b[A-Z]|\d)$", re.I)


def _abbreviation_before(text: str, index: int) -> bool:
    """Whether the ``.`` at ``index`` ends an abbreviation or a number (``e.g.``, ``J.``, ``3.``)."""
    return bool(_ABBREVIATION.search(text[max(0, index - 8) : index]))
