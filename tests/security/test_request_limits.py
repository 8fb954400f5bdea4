"""The web process refuses an oversized request body before reading it (ragsite/body_limit.py):
a declared length over REQUEST_BODY_MAX_BYTES at once, a chunked body as soon as it passes the
limit; either way nothing is stored and the process goes on serving."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import pytest

from billing import client_keys
from search.models import Document
from search.services import collection_create, workspace_create

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LIMIT = 100_000


def connect(base_url: str) -> http.client.HTTPConnection:
    host, port = urllib.parse.urlsplit(base_url).netloc.split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


def test_an_oversized_body_is_refused_before_it_is_read(start_web, tmp_path):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    _, token = client_keys.client_key_create(workspace, "uploads", scopes=["documents"])
    boundary = "b0undary"

    def part_head(file_name: str) -> bytes:
        return (
            f'--{boundary}\r\nContent-Disposition: form-data; name="collection"\r\n\r\n{collection.pk}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{file_name}"\r\n'
            "Content-Type: text/plain\r\n\r\n"
        ).encode()

    head = part_head("huge.txt")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    env = {"REQUEST_BODY_MAX_BYTES": str(LIMIT), "DOCUMENT_MAX_BYTES": str(LIMIT // 2)}
    with start_web(env=env) as base_url:
        # Declared: 10 GB announced, only the first bytes sent; the answer comes at once.
        declared = connect(base_url)
        declared.putrequest("POST", "/api/v1/documents")
        for name, value in {**headers, "Content-Length": str(10 * 1024**3)}.items():
            declared.putheader(name, value)
        declared.endheaders(head)
        response = declared.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"] == {
            "code": "request_too_large",
            "message": f"The request body is larger than the limit of {LIMIT} bytes (REQUEST_BODY_MAX_BYTES).",
            "type": "invalid_request_error",
            "param": None,
        }
        declared.close()

        # Chunked, no length: counted as it arrives, refused once past the limit.
        chunked = connect(base_url)
        chunked.putrequest("POST", "/api/v1/documents")
        for name, value in {**headers, "Transfer-Encoding": "chunked"}.items():
            chunked.putheader(name, value)
        chunked.endheaders()
        try:
            for piece in [head] + [b"x" * 16384] * 40:  # 640 KiB offered
                chunked.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: it has answered
        response = chunked.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
        chunked.close()

        # Nothing was stored, and the same process serves the next (small) upload.
        small = connect(base_url)
        body = part_head("note.txt") + b"A small note about the robot's battery.\r\n" + f"--{boundary}--\r\n".encode()
        small.request("POST", "/api/v1/documents", body=body, headers=headers)
        response = small.getresponse()
        assert response.status == 201, response.read()
    assert list(Document.objects.values_list("source_name", flat=True)) == ["note.txt"]
