"""A document's original file as a download, for the REST API and the browser alike."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import FileResponse, HttpRequest

from search.models import Document


def document_file_response(request: HttpRequest, document: Document) -> FileResponse:
    """The bytes as uploaded, an attachment under the upload's name. Raises FileNotFoundError
    when storage has lost the file."""
    handle = document.file.open("rb")
    # Bytes, not the document's media type: a browser must never render or sniff an upload
    # on this origin (an HTML page would run here), and the name keeps the extension.
    # FileResponse writes the name as RFC 6266 asks: filename*=utf-8'' for a Japanese one.
    response = FileResponse(
        handle, as_attachment=True, filename=document.source_name, content_type="application/octet-stream"
    )
    if isinstance(request, ASGIRequest):
        # Under ASGI Django reads a synchronous iterator whole before sending any of it
        # (docs/architecture.md): the file goes out block by block from an async one.
        response.streaming_content = _file_blocks(handle, response.block_size)
    return response


async def _file_blocks(handle, size: int):
    """The file's blocks, each read off the event loop; FileResponse closes it at the end."""
    while block := await sync_to_async(handle.read, thread_sensitive=False)(size):
        yield block
