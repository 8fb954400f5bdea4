"""Japanese files as a Tokyo office writes them: text, CSV, HTML and Markdown in Shift_JIS (CP932),
EUC-JP and ISO-2022-JP decode to exactly the text written; Word documents and PDFs keep their
Japanese; bytes in no known encoding are refused with a reason that names the problem, at upload
and at ingestion, never indexed half right; and what decoding returns is what was written
(half-width katakana, emoji, zero-width and combining characters included)."""

from __future__ import annotations

import io

import docx
import pytest
from django.core.files.base import ContentFile

from search.ingest import pipeline
from search.ingest.parsers import ParsedDocument, ParseError, parse_document, sniff_media_type
from search.ingest.parsers.decoding import _decode_text
from search.models import Chunk, Document
from search.services import DocumentRejected, document_create
from tests.search.files import DOCX, pdf_serialize

LINE1 = "第1条（目的）この規程は、従業員が業務のために立て替えた経費の精算について定める。"
LINE2 = "第2条 領収書は「経理部」へ提出し、金額は￥1,200のように記す。"
TEXT = f"経費精算規程\n\n{LINE1}\n{LINE2}"
CSV = "日付,氏名,金額,備考\n2024/04/01,山田太郎,1200,タクシー代\n2024/04/02,鈴木花子,3400,会議用の弁当"
HTML = (
    '<!DOCTYPE html>\n<html lang="ja"><head>{meta}<title>経費精算規程</title></head>\n'
    f"<body><h1>経費精算規程</h1>\n<p>{LINE1}</p>\n<p>{LINE2}</p></body></html>\n"
)
HTML_TEXT = f"経費精算規程\n\n{LINE1}\n\n{LINE2}"
MARKDOWN = f"# 経費精算規程\n\n## 目的\n\n{LINE1}\n\n- 領収書は**必ず**提出する。\n- 金額は`￥1,200`のように*記す*。\n"
MARKDOWN_TEXT = f"経費精算規程\n\n目的\n\n{LINE1}\n\n- 領収書は必ず提出する。\n- 金額は￥1,200のように記す。"
# What each encoding's files are read as, and what HTML declares them as.
CODECS = {"cp932": "Shift_JIS", "euc_jp": "EUC-JP", "iso2022_jp": "ISO-2022-JP"}
# A declared Shift_JIS is read as Windows writes it (cp932); ISO-2022-JP is known by its escapes.
DECLARED_AS = {"cp932": "cp932", "euc_jp": "euc-jp", "iso2022_jp": "iso2022_jp"}
SAVE_AS_UTF8 = "save the file as UTF-8 and upload it again"


def encoded(text: str, codec: str) -> bytes:
    data = text.encode(codec)
    assert data.decode(codec) == text  # the sample has only characters the encoding round-trips
    return data


# ----------------------------------------------------------------------------------------------
# Text, CSV, HTML and Markdown in each encoding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_a_japanese_text_file_decodes_to_exactly_the_text_written(codec):
    data = encoded(TEXT, codec)
    assert sniff_media_type(data, "経費精算規程.txt") == "text/plain"
    assert parse_document(data, media_type="text/plain") == ParsedDocument(
        text=TEXT, title=None, headings=[], metadata={"encoding": codec}
    )


@pytest.mark.parametrize("codec", CODECS)
def test_a_japanese_csv_is_read_as_text_exactly(codec):
    data = encoded(CSV, codec)
    assert sniff_media_type(data, "経費一覧.csv") == "text/plain"
    assert parse_document(data, media_type="text/plain") == ParsedDocument(
        text=CSV, title=None, headings=[], metadata={"encoding": codec}
    )


