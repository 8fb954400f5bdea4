"""Format sniffing, decoding and parsing of uploads (pure functions: no database needed)."""

from __future__ import annotations

import hashlib
import io
import zipfile

import pytest

from search.ingest.parsers import (
    SUPPORTED_MEDIA_TYPES,
    ParsedDocument,
    ParseError,
    docx,
    normalise_text,
    parse_document,
    pdf,
    sniff_media_type,
)
from tests.search.files import DOCX, SAMPLE_PDF, encrypt_pdf, make_docx, make_pdf, make_zip, seeded_bytes

# ----------------------------------------------------------------------------------------------


def assert_normalised(document: ParsedDocument) -> None:
    """Every parser returns text that is already in canonical form, with headings in order."""
    assert normalise_text(document.text) == document.text
    assert document.headings == sorted(document.headings)
    for offset in document.headings:
        assert offset == 0 or document.text[offset - 1] == "\n"


# ----------------------------------------------------------------------------------------------
# normalise_text
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("", ""),
        ("  \n\t \r\n ", ""),
        ("a\r\nb\rc", "a\nb\nc"),
        ("one\ttwo\t\tthree", "one two three"),
        ("no\u00a0break\u2003em\u3000ideographic\u202fnarrow", "no break em ideographic narrow"),
        ("many     spaces   here", "many spaces here"),
        ("trailing   \nspaces \t\nend", "trailing\nspaces\nend"),
        ("a\n\n\n\n\nb\n\n\nc\n\nd", "a\n\nb\n\nc\n\nd"),
        ("a\n \n \n \nb", "a\n\nb"),
        ("bell\x07 and nul\x00 and del\x7f and c1\x9b gone", "bell and nul and del and c1 gone"),
        ("page one\x0cpage two\u2028next\u2029para", "page one\npage two\nnext\npara"),
        ("zero\u200bwidth soft\u00adhyphen \ufeffbom", "zerowidth softhyphen bom"),
        ("Cafe\u0301 n\u0303", "Caf\u00e9 \u00f1"),
        ("  \n\n  leading and trailing  \n\n ", "leading and trailing"),
        ("line one\n    indented", "line one\n indented"),
    ],
)
def test_normalise_text_exact_outputs(raw, expected):
    assert normalise_text(raw) == expected


def test_normalise_text_is_idempotent_and_composes_after_removing_controls():
    raw = "e\x01\u0301 \u00a0x\t\r\n\r\n\r\n  y  "
    once = normalise_text(raw)
    assert once == "\u00e9 x\n\n y"
    assert normalise_text(once) == once


