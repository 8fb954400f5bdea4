"""Turn uploaded bytes into normalised text: format sniffing, decoding and per-format parsing.

Everything here is a pure function of its input (no Django, no I/O), so the ingestion task can
call it and tests can exercise it alone. Failures are reported as :class:`ParseError`, whose
message is meant to be shown to the person who uploaded the file.
"""

from __future__ import annotations

import io
import re
import unicodedata
import zipfile
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import PurePath

__all__ = [
    "SUPPORTED_MEDIA_TYPES",
    "ParseError",
    "ParsedDocument",
    "normalise_text",
    "parse_document",
    "sniff_media_type",
]

DOCX_MEDIA_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"

SUPPORTED_MEDIA_TYPES: dict[str, str] = {
    "text/plain": "text",
    "text/markdown": "markdown",
    "text/html": "html",
    "application/pdf": "pdf",
    DOCX_MEDIA_TYPE: "docx",
}

# Decompression-bomb guards. A .docx is a zip of XML; real documents compress roughly 3-20x.
MAX_DOCX_UNCOMPRESSED_BYTES = 200 * 1024 * 1024
MAX_DOCX_COMPRESSION_RATIO = 100
# Tiny members (e.g. an empty XML part) can have silly ratios without being dangerous.
_DOCX_MEMBER_RATIO_MIN_BYTES = 1024 * 1024
MAX_PDF_TEXT_CHARS = 20_000_000
# A ZIP's members are listed in memory (a few hundred bytes each) before any check can run:
# bound their number, and the size of the directory that lists them, first. A real .docx has
# tens of parts, a few hundred with many images.
MAX_ZIP_MEMBERS = 10_000
MAX_ZIP_DIRECTORY_BYTES = 4 * 1024 * 1024
# PDF decompression bombs: pypdf keeps every stream it decodes (cached on the object), so
# each stream is bounded (pypdf's own limits, lowered) and so is their total per document.
MAX_PDF_STREAM_BYTES = 32 * 1024 * 1024
MAX_PDF_INFLATED_BYTES = 128 * 1024 * 1024

# More than this share of control characters means "binary", not "text with a few oddities".
_MAX_CONTROL_RATIO = 0.05

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


class ParseError(Exception):
    """A document that cannot be turned into text; str(exc) is a human-readable reason shown to users/operators."""


@dataclass(frozen=True)
class ParsedDocument:
    """The text of a document plus what the chunker and the UI need to know about it."""

    text: str
    title: str | None
    headings: list[int] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Sniffing and decoding
# --------------------------------------------------------------------------------------------

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
_HTML_START_RE = re.compile(
    r"\A\s*(?:<\?xml[^>]*>\s*)?(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html|head|body)\b",
    re.IGNORECASE | re.DOTALL,
)
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


def _zip_directory_check(data: bytes, what: str) -> None:
    """Refuse archives whose directory alone is too large to list, before ``zipfile`` lists it.

    ``zipfile`` reads the whole central directory (as many entries as its declared size
    holds, whatever the declared count says) into one object per member.
    """
    try:
        end = zipfile._EndRecData(io.BytesIO(data))  # the end-of-directory record, ZIP64 included
    except (OSError, ValueError, IndexError):  # a damaged record: zipfile itself reports it below
        return
    if not end:
        return
    count, size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]
    if count > MAX_ZIP_MEMBERS:
        raise ParseError(f"{what} has {count:,} members, more than the {MAX_ZIP_MEMBERS:,} allowed")
    if size > MAX_ZIP_DIRECTORY_BYTES:
        raise ParseError(f"{what} has a directory of {size:,} bytes, more than the {MAX_ZIP_DIRECTORY_BYTES:,} allowed")


