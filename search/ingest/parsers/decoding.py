"""Bytes to text for the text formats; binary data (NUL bytes, many control characters) is a :class:`ParseError`."""

from __future__ import annotations

import re

from search.ingest.parsers.common import _CONTROL_RE, ParseError

# More than this share of control characters means "binary", not "text with a few oddities".
_MAX_CONTROL_RATIO = 0.05

_BOMS = (
    # UTF-32 before UTF-16: the UTF-32 LE BOM begins with the UTF-16 LE one.
    (b"\xef\xbb\xbf", "utf-8-sig", "utf-8-sig"),
    (b"\xff\xfe\x00\x00", "utf-32-le", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32-be", "utf-32"),
    (b"\xff\xfe", "utf-16-le", "utf-16"),
    (b"\xfe\xff", "utf-16-be", "utf-16"),
)
# Legacy encodings that charset-normalizer cannot tell apart on short Western text (it scores
# "café naïve" identically as cp1250, cp1252, cp1257...). cp1252 is by far the most common
# source of such files (it is what Windows and HTML treat "latin-1" as), so it wins ties.
_PREFERRED_LEGACY_ENCODINGS = ("cp1252", "latin_1", "iso8859_15")
_BINARY_REASON = "unsupported file type: binary data that is not PDF, DOCX or text (detected by content)"
_META_CHARSET_RE = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([a-zA-Z0-9_.:-]+)""", re.IGNORECASE)


def _check_plausible_text(text: str) -> None:
    if "\x00" in text:
        raise ParseError(f"{_BINARY_REASON}: it contains NUL bytes")
    # Form feeds are normal in text files (page breaks); vertical tabs are not.
    controls = len(_CONTROL_RE.findall(text)) + text.count("\x0b")
    if text and controls / len(text) > _MAX_CONTROL_RATIO:
        raise ParseError(f"{_BINARY_REASON}: too many control characters")


def _charset_normalizer_guess(data: bytes) -> tuple[str, str] | None:
    from charset_normalizer import from_bytes

    matches = from_bytes(data)
    best = matches.best()
    if best is None:
        return None
    chosen = best
    for match in matches:
        tied = match.chaos <= best.chaos and match.coherence >= best.coherence - 0.02
        if tied and match.encoding in _PREFERRED_LEGACY_ENCODINGS:
            chosen = match
            break
    return str(chosen), chosen.encoding


def _decode_text(data: bytes, *, declared: str | None = None) -> tuple[str, str]:
    """Decode text bytes; returns ``(text, encoding)`` or raises ParseError for binary data.

    Order: a byte-order mark, strict UTF-8, an encoding the document declares (HTML ``<meta
    charset>``), then charset-normalizer's best guess.
    """
    for bom, codec, label in _BOMS:
        if data.startswith(bom):
            try:
                text = data[len(bom) :].decode(codec)
            except UnicodeDecodeError as exc:
                raise ParseError(f"the file starts with a {label} byte-order mark but is not valid {label}") from exc
            _check_plausible_text(text)
            return text, codec
    # Without a BOM, NUL bytes mean binary (BOM-less UTF-16 is too rare to be worth guessing).
    if b"\x00" in data:
        raise ParseError(f"{_BINARY_REASON}: it contains NUL bytes")
    decoded: tuple[str, str] | None = None
    try:
        decoded = data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        if declared:
            try:
                decoded = data.decode(declared), declared.lower()
            except (LookupError, UnicodeDecodeError):  # unknown names, and bytes->bytes codecs
                decoded = None
        if decoded is None:
            decoded = _charset_normalizer_guess(data)
    if decoded is None:
        raise ParseError(_BINARY_REASON)
    _check_plausible_text(decoded[0])
    return decoded


def _declared_html_charset(data: bytes) -> str | None:
    """The ``<meta charset>`` an HTML document declares near its start, if any."""
    match = _META_CHARSET_RE.search(data[:4096])
    return match.group(1).decode("ascii") if match else None
