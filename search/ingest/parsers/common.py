"""What every format parser shares: the result and error types, and text normalisation.

Parsers assemble text with :class:`_TextBuilder`, so what they return is already a fixed point
of :func:`normalise_text` and its heading offsets are exact.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

DOCX_MEDIA_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"


class ParseError(Exception):
    """A document that cannot be turned into text; str(exc) is a human-readable reason shown to users/operators."""


@dataclass(frozen=True)
class ParsedDocument:
    """The text of a document plus what the chunker and the UI need to know about it."""

    text: str
    title: str | None
    headings: list[int] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)


# Characters that mean "new line" even though they are not \n. Turning them into \n (rather than
# deleting them) keeps the words on either side apart, e.g. a form feed between two PDF pages.
_LINE_BREAK_RE = re.compile("\r\n|[\r\x0b\x0c\x85\u2028\u2029]")
# Remaining C0/C1 control characters (tab and newline excluded) are noise: drop them.
_CONTROL_RE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")
# Invisible characters that only break words apart for search: zero-width space, word joiner,
# byte-order mark in the middle of text, soft hyphen. (ZWJ/ZWNJ carry meaning in some scripts.)
_INVISIBLE_RE = re.compile("[\u200b\u2060\ufeff\u00ad]")
# Every Unicode space separator (category Zs) other than the ASCII space, plus the tab.
_SPACE_RE = re.compile("[\t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_MULTI_SPACE_RE = re.compile(" {2,}")
_TRAILING_SPACE_RE = re.compile(" +\n")
_MANY_NEWLINES_RE = re.compile("\n{3,}")


def normalise_text(text: str) -> str:
    """Return ``text`` in the canonical form that is stored, chunked and hashed.

    Line breaks become ``\\n`` (vertical tab, form feed and the Unicode line/paragraph separators
    count as line breaks), other control characters are removed, tabs and Unicode spaces become
    a plain space, runs of spaces collapse to one, trailing spaces on each line go, three or more
    newlines collapse to a blank line, the text is put in Unicode NFC and stripped. The result
    is deterministic and ``normalise_text(normalise_text(x)) == normalise_text(x)``.
    """
    text = _LINE_BREAK_RE.sub("\n", text)
    text = _CONTROL_RE.sub("", text)
    text = _INVISIBLE_RE.sub("", text)
    text = _SPACE_RE.sub(" ", text)
    text = _MULTI_SPACE_RE.sub(" ", text)
    text = _TRAILING_SPACE_RE.sub("\n", text)
    text = _MANY_NEWLINES_RE.sub("\n\n", text)
    # NFC last: removing a control character can put a base letter next to a combining mark,
    # and only composing afterwards makes the function idempotent.
    return unicodedata.normalize("NFC", text).strip()


def _one_line(text: str | None) -> str | None:
    """A title-like string: normalised, on one line, or None when nothing is left."""
    if not text:
        return None
    cleaned = " ".join(normalise_text(text).split())
    return cleaned or None


class _TextBuilder:
    """Assembles normalised text block by block while recording where headings start.

    Each block is normalised on its own and blocks are joined with ``\\n`` or ``\\n\\n``, so the
    result is already a fixed point of :func:`normalise_text` and heading offsets recorded while
    appending stay exact (normalising afterwards would shift them).
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._length = 0
        self._pending = ""
        self.headings: list[int] = []

    def add(self, text: str, *, heading: bool = False) -> bool:
        """Append a block; returns whether it had any text."""
        piece = normalise_text(text)
        if not piece:
            return False
        if self._parts:
            separator = self._pending or "\n"
            self._parts.append(separator)
            self._length += len(separator)
        if heading:
            self.headings.append(self._length)
        self._parts.append(piece)
        self._length += len(piece)
        self._pending = ""
        return True

    def line_break(self) -> None:
        """The next block starts on a new line (the default)."""
        if not self._pending:
            self._pending = "\n"

    def paragraph_break(self) -> None:
        """The next block starts after a blank line."""
        self._pending = "\n\n"

    def text(self) -> str:
        return "".join(self._parts)


def _finish(builder: _TextBuilder, *, title: str | None, metadata: dict) -> ParsedDocument:
    text = builder.text()
    if not text:
        raise ParseError("no text found in the document")
    return ParsedDocument(text=text, title=title, headings=list(builder.headings), metadata=metadata)


def _short_reason(exc: BaseException) -> str:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return reason if len(reason) <= 200 else reason[:197] + "..."
