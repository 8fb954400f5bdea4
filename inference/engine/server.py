"""Our speculative-decoding engine behind vLLM's OpenAI-compatible HTTP protocol, at batch 1.

The engine is the exact reference; this server lets the same client code (``inference.remote``)
and benchmarks drive it as they drive vLLM: ``GET /health``, ``GET /v1/models``,
``POST /v1/chat/completions`` (streamed or not) and ``GET /metrics`` (Prometheus, vLLM's names).
One sequence is decoded at a time (a lock around generation), as the in-house pool served;
requests queued on that lock are ``vllm:num_requests_waiting``.

    python -m inference.engine.server --model PATH [--draft-model PATH]
        [--speculative off|ngram|draft|both] [--k 4] [--dtype auto|float32|bfloat16]
        [--host 127.0.0.1] [--port 8000] [--served-model-name NAME] [--max-model-len N] [--threads N]

With speculation on, the usage-bearing data (the usage chunk of a stream, the response itself
otherwise) carries ``metrics.speculative_decoding`` in vLLM's ``SpeculativeDecodingMetrics``
shape (``speculative_metrics``). Standard library HTTP only; no Django import.
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inference.engine.models import LoadedModels, models_load
from inference.engine.speculative import (
    METHODS,
    GenerationRequest,
    GenerationStats,
    SpeculativeConfig,
    generate,
    validate,
)
from inference.requests import GenerationError

logger = logging.getLogger("inference.engine.server")  # the same name under -m

MAX_BODY_BYTES = 32 * 1024 * 1024
# OpenAI's defaults (and vLLM's for a model whose generation_config sets none).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


class RequestError(Exception):
    """An HTTP error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = status if code is None else code

    def body(self) -> dict:
        kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "BadRequestError"}
        return {
            "error": {
                "message": str(self),
                "type": kind.get(self.status, "InternalServerError"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str | None, message: str) -> RequestError:
    return RequestError(400, message, param=param)


# --------------------------------------------------------------------------- metrics


def speculative_metrics(stats: GenerationStats, k: int) -> dict:
    """vLLM's per-request ``SpeculativeDecodingMetrics`` from the engine's stats.

    A verify step is a target pass that checked proposed tokens (``stats.drafts``). The
    histogram comes from ``accepted_per_position``: a step accepts a prefix of its proposal,
    so the steps that accepted at least ``j`` tokens are ``accepted_per_position[j - 1]``.
    """
    steps = stats.drafts
    per_position = (list(stats.accepted_per_position) + [0] * k)[:k]
    at_least = [steps, *per_position, 0]  # at_least[j]: steps that accepted >= j draft tokens
    histogram = [at_least[j] - at_least[j + 1] for j in range(k + 1)]
    accepted, proposed = stats.draft_tokens_accepted, stats.draft_tokens_proposed
    return {
        # Tokens produced per verify step (the bonus token included); 1.0 when no step ran.
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / proposed if proposed else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": proposed,
        "num_spec_tokens": k,
    }


class ServerMetrics:
    """The Prometheus series vLLM exposes that this engine can fill, in a registry of their own.

    A collector over plain numbers rather than prometheus_client's Counter/Gauge: those switch
    to shared files when ``PROMETHEUS_MULTIPROC_DIR`` is set (the web app's setting), and these
    figures belong to this server alone, in-process too. No ``*_created`` series, as vLLM.
    """

    def __init__(self, model_name: str, speculative: SpeculativeConfig):
        self.model_name = model_name
        self.spec = speculative.method != "off"
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0] * speculative.k
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def record(self, stats: GenerationStats) -> None:
        """A finished generation's tokens and speculation figures."""
        with self._lock:
            self.generation_tokens += stats.completion_tokens
            self.drafts += stats.drafts
            self.draft_tokens += stats.draft_tokens_proposed
            self.accepted += stats.draft_tokens_accepted
            for position, count in enumerate(stats.accepted_per_position):
                if position >= len(self.accepted_per_pos):
                    self.accepted_per_pos.append(0)
                self.accepted_per_pos[position] += count

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            fields = ("running", "waiting", "prompt_tokens", "generation_tokens", "drafts", "draft_tokens", "accepted")
            snapshot = {field: getattr(self, field) for field in fields}
            per_pos = list(self.accepted_per_pos)
        name = [self.model_name]

        def family(kind, metric: str, doc: str, value: int) -> GaugeMetricFamily | CounterMetricFamily:
            series = kind(metric, doc, labels=["model_name"])
            series.add_metric(name, value)
            return series

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in generation.", snapshot["running"])
        yield family(
            GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting for the engine.", snapshot["waiting"]
        )
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Prefill tokens processed.", snapshot["prompt_tokens"])
        yield family(
            CounterMetricFamily, "vllm:generation_tokens", "Generation tokens produced.", snapshot["generation_tokens"]
        )
        if not self.spec:
            return  # vLLM exposes the spec_decode series only with speculation configured
        yield family(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Verify steps.", snapshot["drafts"])
        yield family(
            CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens.", snapshot["draft_tokens"]
        )
        yield family(
            CounterMetricFamily,
            "vllm:spec_decode_num_accepted_tokens",
            "Accepted draft tokens.",
            snapshot["accepted"],
        )
        positions = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens per position in the proposal.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(per_pos):
            positions.add_metric([self.model_name, str(position)], count)
        yield positions


# --------------------------------------------------------------------------- engine


@dataclass
class Engine:
    """Loaded models plus the one lock that makes generation batch 1."""

    models: LoadedModels
    speculative: SpeculativeConfig
    served_model_name: str
    max_model_len: int
    metrics: ServerMetrics = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    # Encoding runs outside the generation lock; a fast tokenizer's backend may be mutated by
    # encode (truncation/padding state) and refuses concurrent borrows ("Already borrowed").
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.served_model_name, self.speculative)
        self.vocab_size = self.models.target.get_output_embeddings().weight.shape[0]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The tokenizer's chat template with a generation prompt when it has one, else the
        contents joined by a blank line, encoded."""
        tokenizer = self.models.tokenizer
        with self.tokenizer_lock:
            if not getattr(tokenizer, "chat_template", None):
                return list(tokenizer.encode("\n\n".join(message["content"] for message in messages)))
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # a template may raise on roles it does not know
                raise bad_request("messages", f"the chat template refused these messages: {exc}") from None
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # transformers 5: a BatchEncoding
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(token) for token in ids]

    def request(self, body: dict) -> tuple[GenerationRequest, bool, bool]:
        """The engine request for a chat completion body, validated as the engine would;
        with ``stream`` and ``include_usage``. Raises ``RequestError``."""
        model = body.get("model")
        if model is not None and model != self.served_model_name:
            raise RequestError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        messages = _messages(body.get("messages"))
        n = _integer(body, "n", 1)
        if n != 1:
            raise bad_request("n", f"only n=1 is served (one sequence at a time), got {n}")
        prompt = self.prompt_ids(messages)
        if len(prompt) >= self.max_model_len:
            raise bad_request(
                "messages",
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{len(prompt)} input tokens. Please reduce the length of the input messages.",
            )
        max_tokens = _integer(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None)
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)  # vLLM's default: the rest of the window
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            stop = []
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop", f"must be a string or a list of strings, got {body.get('stop')!r}")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise bad_request("stream", f"must be a boolean, got {stream!r}")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad_request("stream_options", f"must be an object, got {options!r}")
        request = GenerationRequest(
            prompt_ids=prompt,
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", DEFAULT_TEMPERATURE),
            top_p=_number(body, "top_p", DEFAULT_TOP_P),
            stop=tuple(stop),
            seed=_integer(body, "seed", None),
            speculative=self.speculative,
        )
        try:
            # Up front, so a refused request is a 400 before any stream starts (generate
            # runs the same checks only on its first next()).
            validate(
                request,
                context_window=self.max_model_len,
                has_draft=self.models.draft is not None,
                vocab_size=self.vocab_size,
            )
        except GenerationError as exc:
            raise bad_request(exc.field, str(exc)) from None
        return request, stream, bool(options.get("include_usage"))

    def run(self, request: GenerationRequest) -> Iterator[str | GenerationStats]:
        """The engine's pieces then its stats, holding the lock throughout (batch 1).

        Closing the iterator early (a client gone) stops generation and frees the lock.
        """
        metrics = self.metrics
        metrics.add(waiting=1)
        try:
            self.lock.acquire()
        finally:
            metrics.add(waiting=-1)
        pieces = None
        try:
            metrics.add(running=1, prompt_tokens=len(request.prompt_ids))
            pieces = generate(
                request,
                target=self.models.target,
                tokenizer=self.models.tokenizer,
                draft=self.models.draft,
                context_window=self.max_model_len,
            )
            for piece in pieces:
                if isinstance(piece, GenerationStats):
                    # Counted before the client sees the end, so /metrics read after a
                    # response already includes it.
                    metrics.record(piece)
                yield piece
        finally:
            if pieces is not None:
                pieces.close()
            metrics.add(running=-1)
            self.lock.release()

    def speculative_report(self, stats: GenerationStats) -> dict | None:
        if self.speculative.method == "off":
            return None
        return {"speculative_decoding": speculative_metrics(stats, self.speculative.k)}


def _messages(value) -> list[dict[str, str]]:
    """Messages as ``[{role, content: text}]``; text parts of a content list are joined."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages", "must be a non-empty list of messages")
    messages = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("messages", f"each message must be an object with a role, got {message!r}")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
            )
        elif content is None:
            content = ""  # an assistant turn with tool calls only
        elif not isinstance(content, str):
            raise bad_request("messages", f"a message's content must be a string or a list of parts, got {content!r}")
        messages.append({"role": message["role"], "content": content})
    return messages


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"must be an integer, got {value!r}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(name, f"must be a number, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- HTTP