@pytest.mark.parametrize("declared", [True, False], ids=["meta-charset", "no-meta"])
@pytest.mark.parametrize("codec", CODECS)
def test_a_japanese_html_page_decodes_exactly_with_or_without_its_meta_charset(codec, declared):
    meta = f'<meta charset="{CODECS[codec]}">' if declared else ""
    data = encoded(HTML.format(meta=meta), codec)
    assert sniff_media_type(data, "規程.html") == "text/html"
    assert parse_document(data, media_type="text/html") == ParsedDocument(
        text=HTML_TEXT,
        title="経費精算規程",
        headings=[0],
        metadata={"encoding": DECLARED_AS[codec] if declared else codec},
    )


@pytest.mark.parametrize("codec", CODECS)
def test_a_japanese_markdown_file_decodes_exactly_and_loses_its_markers(codec):
    data = encoded(MARKDOWN, codec)
    assert sniff_media_type(data, "規程.md") == "text/markdown"
    assert parse_document(data, media_type="text/markdown") == ParsedDocument(
        text=MARKDOWN_TEXT, title="経費精算規程", headings=[0, 8], metadata={"encoding": codec}
    )


def test_the_http_equiv_and_xml_declarations_are_read_too():
    for head in (
        '<meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS">',
        '<META HTTP-EQUIV="content-type" CONTENT="text/html;charset=x-sjis">',
    ):
        document = parse_document(encoded(HTML.format(meta=head), "cp932"), media_type="text/html")
        assert (document.text, document.metadata) == (HTML_TEXT, {"encoding": "cp932"})
    xhtml = '<?xml version="1.0" encoding="EUC-JP"?>\n' + HTML.format(meta="")
    document = parse_document(encoded(xhtml, "euc_jp"), media_type="text/html")
    assert (document.text, document.metadata) == (HTML_TEXT, {"encoding": "euc-jp"})


def test_shift_jis_without_any_kana_is_recognised_by_its_structure():
    # A list of names and amounts, as Excel saves it: kanji and digits only.
    names = "部署,氏名,金額\n営業部,佐藤一郎,1200\n総務部,高橋次郎,3400\n経理部,田中三郎,560"
    assert parse_document(encoded(names, "cp932"), media_type="text/plain") == ParsedDocument(
        text=names, title=None, headings=[], metadata={"encoding": "cp932"}
    )


def test_the_windows_characters_of_each_encoding_are_read():
    # NEC and IBM rows (①, ㈱, 髙) in Shift_JIS, in EUC-JP as eucJP-ms writes them (JIS X 0213
    # places), and in ISO-2022-JP as Windows writes it (CP50221, ～ as Windows maps it).
    text = "①会議の議事録は、②担当者が㈱テストの髙橋さんに送る。"
    assert parse_document(encoded(text, "cp932"), media_type="text/plain").metadata == {"encoding": "cp932"}
    assert parse_document(encoded(text, "cp932"), media_type="text/plain").text == text
    eucjp_ms = encoded("①会議の議事録は、②担当者が㈱テストの﨑田さんに送る。", "euc_jis_2004")
    assert _decode_text(eucjp_ms) == ("①会議の議事録は、②担当者が㈱テストの﨑田さんに送る。", "euc_jis_2004")
    cp50221 = b"\x1b$B-!3t<02q<R\x1b(B \x1b$B-j%F%9%H\x1b(B \x1b$B|b66$5$s\x1b(B \x1b(I6@6E\x1b(B \x1b$B!A\x1b(B"
    assert _decode_text(cp50221) == ("①株式会社 ㈱テスト 髙橋さん ｶﾀｶﾅ ～", "cp50221")


def test_iso_2022_jp_with_half_width_katakana_is_read():
    text = "ｶﾀｶﾅの見出しと本文です。"
    assert _decode_text(encoded(text, "iso2022_jp_ext")) == (text, "iso2022_jp_ext")


def test_western_text_with_curly_quotes_is_not_taken_for_shift_jis():
    # ’ (0x92) and a letter make a valid Shift_JIS kanji: "Don’t" would read "Don稚".
    text = "Don’t worry, it’s fine. We’ll see."
    assert _decode_text(text.encode("cp1252")) == (text, "cp1250")


