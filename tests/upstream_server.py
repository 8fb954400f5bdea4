"""A stand-in for an OpenAI-compatible upstream, run by tests as a separate process.

The only stand-in the test suite allows: it plays a remote provider (embeddings today),
speaking the OpenAI HTTP protocol so the real ``openai`` client talks to it unchanged.

    python -m tests.upstream_server PORT

Embeddings are deterministic: each word is hashed into one of ``dimensions`` buckets and
the counts are L2-normalised, so texts sharing words are close.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def hashed_embedding(text: str, dimensions: int) -> list[float]:
    vector = [0.0] * dimensions
    for word in re.findall(r"\w+", text.lower()):
        bucket = int(hashlib.md5(word.encode()).hexdigest()[:8], 16) % dimensions  # noqa: S324 (not security)
        vector[bucket] += 1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format, *args):  # keep test output quiet
        pass

    def _json(self, status: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        if self.path.rstrip("/") == "/healthz":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/v1/embeddings":
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            dimensions = int(body.get("dimensions") or 64)
            self._json(
                200,
                {
                    "object": "list",
                    "model": body.get("model", "hash-embed"),
                    "data": [
                        {"object": "embedding", "index": i, "embedding": hashed_embedding(text, dimensions)}
                        for i, text in enumerate(inputs)
                    ],
                    "usage": {"prompt_tokens": sum(len(t.split()) for t in inputs), "total_tokens": 0},
                },
            )
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