def _zip_members(data: bytes, what: str, unreadable: str) -> list[zipfile.ZipInfo]:
    """The members of a ZIP archive, refusing archives with too many."""
    _zip_directory_check(data, what)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as exc:
        raise ParseError(f"{unreadable}: {_short_reason(exc)}") from exc
    if len(members) > MAX_ZIP_MEMBERS:
        raise ParseError(f"{what} has {len(members):,} members, more than the {MAX_ZIP_MEMBERS:,} allowed")
    return members


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


# --------------------------------------------------------------------------------------------
# Plain text
# --------------------------------------------------------------------------------------------


def _parse_plain_text(data: bytes) -> ParsedDocument:
    text, encoding = _decode_text(data)
    builder = _TextBuilder()
    builder.add(text)
    return _finish(builder, title=None, metadata={"encoding": encoding})


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------

_MD_COMMENT_RE = re.compile(r"<!--.*?-->", re.DOTALL)
_MD_FRONT_MATTER_RE = re.compile(r"\A---[ \t]*\n(.*?\n)(?:---|\.\.\.)[ \t]*(?:\n|\Z)", re.DOTALL)
_MD_FRONT_MATTER_TITLE_RE = re.compile(r"^title:[ \t]*[\"']?(.*?)[\"']?[ \t]*$", re.MULTILINE)
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
_MD_STRONG_RE = re.compile(r"(?<![\w\\])(\*\*|__)(?=\S)(.+?)(?<=[^\s\\])\1(?!\w)")
_MD_EMPHASIS_RE = re.compile(r"(?<![\w\\*])([*_])(?=[^\s*_])(.+?)(?<=[^\s\\])\1(?![\w*])")
_MD_ESCAPE_RE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~<])")


def _markdown_prose(text: str) -> str:
    """Emphasis markers and backslash escapes removed from text outside code spans."""
    text = _MD_STRONG_RE.sub(r"\2", text)
    text = _MD_EMPHASIS_RE.sub(r"\2", text)
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
    front_matter = _MD_FRONT_MATTER_RE.match(source)
    if front_matter:
        title_match = _MD_FRONT_MATTER_TITLE_RE.search(front_matter.group(1))
        front_matter_title = _one_line(title_match.group(1)) if title_match else None
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
    return _finish(builder, title=title, metadata={"encoding": encoding})


# --------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# PDF
# --------------------------------------------------------------------------------------------


def _short_reason(exc: BaseException) -> str:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return reason if len(reason) <= 200 else reason[:197] + "..."


