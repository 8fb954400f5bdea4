"""Plain text: decoded and normalised; it has no title."""

from __future__ import annotations

from search.ingest.parsers.common import ParsedDocument, _finish, _TextBuilder
from search.ingest.parsers.decoding import _decode_text


def _parse_plain_text(data: bytes) -> ParsedDocument:
    text, encoding = _decode_text(data)
    builder = _TextBuilder()
    builder.add(text)
    return _finish(builder, title=None, metadata={"encoding": encoding})
