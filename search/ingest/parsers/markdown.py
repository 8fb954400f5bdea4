"""Markdown read as prose: markers dropped, link and image text kept, code verbatim, headings recorded.

Title: the first ``#`` heading, else the first heading of any level, else the front matter's ``title:``.
Date: the front matter's ``date:`` (ISO 8601), into the document's metadata.
"""

from __future__ import annotations

import datetime
import re

from search.ingest.parsers.common import _LINE_BREAK_RE, ParsedDocument, _finish, _one_line, _TextBuilder
from search.ingest.parsers.decoding import _decode_text

_MD_COMMENT_RE = re.compile(r"<!--.*?-->", re.DOTALL)
_MD_FRONT_MATTER_RE = re.compile(r"\A---[ \t]*\n(.*?\n)(?:---|\.\.\.)[ \t]*(?:\n|\Z)", re.DOTALL)
_MD_FRONT_MATTER_TITLE_RE = re.compile(r"^title:[ \t]*[\"']?(.*?)[\"']?[ \t]*$", re.MULTILINE)
# The document's date (``date: 2026-10-15``): what "the latest report" is judged by (search.selectors).
_MD_FRONT_MATTER_DATE_RE = re.compile(r"^date:[ \t]*[\"']?(\d{4}-\d{2}-\d{2})", re.MULTILINE)
_MD_FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_MD_ATX_HEADING_RE = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_MD_SETEXT_RE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_MD_THEMATIC_BREAK_RE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_MD_TABLE_RULE_RE = re.compile(r"^[ \t]*\|?(?:[ \t]*:?-{3,}:?[ \t]*\|)+(?:[ \t]*:?-{3,}:?[ \t]*)?$")
_MD_REFERENCE_DEF_RE = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*\S+.*$")
_MD_BLOCKQUOTE_RE = re.compile(r"^ {0,3}(?:>[ \t]?)+")
# Link targets: <...> or a URL with at most one level of parentheses, then an optional title.
_MD_TARGET = r"\(\s*(?:<[^>\n]*>|(?:[^()\s]|\([^()\s]*\))*)(?:\s+(?:\"[^\"\n]*\"|'[^'\n]*'|\([^)\n]*\)))?\s*\)"
_MD_IMAGE_RE = re.compile(r"!\[([^\]\n]*)\]" + _MD_TARGET)
_MD_LINK_RE = re.compile(r"\[([^\]\n]*)\]" + _MD_TARGET)
_MD_REF_LINK_RE = re.compile(r"!?\[([^\]\n]+)\]\[[^\]\n]*\]")
_MD_AUTOLINK_RE = re.compile(r"<((?:https?|ftp|mailto):[^>\s]+)>")
_MD_CODE_SPAN_RE = re.compile(r"(`+)(.+?)\1")
# Emphasis with * may sit inside a word, as CommonMark allows: Japanese has no spaces around
# it (経費は**必ず**提出). Emphasis with _ may not, so that snake_case_name stays as written.
_MD_STRONG_RE = re.compile(
    r"(?<![\\*])\*\*(?=[^\s*])(.+?)(?<=[^\s\\])\*\*|(?<![\w\\])__(?=\S)(.+?)(?<=[^\s\\])__(?!\w)"
)
_MD_EMPHASIS_RE = re.compile(
    r"(?<![\\*])\*(?=[^\s*_])(.+?)(?<=[^\s\\])\*(?!\*)|(?<![\w\\*])_(?=[^\s*_])(.+?)(?<=[^\s\\])_(?![\w*])"
)
_MD_ESCAPE_RE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~<])")


def _markdown_prose(text: str) -> str:
    """Emphasis markers and backslash escapes removed from text outside code spans."""
    text = _MD_STRONG_RE.sub(r"\1\2", text)
    text = _MD_EMPHASIS_RE.sub(r"\1\2", text)
    return _MD_ESCAPE_RE.sub(r"\1", text)