def test_korean_euc_kr_is_not_taken_for_japanese():
    # EUC-KR has EUC-JP's byte structure, and its jamo (ㅋ, ㅠ) are kana there.
    text = "ㅋㅋㅋ 진짜 웃기다 ㅠㅠ 오늘 뭐해? ㅋㅋ 나는 집에 있어"
    assert _decode_text(encoded(text, "euc_kr")) == (text, "cp949")


# ----------------------------------------------------------------------------------------------
# Bytes in no known encoding: refused, naming the problem
# ----------------------------------------------------------------------------------------------

UNDECODABLE = {
    # A Shift_JIS file cut in the middle of its last character.
    "damaged": (
        encoded(TEXT, "cp932")[:-1],
        "the text could not be decoded: it reads as Shift_JIS (CP932) but byte 155 (0x81) is not valid "
        f"Shift_JIS (CP932); {SAVE_AS_UTF8}",
    ),
    # Two files of two encodings pasted into one.
    "two encodings": (
        encoded(TEXT, "euc_jp") + b"\n" + encoded(TEXT, "cp932"),
        f"the text could not be decoded: it reads as EUC-JP but byte 158 (0x8c) is not valid EUC-JP; {SAVE_AS_UTF8}",
    ),
    "utf-8 then shift_jis": (
        (TEXT + "\n").encode() + encoded(TEXT, "cp932"),
        f"the text could not be decoded: it reads as UTF-8 but byte 231 (0x8c) is not valid UTF-8; {SAVE_AS_UTF8}",
    ),
    "no encoding": (
        b"Summary \x81\x7f\xa0\xfd\xfe\xff notes",
        "the text could not be decoded: it is not valid UTF-8, Shift_JIS (CP932), EUC-JP or ISO-2022-JP, and no "
        f"other encoding fits it; {SAVE_AS_UTF8}",
    ),
    "broken iso-2022-jp": (
        b"\x1b$B$3$s$K$A$O\x1b(B \x1b$B$3$\x1b(B\n",
        "the text could not be decoded: it has ISO-2022-JP escape sequences but byte 22 (0x24 0x1b) is not valid "
        f"ISO-2022-JP; {SAVE_AS_UTF8}",
    ),
}


@pytest.mark.parametrize(("data", "message"), UNDECODABLE.values(), ids=UNDECODABLE)
def test_bytes_in_no_known_encoding_are_refused_with_the_reason(data, message):
    with pytest.raises(ParseError) as sniffed:
        sniff_media_type(data, "経費精算規程.txt")
    assert str(sniffed.value) == message
    for media_type in ("text/plain", "text/markdown", "text/html"):
        with pytest.raises(ParseError) as parsed:
            parse_document(data, media_type=media_type)
        assert str(parsed.value) == message


def test_random_bytes_are_still_binary_data():
    with pytest.raises(ParseError) as excinfo:
        _decode_text(bytes(range(1, 256)) * 4)
    assert (
        str(excinfo.value) == "unsupported file type: binary data that is not PDF, DOCX or text (detected by content)"
    )


def test_an_undecodable_upload_is_refused_and_nothing_is_stored(collection):
    data, message = UNDECODABLE["damaged"]
    with pytest.raises(DocumentRejected) as excinfo:
        document_create(collection=collection, source_name="経費精算規程.txt", content=data, enqueue=False)
    assert str(excinfo.value) == f"経費精算規程.txt: {message}"
    assert not Document.objects.exists()


def test_a_stored_file_that_cannot_be_decoded_fails_with_the_reason_and_no_chunk(collection):
    # Stored before this check existed, or by a path that does not sniff: ingestion refuses it.
    data, message = UNDECODABLE["two encodings"]
    document = Document(
        collection=collection,
        title="経費精算規程",
        source_name="経費精算規程.txt",
        media_type="text/plain",
        size_bytes=len(data),
        content_sha256="0" * 64,
    )
    document.file.save("undecodable.txt", ContentFile(data), save=True)
    document = pipeline.document_ingest(document_id=document.pk)
    assert (document.status, document.error) == (Document.Status.FAILED, message)
    assert not Chunk.objects.filter(document=document).exists()