def test_normalised_text_hash_is_stable():
    text = normalise_text("Caf\u00e9\r\nau   lait\u00a0\n\n\n")
    assert text == "Caf\u00e9\nau lait"
    assert hashlib.sha256(text.encode()).hexdigest() == hashlib.sha256("Caf\u00e9\nau lait".encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# sniff_media_type
# ----------------------------------------------------------------------------------------------


def test_supported_media_types():
    assert SUPPORTED_MEDIA_TYPES == {
        "text/plain": "text",
        "text/markdown": "markdown",
        "text/html": "html",
        "application/pdf": "pdf",
        DOCX: "docx",
    }


@pytest.mark.parametrize(
    ("data", "name", "expected"),
    [
        (SAMPLE_PDF, "report.pdf", "application/pdf"),
        (SAMPLE_PDF, "misnamed.txt", "application/pdf"),
        (make_docx(), "report.docx", DOCX),
        (make_docx(), "upload.bin", DOCX),
        (b"<!DOCTYPE html><html><body>x</body></html>", "page.html", "text/html"),
        (b"\xef\xbb\xbf  \n<!doctype HTML>\n<p>x</p>", "page.txt", "text/html"),
        (b"<HTML><p>x</p></HTML>", "notes.md", "text/html"),
        (b"<!-- generated -->\n<head><title>t</title></head>", "noext", "text/html"),
        (b"<body>fragment</body>", "x.csv", "text/html"),
        (b"<p>just a fragment</p>", "fragment.htm", "text/html"),
        (b"# Title\n\ntext", "notes.md", "text/markdown"),
        (b"# Title\n\ntext", "notes.MARKDOWN", "text/markdown"),
        (b"plain words", "a.txt", "text/plain"),
        (b"plain words", "a.text", "text/plain"),
        (b"Title\n=====\n", "a.rst", "text/plain"),
        (b"a,b\n1,2\n", "a.csv", "text/plain"),
        (b"some text <p>with a tag later</p>", "unknown.xyz", "text/plain"),
        (b"no extension at all", "README", "text/plain"),
        ("caf\u00e9".encode("cp1252"), "legacy.txt", "text/plain"),
        ("\ufeffhello".encode("utf-16-le"), "wide.txt", "text/plain"),
    ],
)
def test_sniff_media_type(data, name, expected):
    assert sniff_media_type(data, name) == expected


@pytest.mark.parametrize(
    ("data", "name", "message"),
    [
        (b"", "empty.txt", "the file is empty"),
        (b"just some text", "x.pdf", "x.pdf is named .pdf but its content is not a PDF"),
        (b"just some text", "dir/Report.PDF", "Report.PDF is named .pdf but its content is not a PDF"),
        (b"just some text", "x.docx", "x.docx is named .docx but its content is not a Word document"),
        (
            make_zip({"a.txt": b"hello"}),
            "archive.zip",
            "archive.zip is a ZIP archive but not a Word document (.docx); only .docx archives are supported",
        ),
        (
            b"PK\x03\x04 truncated",
            "broken.docx",
            "broken.docx looks like a ZIP archive but it could not be read: File is not a zip file",
        ),
        (
            seeded_bytes(0, 4096),
            "random.bin",
            "unsupported file type: binary data that is not PDF, DOCX or text (detected by content): "
            "it contains NUL bytes",
        ),
        (
            b"text\x00with NUL",
            "nul.txt",
            "unsupported file type: binary data that is not PDF, DOCX or text (detected by content): "
            "it contains NUL bytes",
        ),
        (
            bytes(b for b in seeded_bytes(0, 4096) if b),
            "random.dat",
            "unsupported file type: binary data that is not PDF, DOCX or text (detected by content)",
        ),
        (
            b"\x01\x02\x03\x04\x05\x06 mostly control characters",
            "controls.txt",
            "unsupported file type: binary data that is not PDF, DOCX or text (detected by content): "
            "too many control characters",
        ),
    ],
)
def test_sniff_media_type_refuses(data, name, message):
    with pytest.raises(ParseError) as excinfo:
        sniff_media_type(data, name)
    assert str(excinfo.value) == message


# ----------------------------------------------------------------------------------------------
# Plain text and encodings
# ----------------------------------------------------------------------------------------------


def test_plain_text_utf8():
    document = parse_document(b"  First line  \r\nsecond\t line\n\n\n\nlast  ", media_type="text/plain")
    assert document == ParsedDocument(
        text="First line\nsecond line\n\nlast", title=None, headings=[], metadata={"encoding": "utf-8"}
    )


@pytest.mark.parametrize(
    ("data", "encoding"),
    [
        ("\ufeffUTF-16 w\u00f6rld \u20ac".encode("utf-16-le"), "utf-16-le"),
        ("\ufeffUTF-16 w\u00f6rld \u20ac".encode("utf-16-be"), "utf-16-be"),
        ("\ufeffUTF-16 w\u00f6rld \u20ac".encode("utf-32-le"), "utf-32-le"),
        ("\ufeffUTF-16 w\u00f6rld \u20ac".encode("utf-32-be"), "utf-32-be"),
        ("\ufeffUTF-16 w\u00f6rld \u20ac".encode(), "utf-8-sig"),
    ],
)
def test_byte_order_marks(data, encoding):
    document = parse_document(data, media_type="text/plain")
    assert document.text == "UTF-16 w\u00f6rld \u20ac"
    assert document.metadata == {"encoding": encoding}


def test_cp1252_text_is_decoded_correctly():
    document = parse_document("caf\u00e9 na\u00efve Z\u00fcrich".encode("cp1252"), media_type="text/plain")
    assert document.text == "caf\u00e9 na\u00efve Z\u00fcrich"
    assert document.metadata == {"encoding": "cp1252"}


def test_invalid_utf16_after_bom():
    with pytest.raises(ParseError) as excinfo:
        parse_document(b"\xff\xfe\x00\xd8", media_type="text/plain")  # a lone surrogate
    assert str(excinfo.value) == "the file starts with a utf-16 byte-order mark but is not valid utf-16"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the file is empty"),
        (b" \n\t \r\n", "no text found in the document"),
        (
            b"a\x00b",
            "unsupported file type: binary data that is not PDF, DOCX or text (detected by content): "
            "it contains NUL bytes",
        ),
    ],
)
def test_plain_text_refusals(data, message):
    with pytest.raises(ParseError) as excinfo:
        parse_document(data, media_type="text/plain")
    assert str(excinfo.value) == message


