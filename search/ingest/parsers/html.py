"""HTML flattened block by block: scripts, styles and ``<head>`` dropped, headings recorded.

Title: ``<title>``, else the first ``<h1>``.
"""

from __future__ import annotations

import re

from search.ingest.parsers.common import ParsedDocument, ParseError, _finish, _one_line, _TextBuilder
from search.ingest.parsers.decoding import _declared_html_charset, _decode_text

# Elements whose content is never document text. (<head> is dropped too, but <title> is read first.)
_HTML_DROPPED = frozenset({"script", "style", "noscript", "template", "svg", "head", "title", "iframe", "object"})
_HTML_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
# Blocks that read as separate paragraphs (blank line around them) ...
_HTML_PARAGRAPH_BLOCKS = frozenset(
    {
        *_HTML_HEADINGS,
        "p",
        "pre",
        "blockquote",
        "table",
        "ul",
        "ol",
        "dl",
        "hr",
        "section",
        "article",
        "header",
        "footer",
        "main",
        "aside",
        "nav",
        "figure",
        "form",
        "fieldset",
        "details",
        "address",
        "hgroup",
    }
)
# ... and blocks that only start a new line.
_HTML_LINE_BLOCKS = frozenset(
    {
        "div",
        "li",
        "tr",
        "dt",
        "dd",
        "caption",
        "figcaption",
        "summary",
        "legend",
        "option",
        "thead",
        "tbody",
        "tfoot",
        "center",
        "dialog",
        "menu",
        "body",
        "html",
    }
)
_HTML_WHITESPACE_RE = re.compile(r"\s+")


class _HtmlWalker:
    """Flattens a parsed HTML tree into builder blocks (iteratively: deep nesting is common)."""

    def __init__(self) -> None:
        self.builder = _TextBuilder()
        self._inline: list[str] = []
        self._pre_depth = 0
        self._heading_pending = False
        self.first_h1: str | None = None

    def _flush(self) -> None:
        text = "".join(self._inline)
        self._inline = []
        # Only the first non-empty block inside a heading element marks the heading's start.
        if self.builder.add(text, heading=self._heading_pending):
            self._heading_pending = False

    def walk(self, root) -> None:
        from bs4.element import NavigableString, PreformattedString, Tag

        stack: list[tuple[object, bool]] = [(root, False)]
        while stack:
            node, closing = stack.pop()
            if isinstance(node, Tag):
                name = (node.name or "").lower()
                if closing:
                    self._close(node, name)
                    continue
                if name in _HTML_DROPPED:
                    continue
                if name == "br":
                    self._flush()
                    self.builder.line_break()
                    continue
                self._open(name)
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(node.contents))
            elif isinstance(node, NavigableString) and not isinstance(node, PreformattedString):
                # PreformattedString covers comments, CDATA, doctypes and processing instructions.
                text = str(node)
                self._inline.append(text if self._pre_depth else _HTML_WHITESPACE_RE.sub(" ", text))

    def _open(self, name: str) -> None:
        if name in _HTML_PARAGRAPH_BLOCKS or name in _HTML_LINE_BLOCKS:
            self._flush()
            if name in _HTML_PARAGRAPH_BLOCKS:
                self.builder.paragraph_break()
            else:
                self.builder.line_break()
        if name in _HTML_HEADINGS:
            self._heading_pending = True
        if name == "pre":
            self._pre_depth += 1

    def _close(self, node, name: str) -> None:
        if name in ("td", "th"):
            self._inline.append("\t")  # cells on one line, separated by a space after normalising
            return
        if name not in _HTML_PARAGRAPH_BLOCKS and name not in _HTML_LINE_BLOCKS:
            return
        self._flush()
        if name in _HTML_HEADINGS:
            self._heading_pending = False
            if name == "h1" and self.first_h1 is None:
                self.first_h1 = _one_line(node.get_text(" "))
        if name == "pre":
            self._pre_depth -= 1
        if name in _HTML_PARAGRAPH_BLOCKS:
            self.builder.paragraph_break()
        else:
            self.builder.line_break()


def _parse_html(data: bytes) -> ParsedDocument:
    from bs4 import BeautifulSoup

    text, encoding = _decode_text(data, declared=_declared_html_charset(data))
    try:
        soup = BeautifulSoup(text, "lxml")
    except Exception as exc:  # lxml/bs4 raise a variety of types on pathological input
        raise ParseError(f"the HTML could not be read: {exc}") from exc
    title_tag = soup.find("title")
    title = _one_line(title_tag.get_text(" ")) if title_tag else None
    walker = _HtmlWalker()
    walker.walk(soup)
    return _finish(walker.builder, title=title or walker.first_h1, metadata={"encoding": encoding})