def test_a_shift_jis_file_is_indexed_with_its_japanese_text(collection):
    data = encoded(TEXT, "cp932")
    document, _ = document_create(collection=collection, source_name="経費精算規程.txt", content=data, enqueue=False)
    document = pipeline.document_ingest(document_id=document.pk)
    assert (document.status, document.title, document.source_name) == (
        Document.Status.INDEXED, "経費精算規程", "経費精算規程.txt",
    )  # fmt: skip
    assert list(Chunk.objects.filter(document=document).values_list("text", flat=True)) == [TEXT]


# ----------------------------------------------------------------------------------------------
# What decoding returns is what was written
# ----------------------------------------------------------------------------------------------

# Half-width katakana with a half-width voiced mark, full-width letters and punctuation, emoji
# with a skin tone and a ZWJ family, a zero-width space, a combining voiced mark and acute accent.
WRITTEN = "ﾊﾝｶｸｶﾞ ＺＥＮＫＡＫＵ！ 👍🏽 👨\u200d👩\u200d👧 ゼロ\u200b幅 か\u3099 e\u0301"


def test_decoding_changes_no_character():
    assert _decode_text(WRITTEN.encode()) == (WRITTEN, "utf-8")
    for codec in ("utf-16", "utf-8-sig"):
        assert _decode_text(WRITTEN.encode(codec))[0] == WRITTEN
    legacy = "ﾊﾝｶｸｶﾞと全角ＡＢＣ１２３！の混在した行です。"
    for codec in ("cp932", "euc_jp"):
        assert _decode_text(encoded(legacy, codec)) == (legacy, codec)
    assert _decode_text(encoded(legacy, "iso2022_jp_ext")) == (legacy, "iso2022_jp_ext")


def test_the_stored_text_keeps_widths_and_emoji_as_written():
    # Only the normalisation every text gets (common.normalise_text): NFC composes the combining
    # marks and the zero-width space goes; nothing folds full-width or half-width forms.
    document = parse_document(WRITTEN.encode(), media_type="text/plain")
    assert document.text == "ﾊﾝｶｸｶﾞ ＺＥＮＫＡＫＵ！ 👍🏽 👨\u200d👩\u200d👧 ゼロ幅 が é"
    legacy = "ﾊﾝｶｸｶﾞと全角ＡＢＣ１２３！の混在した行です。"
    assert parse_document(encoded(legacy, "cp932"), media_type="text/plain").text == legacy


# ----------------------------------------------------------------------------------------------
# Word and PDF
# ----------------------------------------------------------------------------------------------


def test_a_japanese_word_document():
    document = docx.Document()
    document.core_properties.title = "経費精算規程（2024年版）"
    document.add_heading("経費精算規程", level=1)
    document.add_paragraph(LINE1)
    table = document.add_table(rows=2, cols=2)
    for (row, column), value in {(0, 0): "氏名", (0, 1): "金額", (1, 0): "山田 太郎", (1, 1): "￥1,200"}.items():
        table.cell(row, column).text = value
    document.add_heading("ｶﾀｶﾅと全角ＡＢＣ", level=2)
    document.add_paragraph(LINE2)
    buffer = io.BytesIO()
    document.save(buffer)
    assert sniff_media_type(buffer.getvalue(), "経費精算規程.docx") == DOCX
    assert parse_document(buffer.getvalue(), media_type=DOCX) == ParsedDocument(
        text=f"経費精算規程\n\n{LINE1}\n\n氏名 金額\n山田 太郎 ￥1,200\n\nｶﾀｶﾅと全角ＡＢＣ\n\n{LINE2}",
        title="経費精算規程（2024年版）",
        headings=[0, 71],
        metadata={"paragraphs": 4, "tables": 1},
    )


