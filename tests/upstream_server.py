"""A stand-in for an OpenAI-compatible upstream, run by tests as a separate process.

The only stand-in the test suite allows: it plays a remote provider (embeddings and chat
completions), speaking the OpenAI HTTP protocol so the real ``openai`` client talks to it
unchanged.

    python -m tests.upstream_server PORT

Embeddings are deterministic: each word is hashed into one of ``dimensions`` buckets and
the counts are L2-normalised, so texts sharing words are close.

Chat completions (``POST /v1/chat/completions``, streamed or not)
    The reply is deterministic: if the last user message has a line ``REPLY: <text>``, the
    reply is exactly ``<text>``; otherwise it is ``You said: `` followed by the first 12
    words of the last user message. ``stop`` strings cut the reply before the first
    occurrence; ``max_tokens`` (or ``max_completion_tokens``) cuts it to that many tokens
    (``finish_reason`` "length", else "stop"). One token is one word with the whitespace
    before it (``re.findall(r"\\s*\\S+")``), and a stream sends one token per chunk, so the
    deltas join to the reply exactly. Streams are SSE over chunked transfer encoding, in
    OpenAI's shape: a first chunk with the role and empty content, one chunk per token, a
    chunk with the finish_reason and an empty delta, the usage chunk (``choices: []``)
    only when ``stream_options.include_usage`` is true, then ``data: [DONE]``. Usage:
    ``prompt_tokens`` is the number of whitespace-separated words in all messages'
    contents, ``completion_tokens`` the tokens sent. Requests need ``Authorization:
    Bearer <key>`` (any key is accepted unless scripted otherwise), a ``model`` and a
    non-empty ``messages`` list (else 401/400 in OpenAI's error shape).

Fault injection, per API key (so concurrent tests with different keys never interfere)
    ``POST /_control/script`` ``{"api_key": K, "steps": [...]}`` replaces K's script. Each
    chat request made with K takes the next step; once the steps run out, requests
    succeed. A step is ``"ok"`` or an object combining:

    - ``"status": N``: answer HTTP N at once with an OpenAI-shaped error body; with 429,
      ``"retry_after_ms": N`` sends ``retry-after-ms``, ``"retry_after": "2"`` sends
      ``Retry-After`` as given (seconds or an HTTP date); neither sends no header. The
      401 message echoes the key, as some proxies do (OpenAI masks it), so tests can check
      that clients keep keys out of their messages;
    - ``"first_byte_delay_ms": N``: wait before sending anything, then go on; a client that
      closes the connection meanwhile is seen going at once (outcome "client disconnected
      after 0 tokens", ``finished`` when it went), as an engine that aborts it would;
    - ``"token_delay_ms": N``: wait before each token chunk;
    - ``"keepalive_ms": N``: while waiting before a token chunk, send an SSE comment
      (``: keep-alive``) every N ms, as proxies and some servers do (clients skip them);
    - ``"cut_after_tokens": N``: send N token chunks, then drop the connection mid-body
      (no finish_reason, no ``[DONE]``, no end of the chunked body);
    - ``"end_after_tokens": N``: send N token chunks, then end the body cleanly without a
      finish_reason or ``[DONE]``;
    - ``"no_usage": true``: never send the usage chunk;
    - ``"reply": "<text>"``: reply this text instead of the last user message's ``REPLY:`` line;
    - ``"loop": "<phrase>"``: a generation that repeats itself: the reply, a space, then the
      phrase again and again until ``max_tokens`` (4096 without one; ``finish_reason``
      "length"). With ``token_delay_ms`` the stream is paced, so that a client that stops
      reading and closes is seen doing so (the log's ``disconnected``);
    - ``"repeat": true``: the step is not consumed and applies to every later request
      (a revoked key: ``{"status": 401, "repeat": true}``).

    ``GET /_control/log?api_key=K``: ``{"requests": [...]}``, K's requests in arrival
    order, each with ``key`` (last 4 characters), ``model``, ``time`` (arrival, Unix
    seconds), ``finished`` (when the response ended), ``step`` (the step applied, "ok"
    when none), ``host`` (the Host header: one server can play several devices by their
    URLs), ``outcome`` ("ok", "status 429", "cut after 3 tokens", "client
    disconnected after N tokens", ...), ``stream``, ``stream_options``,
    ``speculative_config``, ``extra`` (every other non-standard body field), the sampling
    fields, ``prompt_tokens`` and ``completion_tokens`` (the server's counts for the reply it
    sent, reported or not) and ``usage_sent`` (whether a usage object went out). A streamed
    reply also has ``tokens_planned`` (the token chunks it would send in full) and
    ``disconnected`` (true when the client closed the connection before the end: then
    ``completion_tokens`` is the token chunks written before the server noticed, which the
    client may not all have read).

    ``POST /_control/reset``: forget every script and log, or only K's with
    ``{"api_key": K}``.

    ``GET /metrics``: vLLM's ``vllm:num_requests_running`` (the chat completions in progress
    that came with this request's Host header: each URL the server plays a device by has its
    own) and ``vllm:num_requests_waiting`` (0), which the GPU pool's device choice reads.

The module also has the small client the tests use for the control API
(``upstream_script``, ``upstream_log``, ``upstream_reset``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STEP_KEYS = {
    "reply",
    "status",
    "retry_after_ms",
    "retry_after",
    "first_byte_delay_ms",
    "token_delay_ms",
    "keepalive_ms",
    "cut_after_tokens",
    "end_after_tokens",
    "no_usage",
    "loop",
    "repeat",
}
# The length of a looping reply (the "loop" step) without max_tokens.
LOOP_MAX_TOKENS = 4096
# Fields of the chat completions API; anything else in a body is logged under "extra".
CHAT_FIELDS = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "metadata",
    "store",
    "service_tier",
    "reasoning_effort",
}
ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", "model_not_found"),
    422: ("invalid_request_error", None),
    429: ("requests", "rate_limit_exceeded"),
}


def hashed_embedding(text: str, dimensions: int) -> list[float]:
    vector = [0.0] * dimensions
    for word in re.findall(r"\w+", text.lower()):
        bucket = int(hashlib.md5(word.encode()).hexdigest()[:8], 16) % dimensions  # noqa: S324 (not security)
        vector[bucket] += 1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


# --------------------------------------------------------------------------- replies


def message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def reply_text(messages: list[dict]) -> str:
    users = [message_text(m) for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    last = users[-1] if users else ""
    for line in last.splitlines():
        if line.startswith("REPLY:"):
            return line[len("REPLY:") :].removeprefix(" ")
    return "You said: " + " ".join(last.split()[:12])


def tokens_of(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text)


def prompt_tokens_of(messages: list[dict]) -> int:
    return sum(len(message_text(m).split()) for m in messages if isinstance(m, dict))


# --------------------------------------------------------------------------- state


class State:
    """Scripts and logs per API key, shared by the server's threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.scripts: dict[str, list] = {}
        self.logs: dict[str, list[dict]] = {}
        self.running: dict[str, int] = {}  # chat completions in progress, per Host header

    def next_step(self, key: str) -> dict | str:
        with self.lock:
            steps = self.scripts.get(key) or []
            if not steps:
                return "ok"
            step = steps[0]
            if not (isinstance(step, dict) and step.get("repeat")):
                steps.pop(0)
            return step

    def record(self, key: str, entry: dict) -> None:
        with self.lock:
            self.logs.setdefault(key, []).append(entry)
            self.running[entry["host"]] = self.running.get(entry["host"], 0) + 1

    def finish(self, entry: dict, outcome: str, **fields) -> None:
        with self.lock:
            if entry["finished"] is None:
                self.running[entry["host"]] -= 1
            entry.update(outcome=outcome, finished=time.time(), **fields)

    def running_on(self, host: str) -> int:
        with self.lock:
            return self.running.get(host, 0)

    def log(self, key: str) -> list[dict]:
        with self.lock:
            return json.loads(json.dumps(self.logs.get(key, [])))

    def reset(self, key: str | None) -> None:
        with self.lock:
            if key is None:
                self.scripts.clear()
                self.logs.clear()
            else:
                self.scripts.pop(key, None)
                self.logs.pop(key, None)


