"""Listing ZIP archives safely: too many members, or too large a directory, is refused before ``zipfile`` lists them."""

from __future__ import annotations

import io
import zipfile

from search.ingest.parsers.common import ParseError, _short_reason

# A ZIP's members are listed in memory (a few hundred bytes each) before any check can run:
# bound their number, and the size of the directory that lists them, first. A real .docx has
# tens of parts, a few hundred with many images.
MAX_ZIP_MEMBERS = 10_000
MAX_ZIP_DIRECTORY_BYTES = 4 * 1024 * 1024


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
