"""Turn uploaded bytes into normalised text: format sniffing, decoding and per-format parsing.

Everything here is a pure function of its input (no Django, no I/O), so the ingestion task can
call it and tests can exercise it alone. Failures are reported as :class:`ParseError`, whose
message is meant to be shown to the person who uploaded the file.

One module per format (``text``, ``markdown``, ``html``, ``pdf``, ``docx``), each holding its own
limits; ``common`` (result and error types, normalisation), ``decoding`` (bytes to text),
``archives`` (safe ZIP listing) and ``sniffing`` (media type detection) are shared.
"""

from __future__ import annotations

from search.ingest.parsers.common import DOCX_MEDIA_TYPE, ParsedDocument, ParseError, normalise_text
from search.ingest.parsers.docx import _parse_docx
from search.ingest.parsers.html import _parse_html
from search.ingest.parsers.markdown import _parse_markdown
from search.ingest.parsers.pdf import _parse_pdf
from search.ingest.parsers.sniffing import sniff_media_type
from search.ingest.parsers.text import _parse_plain_text

__all__ = [
    "DOCX_MEDIA_TYPE",
    "SUPPORTED_MEDIA_TYPES",
    "ParseError",
    "ParsedDocument",
    "normalise_text",
    "parse_document",
    "sniff_media_type",
]


SUPPORTED_MEDIA_TYPES: dict[str, str] = {
    "text/plain": "text",
    "text/markdown": "markdown",
    "text/html": "html",
    "application/pdf": "pdf",
    DOCX_MEDIA_TYPE: "docx",
}


def parse_document(data: bytes, *, media_type: str) -> ParsedDocument:
    """Parse ``data`` as ``media_type`` (one of :data:`SUPPORTED_MEDIA_TYPES`).

    Parameters such as ``; charset=utf-8`` are ignored: the content decides the encoding.
    Raises :class:`ParseError` when the document cannot be read or holds no text.
    """
    base_type = media_type.split(";", 1)[0].strip().lower()
    label = SUPPORTED_MEDIA_TYPES.get(base_type)
    if label is None:
        raise ParseError(f"unsupported media type: {media_type}")
    if not data:
        raise ParseError("the file is empty")
    parser = {
        "text": _parse_plain_text,
        "markdown": _parse_markdown,
        "html": _parse_html,
        "pdf": _parse_pdf,
        "docx": _parse_docx,
    }[label]
    return parser(data)