def japanese_pdf(lines: list[str], *, title: str, encoding: str) -> bytes:
    """A one-page PDF with a Japanese font that is not embedded (text extraction needs no glyph):
    ``Identity-H`` with a ToUnicode CMap (what Word and most tools write), or ``90ms-RKSJ-H``,
    whose strings are Shift_JIS bytes (older Japanese tools)."""
    characters = sorted({character for line in lines for character in line})
    cids = {character: number for number, character in enumerate(characters, start=1)}
    objects: list[bytes] = [b"", b""]  # 1: catalog, 2: page tree (filled in below)
    if encoding == "Identity-H":
        cmap = "\n".join(
            [
                "/CIDInit /ProcSet findresource begin",
                "12 dict begin",
                "begincmap",
                "/CIDSystemInfo << /Registry (Adobe) /Ordering (UCS) /Supplement 0 >> def",
                "/CMapName /Adobe-Identity-UCS def",
                "/CMapType 2 def",
                "1 begincodespacerange",
                "<0000> <FFFF>",
                "endcodespacerange",
                f"{len(characters)} beginbfchar",
                *(f"<{cids[c]:04X}> <{c.encode('utf-16-be').hex().upper()}>" for c in characters),
                "endbfchar",
                "endcmap",
                "CMapName currentdict /CMap defineresource pop",
                "end",
                "end",
            ]
        ).encode()
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(cmap), cmap))
        to_unicode, ordering, subtype = f" /ToUnicode {len(objects)} 0 R", "Identity", "CIDFontType2"

        def show(line: str) -> str:
            return "<" + "".join(f"{cids[c]:04X}" for c in line) + ">"
    else:
        to_unicode, ordering, subtype = "", "Japan1", "CIDFontType0"

        def show(line: str) -> str:
            return "<" + line.encode("cp932").hex().upper() + ">"

    objects.append(
        b"<< /Type /FontDescriptor /FontName /MS-Mincho /Flags 4 /FontBBox [0 -141 1000 859] /ItalicAngle 0"
        b" /Ascent 859 /Descent -141 /CapHeight 859 /StemV 80 >>"
    )
    objects.append(
        f"<< /Type /Font /Subtype /{subtype} /BaseFont /MS-Mincho /CIDSystemInfo << /Registry (Adobe)"
        f" /Ordering ({ordering}) /Supplement 0 >> /FontDescriptor {len(objects)} 0 R /DW 1000 >>".encode()
    )
    objects.append(
        f"<< /Type /Font /Subtype /Type0 /BaseFont /MS-Mincho /Encoding /{encoding}"
        f" /DescendantFonts [{len(objects)} 0 R]{to_unicode} >>".encode()
    )
    font = len(objects)
    stream = "\n".join(["BT", "/F1 12 Tf", "14 TL", "72 720 Td", *(f"{show(line)} Tj T*" for line in lines), "ET"])
    objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream.encode()))
    objects.append(
        f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 {font} 0 R >> >>"
        f" /Contents {len(objects)} 0 R >>".encode()
    )
    objects[0] = b"<< /Type /Catalog /Pages 2 0 R >>"
    objects[1] = f"<< /Type /Pages /Kids [{len(objects)} 0 R] /Count 1 >>".encode()
    objects.append(f"<< /Title <FEFF{title.encode('utf-16-be').hex().upper()}> >>".encode())
    return pdf_serialize(objects, trailer=f" /Info {len(objects)} 0 R")


@pytest.mark.parametrize("encoding", ["Identity-H", "90ms-RKSJ-H"])
def test_a_japanese_pdf(encoding):
    lines = ["経費精算規程", "第1条 この規程は、経費の精算について定める。", "ｶﾀｶﾅ と 全角ＡＢＣ１２３ ①㈱"]
    data = japanese_pdf(lines, title="経費精算規程（2024年版）", encoding=encoding)
    assert sniff_media_type(data, "経費精算規程.pdf") == "application/pdf"
    assert parse_document(data, media_type="application/pdf") == ParsedDocument(
        text="\n".join(lines), title="経費精算規程（2024年版）", headings=[], metadata={"pages": 1}
    )
