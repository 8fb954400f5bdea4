"""Builders for real files used by the search tests (PDFs plain and encrypted, DOCX, zips), and
texts stored and ingested in this process."""

from __future__ import annotations

import io
import random
import zipfile

import docx
from pypdf import PdfReader, PdfWriter

DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"


def seeded_bytes(seed: int, size: int) -> bytes:
    """Reproducible "random" bytes: a seeded PRNG is what we want for test data, not security."""
    return random.Random(seed).randbytes(size)  # noqa: S311 (not for security)


def _pdf_string(text: str) -> str:
    return "(" + text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") + ")"


def make_pdf(pages: list[list[str]], *, title: str | None = None) -> bytes:
    """A minimal valid PDF: one Helvetica text line per string, xref offsets computed exactly."""
    objects: list[bytes] = [b"", b""]  # 1: catalog, 2: page tree (filled in below)
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    font_number = len(objects)
    page_numbers = []
    for lines in pages:
        operators = ["BT", "/F1 12 Tf", "14 TL", "72 720 Td", *(f"{_pdf_string(line)} Tj T*" for line in lines), "ET"]
        stream = "\n".join(operators).encode("cp1252")
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
        content_number = len(objects)
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 {font_number} 0 R >> >>"
            f" /Contents {content_number} 0 R >>".encode()
        )
        page_numbers.append(len(objects))
    objects[0] = b"<< /Type /Catalog /Pages 2 0 R >>"
    kids = " ".join(f"{number} 0 R" for number in page_numbers)
    objects[1] = f"<< /Type /Pages /Kids [{kids}] /Count {len(page_numbers)} >>".encode()
    info = ""
    if title is not None:
        objects.append(f"<< /Title {_pdf_string(title)} >>".encode())
        info = f" /Info {len(objects)} 0 R"

    return pdf_serialize(objects, trailer=info)


def pdf_serialize(objects: list[bytes], trailer: str = "") -> bytes:
    """A PDF file of ``objects`` (object 1 the catalog), with its cross-reference table;
    ``trailer``: more trailer entries (`` /Info 9 0 R``)."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref_offset = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R{trailer} >>\nstartxref\n{xref_offset}\n%%EOF\n".encode()
    return bytes(out)


SAMPLE_PDF = make_pdf(
    [["Hello PDF world.", "Second line (with parens)."], ["Page two text."]],
    title="Quarterly Numbers",
)


def encrypt_pdf(pdf: bytes, *, user_password: str, owner_password: str | None = None) -> bytes:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password=user_password, owner_password=owner_password)
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def make_docx(*, title: str | None = None) -> bytes:
    document = docx.Document()
    if title is not None:
        document.core_properties.title = title
    document.add_heading("Quarterly Report", level=1)
    document.add_paragraph("Revenue grew by 12 percent.")
    table = document.add_table(rows=2, cols=2)
    for (row, column), value in {(0, 0): "Region", (0, 1): "Sales", (1, 0): "North", (1, 1): "42"}.items():
        table.cell(row, column).text = value
    document.add_heading("Outlook", level=2)
    document.add_paragraph("Stable.")
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def make_zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def ingest_texts(collection, documents: dict[str, str]) -> list[int]:
    """Store ``documents`` (file name -> text) in ``collection`` and run the whole ingestion
    pipeline on them here (no worker); returns their ids."""
    from search.ingest import pipeline
    from search.services import document_create

    ids = [
        document_create(collection=collection, source_name=name, content=text.encode(), enqueue=False)[0].pk
        for name, text in documents.items()
    ]
    pipeline.documents_ingest(document_ids=ids)
    return ids