def test_unsupported_media_type():
    with pytest.raises(ParseError) as excinfo:
        parse_document(b"x", media_type="image/png")
    assert str(excinfo.value) == "unsupported media type: image/png"


def test_media_type_parameters_are_ignored():
    assert parse_document(b"hi", media_type="Text/Plain; charset=latin-1").text == "hi"


# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------

MARKDOWN = b"""---
title: Front Matter Title
---
# Main *Title*

Intro with a [link](https://example.com/a_(b) "tip") and ![alt text](img.png) and `code_span` and
**bold** and _em_ and snake_case_name.
<!-- a hidden
comment -->
Setext Heading
--------------

```python
def f():
    return 1  # [not a link](x)
```

> quoted line
- item one
- item two

| a | b |
|---|---|
| 1 | 2 |

## Second ##
Escaped \\* star. Reference [text][1] and <https://example.org>.

[1]: https://example.com
"""


def test_markdown():
    document = parse_document(MARKDOWN, media_type="text/markdown")
    assert document.text == (
        "Main Title\n\n"
        "Intro with a link and alt text and code_span and\n"
        "bold and em and snake_case_name.\n\n"
        "Setext Heading\n\n"
        "def f():\n return 1 # [not a link](x)\n\n"
        "quoted line\n- item one\n- item two\n\n"
        "| a | b |\n| 1 | 2 |\n\n"
        "Second\n\n"
        "Escaped * star. Reference text and https://example.org."
    )
    assert document.title == "Main Title"
    assert [document.text[offset:].split("\n")[0] for offset in document.headings] == [
        "Main Title",
        "Setext Heading",
        "Second",
    ]
    assert document.metadata == {"encoding": "utf-8"}
    assert_normalised(document)


def test_markdown_title_falls_back_to_first_heading_then_front_matter():
    assert parse_document(b"text\n\n### Small\n\n## Medium\n", media_type="text/markdown").title == "Small"
    assert parse_document(b"## Medium\n\n# Big\n", media_type="text/markdown").title == "Big"
    assert parse_document(b"---\ntitle: 'FM'\n---\nno headings", media_type="text/markdown").title == "FM"
    assert parse_document(b"no headings #hashtag", media_type="text/markdown").title is None


def test_markdown_unclosed_fence_keeps_content():
    document = parse_document(b"# T\n\n```\ncode line\n", media_type="text/markdown")
    assert document.text == "T\n\ncode line"
    assert document.headings == [0]


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------