class ClientGone(Exception):
    """The client closed its connection; the generation it asked for is abandoned."""


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keep-alive: every response has a Content-Length or is chunked.
    protocol_version = "HTTP/1.1"
    server_version = "ragsite-engine"
    # Token chunks are small writes; Nagle plus delayed ACKs would hold each back ~40 ms.
    disable_nagle_algorithm = True
    timeout = 300  # an idle keep-alive connection is dropped after this long
    server: EngineServer

    def log_message(self, format: str, *args) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    # ----- routing

    def do_GET(self) -> None:
        engine = self.server.engine
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, b"", "text/plain")
        elif path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": engine.served_model_name,
                            "object": "model",
                            "created": int(self.server.started),
                            "owned_by": "ragsite",
                            "max_model_len": engine.max_model_len,
                        }
                    ],
                },
            )
        elif path == "/metrics":
            self._send(200, generate_latest(engine.metrics.registry), CONTENT_TYPE_LATEST)
        else:
            self._error(RequestError(404, f"no route for GET {self.path}"))

    def do_POST(self) -> None:
        try:
            raw = self._body()  # read whole first, so the connection stays usable after an error
            if self.path.split("?", 1)[0] != "/v1/chat/completions":
                raise RequestError(404, f"no route for POST {self.path}")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise bad_request(None, f"the body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise bad_request(None, "the body must be a JSON object")
            request, stream, include_usage = self.server.engine.request(body)
        except RequestError as exc:
            self._error(exc)
            return
        if stream:
            self._stream(request, include_usage)
        else:
            self._complete(request)

    # ----- chat completions

    def _complete(self, request: GenerationRequest) -> None:
        engine = self.server.engine
        text: list[str] = []
        stats = None
        pieces = engine.run(request)
        try:
            for piece in pieces:
                if isinstance(piece, GenerationStats):
                    stats = piece
                else:
                    text.append(piece)
                    if self._client_gone():
                        logger.info("client %s went away; generation stopped", self.address_string())
                        self.close_connection = True
                        return
        except Exception as exc:
            logger.exception("generation failed")
            self._error(RequestError(500, f"generation failed: {exc}"))
            return
        finally:
            pieces.close()  # stops the engine and frees the lock when it did not finish
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": engine.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(text)},
                    "logprobs": None,
                    "finish_reason": stats.finish_reason,
                }
            ],
            "usage": _usage(stats),
        }
        report = engine.speculative_report(stats)
        if report is not None:
            body["metrics"] = report
        self._json(200, body)

    def _stream(self, request: GenerationRequest, include_usage: bool) -> None:
        engine = self.server.engine
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices: list, **extra) -> dict:
            body = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": engine.served_model_name,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = None  # OpenAI: null on every chunk but the last
            body.update(extra)
            return body

        def choice(delta: dict, finish_reason: str | None = None) -> list:
            return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]

        pieces = engine.run(request)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for index, piece in enumerate(pieces):
                    if self._client_gone():
                        raise ClientGone
                    if index == 0:
                        # With the first output, as vLLM does: a queued request shows no progress.
                        self._event(chunk(choice({"role": "assistant", "content": ""})))
                    if isinstance(piece, GenerationStats):
                        self._event(chunk(choice({}, piece.finish_reason)))
                        if include_usage:
                            final = chunk([], usage=_usage(piece))
                            report = engine.speculative_report(piece)
                            if report is not None:
                                final["metrics"] = report
                            self._event(final)
                    else:
                        self._event(chunk(choice({"content": piece})))
            except (ClientGone, OSError):
                raise
            except Exception as exc:
                # The response has begun: the error travels as an event, as vLLM sends it.
                logger.exception("generation failed mid-stream")
                self._event(RequestError(500, f"generation failed: {exc}").body())
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")  # the last chunk of the chunked body
        except (ClientGone, OSError):
            logger.info("client %s went away; generation stopped", self.address_string())
            self.close_connection = True
        finally:
            pieces.close()  # stops the engine and frees the lock when it did not finish

    def _client_gone(self) -> bool:
        """True when the peer has closed its end (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ----- wire

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        try:
            size = int(length) if length is not None else 0
        except ValueError:
            self.close_connection = True
            raise bad_request(None, f"bad Content-Length {length!r}") from None
        if size > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread: the connection cannot be reused
            raise RequestError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        return self.rfile.read(size) if size else b""

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _error(self, error: RequestError) -> None:
        self._json(error.status, error.body())

    def _chunk(self, payload: bytes) -> None:
        # One write per chunk (size line, data, CRLF): the socket writer is unbuffered.
        self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))

    def _event(self, body: dict) -> None:
        self._chunk(b"data: " + json.dumps(body).encode() + b"\n\n")


def _usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


class EngineServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding the ``Engine``; ``serve_forever``/``shutdown`` as usual."""

    daemon_threads = True  # a keep-alive connection must not hold the process at exit

    def __init__(self, address: tuple[str, int], engine: Engine):
        self.engine = engine
        self.started = time.time()
        super().__init__(address, Handler)


