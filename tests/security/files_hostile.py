"""Builders for hostile uploads: decompression bombs, broken and encrypted PDFs, zip tricks.

Everything is generated in the test, small on disk (a bomb is a few hundred kilobytes that
inflates to hundreds of megabytes), and reproducible.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

from tests.search.files import encrypt_pdf, make_docx, make_pdf, pdf_serialize

__all__ = [
    "deflate_repeated",
    "docx_with_bomb_member",
    "docx_with_forged_sizes",
    "encrypt_pdf",
    "make_docx",
    "make_pdf",
    "pdf_with_streams",
    "zip_with_many_members",
]

_CHUNK = 1024 * 1024


def deflate_repeated(byte: bytes, size: int, *, wrapper: str = "zlib") -> bytes:
    """``byte * size`` (a multiple of 1 MiB) deflated, fast: one 1 MiB block is compressed
    after a full flush (which resets the dictionary, so every such block encodes alike) and
    repeated; then the end block and, for ``wrapper="zlib"``, the Adler-32 of the whole."""
    assert size % _CHUNK == 0 and size > 0
    block = byte * _CHUNK
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    first = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    assert first == again
    body = first * (size // _CHUNK) + compressor.flush()  # flush() adds the final, empty block
    if wrapper == "raw":
        return body
    adler = 1
    for _ in range(size // _CHUNK):
        adler = zlib.adler32(block, adler)
    return b"\x78\xda" + body + struct.pack(">I", adler)


def _crc32_repeated(byte: bytes, size: int) -> int:
    crc, block = 0, byte * _CHUNK
    for _ in range(size // _CHUNK):
        crc = zlib.crc32(block, crc)
    return crc


def pdf_with_streams(streams: list[bytes], *, text: str = "Visible text on the first page.") -> bytes:
    """A PDF whose pages' content streams are the given FlateDecode-compressed bytes.

    The first page also carries a small plain text stream, so only the bombs are in the way
    of a successful parse. Offsets in the cross-reference table are exact.
    """
    objects: list[bytes] = [b"", b""]  # 1: catalog, 2: page tree
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    font = len(objects)
    plain = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(plain), plain))
    plain_number = len(objects)
    pages = []
    for index, compressed in enumerate(streams):
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(compressed), compressed))
        contents = f"[{plain_number} 0 R {len(objects)} 0 R]" if index == 0 else f"{len(objects)} 0 R"
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 {font} 0 R >> >>"
            f" /Contents {contents} >>".encode()
        )
        pages.append(len(objects))
    objects[0] = b"<< /Type /Catalog /Pages 2 0 R >>"
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(f'{n} 0 R' for n in pages)}] /Count {len(pages)} >>".encode()
    return pdf_serialize(objects)


def _zip_archive(members: list[tuple[str, int, bytes, int, int]]) -> bytes:
    """A ZIP archive from ``(name, method, stored bytes, crc32, uncompressed size)``, written by
    hand so that a precompressed member (the bomb) goes in as it is. Sizes under 4 GiB."""
    out, directory = bytearray(), bytearray()
    for name, method, stored, crc, size in members:
        encoded = name.encode()
        offset = len(out)
        out += struct.pack(
            "<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(stored), size, len(encoded), 0
        )
        out += encoded + stored
        directory += struct.pack(
            "<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, method, 0, 0x21, crc, len(stored), size,
            len(encoded), 0, 0, 0, 0, 0, offset,
        )  # fmt: skip
        directory += encoded
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members), len(directory), len(out), 0)
    return bytes(out + directory + end)


def docx_with_bomb_member(inflated_size: int, *, member: str = "word/media/image1.bin") -> bytes:
    """A real .docx plus one deflated member of ``inflated_size`` zero bytes (honest sizes and CRC)."""
    members = []
    with zipfile.ZipFile(io.BytesIO(make_docx())) as source:
        for info in source.infolist():
            content = source.read(info)
            compressor = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
            stored = compressor.compress(content) + compressor.flush()
            members.append((info.filename, zipfile.ZIP_DEFLATED, stored, zlib.crc32(content), len(content)))
    bomb = deflate_repeated(b"\0", inflated_size, wrapper="raw")
    members.append((member, zipfile.ZIP_DEFLATED, bomb, _crc32_repeated(b"\0", inflated_size), inflated_size))
    return _zip_archive(members)


def docx_with_forged_sizes(declared_size: int) -> bytes:
    """A real .docx whose ``word/document.xml`` claims (in the central directory) to inflate to
    ``declared_size`` bytes: the lie is patched into the archive's directory after writing."""
    data = bytearray(make_docx())
    name = b"word/document.xml"
    directory = data.rfind(b"PK\x01\x02", 0, data.rfind(b"PK\x05\x06"))
    while directory != -1:
        name_length = struct.unpack_from("<H", data, directory + 28)[0]
        if data[directory + 46 : directory + 46 + name_length] == name:
            struct.pack_into("<I", data, directory + 24, min(declared_size, 0xFFFFFFFE))
            return bytes(data)
        directory = data.rfind(b"PK\x01\x02", 0, directory)
    raise AssertionError("word/document.xml not found in the archive's directory")


def zip_with_many_members(count: int, *, docx: bool = True) -> bytes:
    """A zip of ``count`` tiny stored members (plus ``word/document.xml`` when ``docx``)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        if docx:
            archive.writestr("word/document.xml", b"<w:document/>")
        for index in range(count):
            archive.writestr(f"m/{index}", b"")
    return buffer.getvalue()
