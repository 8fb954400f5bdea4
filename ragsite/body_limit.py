"""A bound on the size of a request body, applied before Django reads any of it.

Django's ASGI handler reads a whole request body (into memory, then a temporary file past
``FILE_UPLOAD_MAX_MEMORY_SIZE``) before any middleware or view runs, so a limit checked in a
view, or an upload handler that drops an oversized file (search/ingest/uploads.py), still
lets a client fill the web host's disk with one request. ``RequestBodyLimit`` wraps the ASGI
application: a declared ``Content-Length`` over ``REQUEST_BODY_MAX_BYTES`` is answered 413 at
once without reading the body; a body sent without a length (chunked) is counted as it
arrives and refused as soon as it passes the limit. The refusal carries both error shapes'
fields (the REST API's ``code``/``message`` and OpenAI's ``type``/``param``), since a request
refused here never reaches the code that knows which API it was for.
"""

from __future__ import annotations

import json


class _BodyTooLarge(Exception):
    pass


class RequestBodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted_receive, send)
        except _BodyTooLarge:
            # Raised while Django reads the body, before it has started a response.
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        message = f"The request body is larger than the limit of {self.max_bytes} bytes (REQUEST_BODY_MAX_BYTES)."
        error = {"code": "request_too_large", "message": message, "type": "invalid_request_error", "param": None}
        body = json.dumps({"error": error}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),  # the rest of the body is not read
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