class _InflateBudget:
    """Bytes decoded from one PDF's streams so far, against ``MAX_PDF_INFLATED_BYTES``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.exceeded = False


_PDF_INFLATE_BUDGET: ContextVar[_InflateBudget | None] = ContextVar("pdf_inflate_budget", default=None)
_PDF_BOMB_REASON = "(it looks like a decompression bomb)"


def _pdf_inflate_counter_install() -> None:
    """Count every stream pypdf decodes against the budget of the PDF being parsed.

    pypdf bounds each stream but not their sum, and keeps every decoded stream; a PDF of
    many moderate bombs would otherwise fill the memory. ``EncodedStreamObject.get_data``
    looks ``decode_stream_data`` up in ``pypdf.filters`` at each call, so wrapping it there
    sees all of them. Outside ``_parse_pdf`` (no budget set) the wrapper only passes through.
    """
    import pypdf.filters
    from pypdf.errors import LimitReachedError

    original = pypdf.filters.decode_stream_data
    if getattr(original, "_ragsite_counting", False):
        return

    def decode_stream_data(stream):
        budget = _PDF_INFLATE_BUDGET.get()
        if budget is not None and budget.exceeded:
            raise LimitReachedError("the PDF's decompression budget is spent")
        decoded = original(stream)
        if budget is not None:
            budget.used += len(decoded)
            if budget.used > budget.limit:
                budget.exceeded = True  # even if pypdf swallows the error, every later decode fails
                raise LimitReachedError("the PDF's decompression budget is spent")
        return decoded

    decode_stream_data._ragsite_counting = True
    pypdf.filters.decode_stream_data = decode_stream_data


def _pdf_limit_reason(exc: BaseException, budget: _InflateBudget) -> str:
    if budget.exceeded:
        return (
            f"the PDF expands to more than {MAX_PDF_INFLATED_BYTES:,} bytes when decompressed, "
            f"more than allowed {_PDF_BOMB_REASON}"
        )
    if "decompressing" in str(exc):
        return (
            f"the PDF has a stream that expands to more than {MAX_PDF_STREAM_BYTES:,} bytes when decompressed, "
            f"more than allowed {_PDF_BOMB_REASON}"
        )
    return f"the PDF exceeds a safety limit: {_short_reason(exc)}"


def _parse_pdf(data: bytes) -> ParsedDocument:
    from pypdf import apply_configuration

    _pdf_inflate_counter_install()
    budget = _InflateBudget(MAX_PDF_INFLATED_BYTES)
    token = _PDF_INFLATE_BUDGET.set(budget)
    limit = MAX_PDF_STREAM_BYTES
    try:
        with apply_configuration(
            zlib_maximum_output_length=limit,
            lzw_maximum_output_length=limit,
            run_length_maximum_output_length=limit,
            brotli_maximum_output_length=limit,
            jbig2_maximum_output_length=limit,
            array_based_stream_maximum_output_length=limit,
            image_maximum_buffer_size=limit,
        ):
            parsed = _parse_pdf_bounded(data, budget)
    finally:
        _PDF_INFLATE_BUDGET.reset(token)
    if budget.exceeded:  # a decode failed on the budget but pypdf carried on without that stream
        raise ParseError(_pdf_limit_reason(Exception(), budget))
    return parsed


def _parse_pdf_bounded(data: bytes, budget: _InflateBudget) -> ParsedDocument:
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError, LimitReachedError, PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                decrypted = reader.decrypt("")
            except DependencyError as exc:
                raise ParseError(f"the PDF is encrypted with an unsupported algorithm: {_short_reason(exc)}") from exc
            if not decrypted:
                raise ParseError("the PDF is encrypted with a password")
        pages = reader.pages
        page_count = len(pages)
    except ParseError:
        raise
    except FileNotDecryptedError as exc:
        raise ParseError("the PDF is encrypted with a password") from exc
    except LimitReachedError as exc:
        raise ParseError(_pdf_limit_reason(exc, budget)) from exc
    except Exception as exc:  # pypdf raises many types (PdfReadError, ValueError, KeyError...) on bad files
        raise ParseError(f"the PDF could not be read: {_short_reason(exc)}") from exc

    builder = _TextBuilder()
    unreadable: list[int] = []
    total = 0
    for number in range(page_count):
        try:
            page_text = pages[number].extract_text() or ""
        except LimitReachedError as exc:  # a bomb is not "one broken page": refuse the document
            raise ParseError(_pdf_limit_reason(exc, budget)) from exc
        except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError):
            # One broken page (bad font, damaged stream) should not lose the rest of the document.
            unreadable.append(number + 1)
            continue
        total += len(page_text)
        if total > MAX_PDF_TEXT_CHARS:
            raise ParseError(f"the PDF has more than {MAX_PDF_TEXT_CHARS:,} characters of text, which is too large")
        builder.paragraph_break()
        builder.add(page_text)
    if not builder.text():
        if unreadable and len(unreadable) == page_count:
            raise ParseError("the PDF could not be read: no page's text could be extracted")
        raise ParseError("the PDF has no extractable text (scanned images need OCR, which is not supported)")

    title = None
    try:
        title = _one_line(reader.metadata.title if reader.metadata else None)
    except Exception:  # a damaged /Info dictionary only costs us the title
        title = None
    metadata: dict = {"pages": page_count}
    if unreadable:
        metadata["unreadable_pages"] = unreadable
    return _finish(builder, title=title, metadata=metadata)


# --------------------------------------------------------------------------------------------
# DOCX
# --------------------------------------------------------------------------------------------

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
