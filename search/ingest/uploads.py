"""Upload handling in front of ``document_create``: oversized file parts are never kept whole.

Django stores a multipart file part in memory (up to ``FILE_UPLOAD_MAX_MEMORY_SIZE``) or in a
temporary file, whatever its size, before a view can look at it; ``DATA_UPLOAD_MAX_MEMORY_SIZE``
does not count file parts. ``DocumentSizeLimitHandler`` runs first (``FILE_UPLOAD_HANDLERS``):
it counts each file part's bytes and, once a part passes ``DOCUMENT_MAX_BYTES``, passes no more
of it to the handlers that store it. The rest of the part is read and dropped, and the view
gets an ``OversizedUpload`` (no content, the size received), which the views refuse by its
``size`` with a message naming the limit. Disk and memory used by one part stay within
``DOCUMENT_MAX_BYTES`` plus one chunk (64 KiB).
"""

from __future__ import annotations

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import FileUploadHandler


class OversizedUpload(UploadedFile):
    """A file part refused for its size: ``size`` is the bytes received, ``read()`` gives nothing."""

    def __init__(self, name: str, size: int, content_type: str | None, charset: str | None) -> None:
        import io

        super().__init__(io.BytesIO(b""), name=name, content_type=content_type, size=size, charset=charset)
        self.oversized = True


class DocumentSizeLimitHandler(FileUploadHandler):
    """Counts each file part; past ``DOCUMENT_MAX_BYTES`` the part is dropped (see the module)."""

    def new_file(self, field_name, file_name, content_type, content_length, charset=None, content_type_extra=None):
        super().new_file(field_name, file_name, content_type, content_length, charset, content_type_extra)
        self.received = 0
        self.limit = settings.DOCUMENT_MAX_BYTES

    def receive_data_chunk(self, raw_data, start):
        self.received += len(raw_data)
        if self.received > self.limit:
            return None  # the later handlers do not store it
        return raw_data

    def file_complete(self, file_size):
        if self.received > self.limit:
            return OversizedUpload(self.file_name, self.received, self.content_type, self.charset)
        return None  # the storing handlers complete the file