HTML = b"""<!DOCTYPE html>
<html><head><title>My &amp; Page</title><style>p { color: red }</style>
<script>var x = "<p>not text</p>";</script><meta charset="utf-8"></head>
<body><nav><a href="/">Home</a></nav>
<h1>Main   heading</h1>
<p>Caf&eacute; &lt;b&gt; &#8212; ok&nbsp;done <script>alert(1)</script></p>
<ul><li>one</li><li>two <b>bold</b></li></ul>
<noscript>enable js</noscript><template><p>template</p></template><svg><text>svg text</text></svg>
<div>line<br>break</div>
<table><tr><th>Name</th><th>Qty</th></tr><tr><td>apples</td><td>3</td></tr></table>
<pre>  code
    indented</pre><!-- a comment -->
<h2>Sub <em>section</em></h2><section><p>Body.</p></section>
<footer>Footer text</footer></body></html>"""


def test_html():
    document = parse_document(HTML, media_type="text/html")
    assert document.text == (
        "Home\n\n"
        "Main heading\n\n"
        "Caf\u00e9 <b> \u2014 ok done\n\n"
        "one\ntwo bold\n\n"
        "line\nbreak\n\n"
        "Name Qty\napples 3\n\n"
        "code\n indented\n\n"
        "Sub section\n\n"
        "Body.\n\n"
        "Footer text"
    )
    assert document.title == "My & Page"
    assert [document.text[offset:].split("\n")[0] for offset in document.headings] == ["Main heading", "Sub section"]
    assert document.metadata == {"encoding": "utf-8"}
    assert_normalised(document)


def test_html_title_falls_back_to_first_h1():
    document = parse_document(b"<p>intro</p><h2>two</h2><h1>The  <i>One</i></h1>", media_type="text/html")
    assert document.title == "The One"
    assert document.text == "intro\n\ntwo\n\nThe One"
    assert document.headings == [7, 12]


def test_html_declared_charset_is_used_when_not_utf8():
    data = '<html><head><meta charset="windows-1252"></head><body><p>na\u00efve</p></body></html>'.encode("cp1252")
    document = parse_document(data, media_type="text/html")
    assert document.text == "na\u00efve"
    assert document.metadata == {"encoding": "windows-1252"}


def test_html_without_text():
    with pytest.raises(ParseError) as excinfo:
        parse_document(
            b"<html><head><title>T</title><script>x()</script></head><body> </body></html>", media_type="text/html"
        )
    assert str(excinfo.value) == "no text found in the document"


# ----------------------------------------------------------------------------------------------
# PDF
# ----------------------------------------------------------------------------------------------


def test_pdf():
    document = parse_document(SAMPLE_PDF, media_type="application/pdf")
    assert document == ParsedDocument(
        text="Hello PDF world.\nSecond line (with parens).\n\nPage two text.",
        title="Quarterly Numbers",
        headings=[],
        metadata={"pages": 2},
    )


def test_pdf_without_title():
    document = parse_document(make_pdf([["Only text."]]), media_type="application/pdf")
    assert (document.text, document.title, document.metadata) == ("Only text.", None, {"pages": 1})


def test_pdf_encrypted_with_user_password():
    encrypted = encrypt_pdf(SAMPLE_PDF, user_password="secret")
    assert sniff_media_type(encrypted, "locked.pdf") == "application/pdf"
    with pytest.raises(ParseError) as excinfo:
        parse_document(encrypted, media_type="application/pdf")
    assert str(excinfo.value) == "the PDF is encrypted with a password"


def test_pdf_with_only_an_owner_password_is_readable():
    encrypted = encrypt_pdf(SAMPLE_PDF, user_password="", owner_password="owner-secret")
    document = parse_document(encrypted, media_type="application/pdf")
    assert document.text == "Hello PDF world.\nSecond line (with parens).\n\nPage two text."


