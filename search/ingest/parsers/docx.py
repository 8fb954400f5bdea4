"""Word (.docx) text via python-docx; the archive is checked for decompression bombs before anything inflates it.

The ``MAX_DOCX_*`` limits are read from this module at each call.
"""

from __future__ import annotations

import io
import re

from search.ingest.parsers.archives import _zip_members
from search.ingest.parsers.common import ParsedDocument, ParseError, _finish, _one_line, _short_reason, _TextBuilder

# Decompression-bomb guards. A .docx is a zip of XML; real documents compress roughly 3-20x.
MAX_DOCX_UNCOMPRESSED_BYTES = 200 * 1024 * 1024
MAX_DOCX_COMPRESSION_RATIO = 100
# Tiny members (e.g. an empty XML part) can have silly ratios without being dangerous.
_DOCX_MEMBER_RATIO_MIN_BYTES = 1024 * 1024

_DOCX_HEADING_STYLE_RE = re.compile(r"^heading\s*([1-9])$", re.IGNORECASE)


def _check_zip_bomb(data: bytes) -> None:
    """Refuse archives that would inflate to too much data, before anything decompresses them.

    The sizes come from the archive's directory; they can be forged, but zipfile never
    returns more than the declared size for a member (it truncates and fails the CRC check),
    so a lie cannot make the later reads inflate more than what is checked here.
    """
    members = _zip_members(data, "the Word document", "the Word document could not be read")
    total = sum(member.file_size for member in members)
    compressed = sum(member.compress_size for member in members)
    if total > MAX_DOCX_UNCOMPRESSED_BYTES:
        raise ParseError(
            f"the Word document would expand to {total:,} bytes, more than the {MAX_DOCX_UNCOMPRESSED_BYTES:,} allowed"
        )
    if total / max(compressed, 1) > MAX_DOCX_COMPRESSION_RATIO:
        raise ParseError(
            f"the Word document is compressed {total / max(compressed, 1):.0f}:1, more than the "
            f"{MAX_DOCX_COMPRESSION_RATIO}:1 allowed (it looks like a decompression bomb)"
        )
    for member in members:
        # Checked per member too, so that padding with incompressible data cannot hide a bomb.
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > _DOCX_MEMBER_RATIO_MIN_BYTES and ratio > MAX_DOCX_COMPRESSION_RATIO:
            raise ParseError(
                f"the Word document part {member.filename} is compressed {ratio:.0f}:1, more than the "
                f"{MAX_DOCX_COMPRESSION_RATIO}:1 allowed (it looks like a decompression bomb)"
            )


def _docx_heading_level(paragraph) -> int:
    """0 for body text, 1-9 for "Heading N", and 1 for the "Title" style."""
    try:
        style = paragraph.style
    except Exception:  # a paragraph that points at a missing style is body text
        return 0
    for name in (getattr(style, "name", None), getattr(style, "style_id", None)):
        if not name:
            continue
        if name.lower() == "title":
            return 1
        match = _DOCX_HEADING_STYLE_RE.match(name)
        if match:
            return int(match.group(1))
    return 0


def _docx_table_rows(table_element, parent) -> list[str]:
    """One string per table row, cells separated by tabs; nested tables flattened into their cell.

    Works on the XML so that merged cells appear once (python-docx's ``row.cells`` repeats them).
    """
    from docx.oxml.ns import qn
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    table = Table(table_element, parent)
    rows = []
    for tr in table_element.iterchildren(qn("w:tr")):
        cells = []
        for tc in tr.iterchildren(qn("w:tc")):
            parts = []
            for child in tc.iterchildren():
                if child.tag == qn("w:p"):
                    parts.append(Paragraph(child, table).text)
                elif child.tag == qn("w:tbl"):
                    parts.extend(_docx_table_rows(child, table))
            cells.append(" ".join(part for part in parts if part.strip()))
        rows.append("\t".join(cells))
    return rows


def _parse_docx(data: bytes) -> ParsedDocument:
    _check_zip_bomb(data)
    import docx
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(data))
        core_title = document.core_properties.title
        blocks = list(document.iter_inner_content())
    except Exception as exc:  # python-docx raises KeyError, lxml errors, PackageNotFoundError...
        raise ParseError(f"the Word document could not be read: {_short_reason(exc)}") from exc

    builder = _TextBuilder()
    headings_by_level: dict[int, str] = {}
    paragraphs = tables = 0
    try:
        for block in blocks:
            builder.paragraph_break()
            if isinstance(block, Table):
                tables += 1
                for row in _docx_table_rows(block._tbl, block._parent):
                    builder.add(row)
                    builder.line_break()
                continue
            paragraphs += 1
            level = _docx_heading_level(block)
            text = block.text
            if builder.add(text, heading=level > 0) and level:
                headings_by_level.setdefault(level, _one_line(text) or "")
    except Exception as exc:
        raise ParseError(f"the Word document could not be read: {_short_reason(exc)}") from exc

    title = _one_line(core_title) or next((headings_by_level[level] for level in sorted(headings_by_level)), None)
    return _finish(builder, title=title, metadata={"paragraphs": paragraphs, "tables": tables})