def _markdown_inline(line: str) -> str:
    """One Markdown line as readable text: images -> alt text, links -> link text, no markers.

    Emphasis (``*``, ``_``, ``**``, ``__``) and code-span backticks are always removed, keeping
    their content; the content of code spans is kept verbatim.
    """
    line = _MD_IMAGE_RE.sub(r"\1", line)
    line = _MD_LINK_RE.sub(r"\1", line)
    line = _MD_REF_LINK_RE.sub(r"\1", line)
    line = _MD_AUTOLINK_RE.sub(r"\1", line)
    pieces: list[str] = []
    position = 0
    for match in _MD_CODE_SPAN_RE.finditer(line):
        pieces.append(_markdown_prose(line[position : match.start()]))
        pieces.append(match.group(2))
        position = match.end()
    pieces.append(_markdown_prose(line[position:]))
    return "".join(pieces)


def _parse_markdown(data: bytes) -> ParsedDocument:
    source, encoding = _decode_text(data)
    source = _LINE_BREAK_RE.sub("\n", source)
    front_matter_title = None
    metadata = {"encoding": encoding}
    front_matter = _MD_FRONT_MATTER_RE.match(source)
    if front_matter:
        title_match = _MD_FRONT_MATTER_TITLE_RE.search(front_matter.group(1))
        front_matter_title = _one_line(title_match.group(1)) if title_match else None
        date_match = _MD_FRONT_MATTER_DATE_RE.search(front_matter.group(1))
        if date_match:
            try:
                metadata["date"] = datetime.date.fromisoformat(date_match.group(1)).isoformat()
            except ValueError:
                pass  # not a calendar date (2026-02-30): the document simply has none
        source = source[front_matter.end() :]
    source = _MD_COMMENT_RE.sub("", source)

    # First pass: classify lines as (text, heading level); level 0 = body, -1 = blank line.
    # A fenced code block is kept as one body entry (its content verbatim, fences dropped).
    lines: list[tuple[str, int]] = []
    fence: str | None = None
    code: list[str] = []
    for raw in source.split("\n"):
        fence_match = _MD_FENCE_RE.match(raw)
        if fence is not None:
            if fence_match and fence_match.group(1)[0] == fence[0] and len(fence_match.group(1)) >= len(fence):
                lines.extend([("", -1), ("\n".join(code), 0), ("", -1)])
                fence, code = None, []
            else:
                code.append(raw)
            continue
        if fence_match:
            fence = fence_match.group(1)
            continue
        if not raw.strip():
            lines.append(("", -1))
            continue
        line = _MD_BLOCKQUOTE_RE.sub("", raw)
        setext = _MD_SETEXT_RE.match(line)
        if setext and lines and lines[-1][1] == 0:
            # "Title\n=====" makes the previous line a heading.
            lines[-1] = (lines[-1][0], 1 if setext.group(1)[0] == "=" else 2)
            continue
        if _MD_TABLE_RULE_RE.match(line) or _MD_REFERENCE_DEF_RE.match(line):
            continue  # "|---|---|" rows and "[1]: https://..." definitions carry no text
        if _MD_THEMATIC_BREAK_RE.match(line):
            lines.append(("", -1))
            continue
        heading = _MD_ATX_HEADING_RE.match(line)
        if heading:
            lines.append((_markdown_inline(heading.group(2) or ""), len(heading.group(1))))
        else:
            lines.append((_markdown_inline(line), 0))
    if fence is not None:  # an unclosed fence runs to the end of the document
        lines.append(("\n".join(code), 0))

    builder = _TextBuilder()
    first_h1 = first_heading = None
    for text, level in lines:
        if level < 0:
            builder.paragraph_break()
        elif level == 0:
            builder.add(text)
        else:
            builder.paragraph_break()
            if builder.add(text, heading=True):
                first_heading = first_heading or _one_line(text)
                if level == 1:
                    first_h1 = first_h1 or _one_line(text)
            builder.paragraph_break()
    title = first_h1 or first_heading or front_matter_title
    return _finish(builder, title=title, metadata=metadata)
