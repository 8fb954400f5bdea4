"""Media type detection: the content decides first (PDF/DOCX bytes, HTML opening tags), then the file name."""

from __future__ import annotations

import re
from pathlib import PurePath

from search.ingest.parsers.archives import _zip_members
from search.ingest.parsers.common import DOCX_MEDIA_TYPE, ParseError
from search.ingest.parsers.decoding import _declared_html_charset, _decode_text

_SUFFIX_MEDIA_TYPES = {
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".txt": "text/plain",
    ".text": "text/plain",
    ".rst": "text/plain",
    ".csv": "text/plain",
    ".html": "text/html",
    ".htm": "text/html",
}
_HTML_START_RE = re.compile(
    r"\A\s*(?:<\?xml[^>]*>\s*)?(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html|head|body)\b",
    re.IGNORECASE | re.DOTALL,
)


def _zip_names(data: bytes, source_name: str) -> list[str]:
    members = _zip_members(
        data, f"{source_name} (a ZIP archive)", f"{source_name} looks like a ZIP archive but it could not be read"
    )
    return [member.filename for member in members]


def _looks_like_pdf(data: bytes) -> bool:
    # Some producers put whitespace or a BOM before the header; pypdf copes with that.
    return data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"%PDF-")


def sniff_media_type(data: bytes, source_name: str) -> str:
    """Decide the media type of an upload, trusting the content before the file name.

    PDF and DOCX are recognised by their bytes, HTML by its opening tags, then the extension
    picks Markdown, plain text or HTML; any other decodable text is plain text. Raises
    :class:`ParseError` for empty files, binary files of other kinds, ZIP archives that are
    not Word documents, and names that promise a PDF/DOCX the content is not.
    """
    if not data:
        raise ParseError("the file is empty")
    name = PurePath(source_name).name or source_name
    suffix = PurePath(source_name).suffix.lower()
    if _looks_like_pdf(data):
        return "application/pdf"
    if data.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        if "word/document.xml" in _zip_names(data, name):
            return DOCX_MEDIA_TYPE
        raise ParseError(f"{name} is a ZIP archive but not a Word document (.docx); only .docx archives are supported")
    if suffix == ".pdf":
        raise ParseError(f"{name} is named .pdf but its content is not a PDF")
    if suffix == ".docx":
        raise ParseError(f"{name} is named .docx but its content is not a Word document")
    text, _ = _decode_text(data, declared=_declared_html_charset(data))
    if _HTML_START_RE.match(text[:4096]):
        return "text/html"
    return _SUFFIX_MEDIA_TYPES.get(suffix, "text/plain")
