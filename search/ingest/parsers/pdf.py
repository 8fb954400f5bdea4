"""PDF text via pypdf, page by page, under decompression-bomb and text-size limits.

The ``MAX_PDF_*`` limits are read from this module at each call. A page that cannot be read is
skipped and listed in ``metadata["unreadable_pages"]``; a limit reached refuses the whole document.
"""

from __future__ import annotations

import io
from contextvars import ContextVar

from search.ingest.parsers.common import ParsedDocument, ParseError, _finish, _one_line, _short_reason, _TextBuilder

MAX_PDF_TEXT_CHARS = 20_000_000
# PDF decompression bombs: pypdf keeps every stream it decodes (cached on the object), so
# each stream is bounded (pypdf's own limits, lowered) and so is their total per document.
MAX_PDF_STREAM_BYTES = 32 * 1024 * 1024
MAX_PDF_INFLATED_BYTES = 128 * 1024 * 1024


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