STATE = State()


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 for chunked streams; every response carries Content-Length or is chunked.
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as serving stacks set it (uvicorn, vLLM): without it, on a kept
    # connection each small chunk after the first waits for the client's delayed ACK (40 ms).
    disable_nagle_algorithm = True

    def log_message(self, format, *args):  # keep test output quiet
        pass

    def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        error_type, code = ERROR_TYPES.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
        self._json(status, {"error": {"message": message, "type": error_type, "param": None, "code": code}}, headers)

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        if url.path.rstrip("/") == "/healthz":
            self._json(200, {"status": "ok"})
        elif url.path == "/metrics":  # as vLLM's gauges, per device (Host header) it plays
            running = STATE.running_on(self.headers.get("Host"))
            payload = (
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="stand-in"}} {running}.0\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{model_name="stand-in"} 0.0\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        elif url.path == "/_control/log":
            key = urllib.parse.parse_qs(url.query).get("api_key", [None])[0]
            if not key:
                self._error(400, "api_key is required")
            else:
                self._json(200, {"requests": STATE.log(key)})
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
        elif self.path == "/v1/chat/completions":
            self._chat(body)
        elif self.path == "/_control/script":
            self._script(body)
        elif self.path == "/_control/reset":
            STATE.reset(body.get("api_key"))
            self._json(200, {"ok": True})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

    # ------------------------------------------------------------------ control

    def _script(self, body: dict) -> None:
        key, steps = body.get("api_key"), body.get("steps")
        if not key or not isinstance(steps, list):
            self._error(400, 'expected {"api_key": K, "steps": [...]}')
            return
        for step in steps:
            if step != "ok" and not (isinstance(step, dict) and set(step) <= STEP_KEYS):
                self._error(400, f"bad step {step!r}: 'ok' or an object with keys among {sorted(STEP_KEYS)}")
                return
        with STATE.lock:
            STATE.scripts[key] = list(steps)
        self._json(200, {"ok": True, "steps": len(steps)})

    # ------------------------------------------------------------------ chat

    def _chat(self, body: dict) -> None:
        auth = self.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not key:
            self._error(401, "You didn't provide an API key.")
            return
        step = STATE.next_step(key)
        options = {} if step == "ok" else step
        entry = {
            "key": key[-4:],
            "model": body.get("model"),
            "time": time.time(),
            "client_port": self.client_address[1],  # which connection: a kept one repeats its port
            "host": self.headers.get("Host"),
            "finished": None,
            "step": step,
            "outcome": None,
            "stream": bool(body.get("stream")),
            "stream_options": body.get("stream_options"),
            "speculative_config": body.get("speculative_config"),
            "extra": {name: value for name, value in body.items() if name not in CHAT_FIELDS},
            "max_tokens": body.get("max_tokens", body.get("max_completion_tokens")),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "seed": body.get("seed"),
            "stop": body.get("stop"),
            "messages": body.get("messages"),
            "prompt_tokens": None,
            "completion_tokens": None,
            "usage_sent": False,
            "tokens_planned": None,
            "disconnected": False,
        }
        STATE.record(key, entry)
        sent = 0
        try:
            if options.get("first_byte_delay_ms"):
                self._wait_unless_gone(options["first_byte_delay_ms"] / 1000)
            status = options.get("status")
            if status:
                self._scripted_error(int(status), options, key)
                STATE.finish(entry, f"status {status}")
                return
            messages = body.get("messages")
            if not body.get("model") or not isinstance(messages, list) or not messages:
                self._error(400, "model and a non-empty messages list are required")
                STATE.finish(entry, "status 400")
                return
            max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                self._error(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
                STATE.finish(entry, "status 400")
                return

            text = options["reply"] if isinstance(options.get("reply"), str) else reply_text(messages)
            if isinstance(options.get("loop"), str) and options["loop"].strip():
                # At least one token per copy: enough copies to reach max_tokens.
                copies = max_tokens if max_tokens is not None else LOOP_MAX_TOKENS
                text = text.rstrip() + " " + options["loop"] * copies
                max_tokens = max_tokens if max_tokens is not None else LOOP_MAX_TOKENS
            stops = body.get("stop") or []
            for stop in [stops] if isinstance(stops, str) else stops:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            tokens = tokens_of(text)
            finish_reason = "stop"
            if max_tokens is not None and len(tokens) > max_tokens:
                tokens, finish_reason = tokens[:max_tokens], "length"
            prompt_tokens = prompt_tokens_of(messages)
            if not body.get("stream"):
                self._json(200, self._completion(body, "".join(tokens), finish_reason, prompt_tokens, len(tokens)))
                STATE.finish(entry, "ok", prompt_tokens=prompt_tokens, completion_tokens=len(tokens), usage_sent=True)
                return
            entry["tokens_planned"] = len(tokens)
            outcome, sent, usage_sent = self._stream(body, options, tokens, finish_reason, prompt_tokens)
            STATE.finish(entry, outcome, prompt_tokens=prompt_tokens, completion_tokens=sent, usage_sent=usage_sent)
        except ClientGone as gone:
            self.close_connection = True
            sent = gone.args[0]
            STATE.finish(entry, f"client disconnected after {sent} tokens", completion_tokens=sent, disconnected=True)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            STATE.finish(entry, f"client disconnected after {sent} tokens", completion_tokens=sent, disconnected=True)

    def _scripted_error(self, status: int, options: dict, key: str) -> None:
        headers = {}
        if options.get("retry_after_ms") is not None:
            headers["retry-after-ms"] = str(options["retry_after_ms"])
        if options.get("retry_after") is not None:
            headers["Retry-After"] = str(options["retry_after"])
        messages = {
            401: f"Incorrect API key provided: {key}. You can find your API key at https://example.invalid/keys.",
            403: "Your key is not allowed to use this model.",
            404: "The model does not exist or you do not have access to it.",
            429: "Rate limit reached for requests. Please try again later.",
        }
        default = "The server had an error while processing your request." if status >= 500 else "Bad request."
        self._error(status, messages.get(status, default), headers)

    def _base(self, body: dict, created: int, completion_id: str) -> dict:
        return {"id": completion_id, "created": created, "model": body["model"], "system_fingerprint": "stand-in"}

    def _completion(self, body: dict, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int):
        return {
            **self._base(body, int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"),
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _write_chunk(self, data: bytes, sent: int) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise ClientGone(sent) from None

    def _wait_unless_gone(self, seconds: float) -> None:
        """Wait ``seconds`` before answering, watching the connection: a client that closes it
        (readable, and nothing to read: its FIN) ends the wait with ``ClientGone``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.02))
            if readable and self.connection.recv(1, socket.MSG_PEEK) == b"":
                raise ClientGone(0)

    def _pause(self, seconds: float, keepalive_ms: int | None, sent: int) -> None:
        if not keepalive_ms:
            time.sleep(seconds)
            return
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, keepalive_ms / 1000))
            if end - time.monotonic() > 0:
                self._write_chunk(b": keep-alive\n\n", sent)

    def _stream(self, body: dict, options: dict, tokens: list[str], finish_reason: str, prompt_tokens: int):
        """Send the SSE stream; returns (outcome, tokens sent, whether usage was sent)."""
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and not options.get("no_usage")
        base = {**self._base(body, int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"), "object": "chat.completion.chunk"}
        usage_field = {"usage": None} if include_usage else {}

        def event(delta: dict, finish: str | None = None) -> bytes:
            chunk = {
                **base,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                **usage_field,
            }
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        self._write_chunk(event({"role": "assistant", "content": "", "refusal": None}), sent)
        cut, end = options.get("cut_after_tokens"), options.get("end_after_tokens")
        for token in tokens:
            if cut is not None and sent >= cut:
                break
            if end is not None and sent >= end:
                break
            if options.get("token_delay_ms"):
                self._pause(options["token_delay_ms"] / 1000, options.get("keepalive_ms"), sent)
            self._write_chunk(event({"content": token}), sent)
            sent += 1
        if cut is not None and sent >= cut:
            self.close_connection = True  # the socket closes with the chunked body unfinished
            return f"cut after {sent} tokens", sent, False
        if end is not None and sent >= end:
            self._write_chunk(b"", sent)  # a zero-length chunk ends the body, cleanly
            return f"ended after {sent} tokens", sent, False
        self._write_chunk(event({}, finish_reason), sent)
        if include_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent, "total_tokens": prompt_tokens + sent}
            self._write_chunk(b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n", sent)
        self._write_chunk(b"data: [DONE]\n\n", sent)
        self._write_chunk(b"", sent)
        return "ok", sent, include_usage


# --------------------------------------------------------------------------- client for tests


def _control_base(base_url: str) -> str:
    """The server's root from the fixture's ``http://127.0.0.1:PORT/v1``."""
    return base_url.removesuffix("/").removesuffix("/v1")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def upstream_script(base_url: str, api_key: str, steps: list) -> None:
    _post(f"{_control_base(base_url)}/_control/script", {"api_key": api_key, "steps": steps})


def upstream_log(base_url: str, api_key: str, *, settle_s: float = 5.0) -> list[dict]:
    """``api_key``'s requests as the server logged them. A request whose response the client
    has read to its end may not be logged as finished yet (the server's thread records it after
    its last write): unfinished entries are read again for up to ``settle_s``."""
    query = urllib.parse.urlencode({"api_key": api_key})
    deadline = time.monotonic() + settle_s
    while True:
        with urllib.request.urlopen(f"{_control_base(base_url)}/_control/log?{query}", timeout=10) as response:
            requests = json.loads(response.read())["requests"]
        if all(entry["finished"] is not None for entry in requests) or time.monotonic() > deadline:
            return requests
        time.sleep(0.02)


def upstream_reset(base_url: str, api_key: str | None = None) -> None:
    _post(f"{_control_base(base_url)}/_control/reset", {"api_key": api_key} if api_key else {})


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """This server in a process of its own on a free loopback port; yields its ``/v1`` base URL
    once it answers, and stops it afterwards (the tests' fixture and the router benchmark)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.upstream_server", str(port)], cwd=root, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=1).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the upstream stand-in did not start") from None
                time.sleep(0.1)
        yield f"{base}/v1"
    finally:
        process.terminate()
        process.wait(timeout=10)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's listen backlog is 5: a burst of new connections (a hundred clients of
    # the gateway benchmark starting at once) had SYNs dropped and retried a second later.
    request_queue_size = 1024


def main() -> None:
    _Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()


if __name__ == "__main__":
    main()