def server_build(
    models: LoadedModels,
    *,
    speculative: SpeculativeConfig | None = None,
    served_model_name: str = "model",
    host: str = "127.0.0.1",
    port: int = 0,
    max_model_len: int | None = None,
) -> EngineServer:
    """A bound (not yet serving) server for loaded models (``models_load``'s result).

    ``port=0`` picks a free port (``server.server_address``). ``max_model_len`` may only
    narrow the model's own window. Raises ``GenerationError`` for a setting that cannot run.
    """
    speculative = speculative or SpeculativeConfig()
    if speculative.method not in METHODS:
        raise GenerationError("speculative", f"must be one of {', '.join(METHODS)}, got {speculative.method!r}")
    if speculative.method in ("draft", "both") and models.draft is None:
        raise GenerationError("speculative", f"{speculative.method!r} needs --draft-model")
    if not 1 <= speculative.k <= 16:
        raise GenerationError("k", f"must be between 1 and 16, got {speculative.k}")
    window = models.context_window
    if max_model_len is not None and not 1 <= max_model_len <= window:
        raise GenerationError(
            "max_model_len", f"must be between 1 and the model's window ({window}), got {max_model_len}"
        )
    engine = Engine(models, speculative, served_model_name, max_model_len or window)
    return EngineServer((host, port), engine)