def test_truncated_pdf():
    with pytest.raises(ParseError) as excinfo:
        parse_document(SAMPLE_PDF[: len(SAMPLE_PDF) // 2], media_type="application/pdf")
    assert str(excinfo.value).startswith("the PDF could not be read: ")


def test_pdf_without_text_needs_ocr():
    with pytest.raises(ParseError) as excinfo:
        parse_document(make_pdf([[], []]), media_type="application/pdf")
    assert str(excinfo.value) == "the PDF has no extractable text (scanned images need OCR, which is not supported)"


def test_pdf_text_cap(monkeypatch):
    monkeypatch.setattr(pdf, "MAX_PDF_TEXT_CHARS", 20)
    with pytest.raises(ParseError) as excinfo:
        parse_document(SAMPLE_PDF, media_type="application/pdf")
    assert str(excinfo.value) == "the PDF has more than 20 characters of text, which is too large"


# ----------------------------------------------------------------------------------------------
# DOCX
# ----------------------------------------------------------------------------------------------


def test_docx():
    document = parse_document(make_docx(), media_type=DOCX)
    assert document == ParsedDocument(
        text="Quarterly Report\n\nRevenue grew by 12 percent.\n\nRegion Sales\nNorth 42\n\nOutlook\n\nStable.",
        title="Quarterly Report",
        headings=[0, 70],
        metadata={"paragraphs": 4, "tables": 1},
    )
    assert document.text[70:].startswith("Outlook")


def test_docx_core_title_wins():
    assert parse_document(make_docx(title="Core Title"), media_type=DOCX).title == "Core Title"


def test_docx_corrupt():
    data = make_docx()
    with pytest.raises(ParseError) as excinfo:
        parse_document(data[: len(data) // 2], media_type=DOCX)
    assert str(excinfo.value) == "the Word document could not be read: File is not a zip file"


def test_docx_zip_without_word_parts():
    with pytest.raises(ParseError) as excinfo:
        parse_document(make_zip({"word/document.xml": b"<not-docx/>"}), media_type=DOCX)
    assert str(excinfo.value).startswith("the Word document could not be read: ")


def test_docx_compression_bomb_is_refused():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", "<Types/>")
        with archive.open("word/document.xml", "w") as member:
            zeros = b"\0" * (1 << 20)
            for _ in range(20):  # 20 MiB of zeros deflate to ~20 KiB
                member.write(zeros)
    data = buffer.getvalue()
    assert sniff_media_type(data, "bomb.docx") == DOCX
    with pytest.raises(ParseError) as excinfo:
        parse_document(data, media_type=DOCX)
    assert str(excinfo.value) == (
        "the Word document is compressed 1028:1, more than the 100:1 allowed (it looks like a decompression bomb)"
    )


def test_docx_bomb_hidden_behind_incompressible_padding_is_refused():
    padding = seeded_bytes(1, 300_000)
    data = make_zip({"word/document.xml": b"a" * (30 << 20), "word/media/noise.bin": padding})
    with pytest.raises(ParseError) as excinfo:
        parse_document(data, media_type=DOCX)
    assert str(excinfo.value).startswith("the Word document part word/document.xml is compressed ")


def test_docx_uncompressed_size_limit(monkeypatch):
    monkeypatch.setattr(docx, "MAX_DOCX_UNCOMPRESSED_BYTES", 1024)
    data = make_docx()
    with pytest.raises(ParseError) as excinfo:
        parse_document(data, media_type=DOCX)
    assert str(excinfo.value).startswith("the Word document would expand to ")
    assert str(excinfo.value).endswith(" bytes, more than the 1,024 allowed")


def test_sniffed_type_round_trips_through_parse():
    for data, name in [(SAMPLE_PDF, "a.pdf"), (make_docx(), "a.docx"), (HTML, "a.html"), (MARKDOWN, "a.md")]:
        document = parse_document(data, media_type=sniff_media_type(data, name))
        assert_normalised(document)
        assert document.text