# --------------------------------------------------------------------------- CLI


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inference.engine.server", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="target model path (or hub name)")
    parser.add_argument("--draft-model", help="draft model path, same tokenizer as the target")
    parser.add_argument(
        "--speculative", choices=METHODS, help="proposals to verify (default: draft with --draft-model, else off)"
    )
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per verify step (1-16)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    parser.add_argument("--max-model-len", type=int, help="context window, at most the model's own")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.speculative is None:
        args.speculative = "draft" if args.draft_model else "off"
    if args.speculative in ("draft", "both") and not args.draft_model:
        parser.error(f"--speculative {args.speculative} needs --draft-model")
    if not 1 <= args.k <= 16:
        parser.error(f"--k must be between 1 and 16, got {args.k}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        models = models_load(
            args.model,
            args.draft_model if args.speculative in ("draft", "both") else None,
            dtype=None if args.dtype == "auto" else args.dtype,
        )
        server = server_build(
            models,
            speculative=SpeculativeConfig(method=args.speculative, k=args.k),
            served_model_name=args.served_model_name or args.model,
            host=args.host,
            port=args.port,
            max_model_len=args.max_model_len,
        )
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, the host is not ours
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # serve_forever on a thread: shutdown() waits for its loop, so it cannot run on the same one.
    thread = threading.Thread(target=server.serve_forever, name="engine-server", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"ready on http://{host}:{port}", flush=True)
    while not stop.wait(0.2):
        pass
    logger.info("stopping")
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
