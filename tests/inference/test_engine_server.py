"""The engine behind vLLM's OpenAI protocol (``inference.engine.server``): real server processes,
the official ``openai`` client, and the engine's own ``generate`` as the exact reference."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.engine.models import models_load
from inference.engine.server import server_build
from inference.engine.speculative import GenerationRequest, GenerationStats, SpeculativeConfig, generate
from inference.requests import GenerationError
from tests.conftest import PROJECT_ROOT
from tests.inference.tiny_models import tiny_model_save, tiny_tokenizer

pytestmark = pytest.mark.slow

SYSTEM = "the data of the test"
PROMPT = "the wing flow of the shock wave is high and the lift of the wing flow is low"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
# Every word in the tiny vocabulary, so the rendered prompt is checkable word by word.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} the {% endfor %}{% if add_generation_prompt %}result is{% endif %}"
)
MAX_TOKENS = 24
K = 4


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    port: int
    model: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=60)

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(self.base_url + path, timeout=10) as response:
            return response.status, response.read()

    def metrics(self) -> dict[tuple[str, str | None], float]:
        """Samples by (name, position label); every series carries model_name == self.model."""
        values = {}
        for family in text_string_to_metric_families(self.get("/metrics")[1].decode()):
            for sample in family.samples:
                assert sample.labels["model_name"] == self.model
                values[(sample.name, sample.labels.get("position"))] = sample.value
        return values

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    plain = tiny_model_save(tmp_path_factory.mktemp("plain"), 1)
    templated = tiny_model_save(tmp_path_factory.mktemp("templated"), 2)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(templated)
    return {"plain": plain, "templated": templated}


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    """Three servers started together (their imports overlap): ngram on the plain model,
    speculation off on the templated one, and a draft server whose draft is its target."""
    logs = tmp_path_factory.mktemp("server-logs")
    plain, templated = model_dirs["plain"], model_dirs["templated"]
    settings = {
        "ngram": (plain, ["--speculative", "ngram", "--k", str(K)]),
        "off": (templated, ["--speculative", "off", "--served-model-name", "tiny-templated"]),
        "draft": (plain, ["--draft-model", plain, "--speculative", "draft", "--served-model-name", "tiny-draft"]),
    }
    started: dict[str, Server] = {}
    for name, (model, options) in settings.items():
        port = free_port()
        log_path = logs / f"{name}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "inference.engine.server", "--model", model, "--dtype", "float32"),
                    *("--port", str(port), "--threads", "1", *options),
                ],
                cwd=PROJECT_ROOT,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        served = options[options.index("--served-model-name") + 1] if "--served-model-name" in options else model
        started[name] = Server(name, process, port, served, log_path)
    try:
        deadline = time.monotonic() + 120
        for server in started.values():
            while True:
                assert server.process.poll() is None, f"{server.name} exited:\n{server.log()}"
                assert time.monotonic() < deadline, f"{server.name} never became healthy:\n{server.log()}"
                try:
                    if server.get("/health") == (200, b""):
                        break
                except OSError:
                    pass
                time.sleep(0.2)
        yield started
    finally:
        codes = {}
        for server in started.values():
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in started.values():
            try:
                server.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
            codes[server.name] = (server.process.returncode, server.process.stdout.read())
            server.process.stdout.close()
    # SIGTERM ends each cleanly, after its one line on stdout.
    for name, (code, stdout) in codes.items():
        assert code == 0, f"{name} exited {code}:\n{started[name].log()}"
        assert stdout == f"ready on http://127.0.0.1:{started[name].port}\n"


def reference(path: str, prompt_ids: list[int], *, method: str = "off", max_tokens: int = MAX_TOKENS, **options):
    """The engine's own pieces and stats, in this process, for the same prompt ids."""
    models = models_load(path, dtype="float32")
    request = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens, speculative=SpeculativeConfig(method=method, k=K), **options
    )
    pieces = list(generate(request, target=models.target, tokenizer=models.tokenizer, draft=models.draft))
    stats = pieces[-1]
    assert isinstance(stats, GenerationStats)
    return pieces[:-1], stats


def plain_prompt_ids(path: str) -> list[int]:
    # No chat template: the contents joined by a blank line.
    return models_load(path, dtype="float32").tokenizer.encode(f"{SYSTEM}\n\n{PROMPT}")


def stream(server: Server, client: openai.OpenAI | None = None, **options) -> tuple[str, list]:
    """A streamed completion of MESSAGES (greedy, MAX_TOKENS unless ``options`` say otherwise)."""
    client = client or server.client()
    options = {"max_tokens": MAX_TOKENS, "temperature": 0, **options}
    chunks = list(
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **options
        )
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    return text, chunks


def complete(server: Server, **options):
    options = {"max_tokens": MAX_TOKENS, "temperature": 0, **options}
    return server.client().chat.completions.create(model=server.model, messages=MESSAGES, **options)


def spec_of(data) -> dict | None:
    return ((data.model_extra or {}).get("metrics") or {}).get("speculative_decoding")


def check_chunks(chunks: list, prompt_tokens: int, completion_tokens: int, finish_reason: str = "length") -> None:
    first, finish, last = chunks[0], chunks[-2], chunks[-1]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert finish.choices[0].finish_reason == finish_reason and finish.choices[0].delta.content is None
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-2])
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
    )
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_health_and_models(servers):
    server = servers["off"]
    models = server.client().models.list().data
    assert [(model.id, model.object, model.owned_by) for model in models] == [("tiny-templated", "model", "ragsite")]
    assert models[0].model_extra["max_model_len"] == 512
    status, body = servers["ngram"].get("/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == servers["ngram"].model


def test_ngram_server_answers_exactly_the_engines_output_with_vllms_metrics(servers, model_dirs):
    server = servers["ngram"]
    ids = plain_prompt_ids(model_dirs["plain"])
    pieces, stats = reference(model_dirs["plain"], ids, method="ngram")
    expected = "".join(pieces)
    assert stats.drafts > 0 and stats.draft_tokens_accepted > 0  # the prompt makes prompt lookup work

    before = server.metrics()
    text, chunks = stream(server)
    after = server.metrics()

    assert text == expected
    check_chunks(chunks, len(ids), MAX_TOKENS)
    # One chunk per piece the engine yields.
    assert [chunk.choices[0].delta.content for chunk in chunks[1:-2]] == pieces
    spec = spec_of(chunks[-1])
    steps, accepted, proposed = spec["num_spec_steps"], spec["num_accepted_draft_tokens"], spec["num_draft_tokens"]
    assert (steps, accepted, proposed, spec["num_spec_tokens"]) == (
        stats.drafts,
        stats.draft_tokens_accepted,
        stats.draft_tokens_proposed,
        K,
    )
    assert accepted <= proposed
    histogram = spec["acceptance_histogram"]
    assert len(histogram) == K + 1 and sum(histogram) == steps
    assert sum(j * count for j, count in enumerate(histogram)) == accepted
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted / proposed)

    def delta(name: str, position: str | None = None) -> float:
        return after[(name, position)] - before[(name, position)]

    assert delta("vllm:spec_decode_num_drafts_total") == steps
    assert delta("vllm:spec_decode_num_draft_tokens_total") == proposed
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == accepted
    for position in range(K):
        # A step accepts a prefix of its proposal: position i is accepted by steps that took > i.
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(position)) == sum(
            histogram[position + 1 :]
        )
    assert delta("vllm:prompt_tokens_total") == len(ids)
    assert delta("vllm:generation_tokens_total") == MAX_TOKENS
    assert after[("vllm:num_requests_running", None)] == 0
    assert after[("vllm:num_requests_waiting", None)] == 0

    response = complete(server)
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        len(ids),
        MAX_TOKENS,
        len(ids) + MAX_TOKENS,
    )
    assert spec_of(response) == spec  # greedy: the same steps again


def test_speculation_off_with_a_chat_template(servers, model_dirs):
    server = servers["off"]
    # The template's rendering, written out by hand.
    ids = tiny_tokenizer().encode(f"{SYSTEM} the {PROMPT} the result is")
    pieces, stats = reference(model_dirs["templated"], ids)
    expected = "".join(pieces)
    assert models_load(model_dirs["templated"], dtype="float32").tokenizer.chat_template == TEMPLATE

    text, chunks = stream(server)
    assert text == expected
    check_chunks(chunks, len(ids), stats.completion_tokens)
    assert "metrics" not in (chunks[-1].model_extra or {})

    response = complete(server)
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == MAX_TOKENS
    assert "metrics" not in (response.model_extra or {})
    assert not any(name.startswith("vllm:spec_decode") for name, _ in server.metrics())

    # stop (a list) ends the text before it; seeded sampling reaches the engine as given.
    stop = expected.split()[5]
    text, chunks = stream(server, stop=[stop, "no such words"])
    assert text == expected[: expected.index(stop)]
    assert chunks[-2].choices[0].finish_reason == "stop"
    sampled = "".join(reference(model_dirs["templated"], ids, temperature=0.9, seed=7)[0])
    text, _ = stream(server, temperature=0.9, seed=7)
    assert text == sampled == complete(server, temperature=0.9, seed=7).choices[0].message.content


def test_a_draft_that_is_the_target_has_every_proposal_accepted(servers, model_dirs):
    server = servers["draft"]
    ids = plain_prompt_ids(model_dirs["plain"])
    expected = "".join(reference(model_dirs["plain"], ids)[0])
    text, chunks = stream(server)
    assert text == expected
    spec = spec_of(chunks[-1])
    assert spec["num_draft_tokens"] > 0
    assert spec["num_accepted_draft_tokens"] == spec["num_draft_tokens"]
    assert spec["draft_acceptance_rate"] == 1.0
    assert spec["acceptance_histogram"][0] == 0  # no step rejected its first proposal
    assert spec["mean_acceptance_length"] > 1.0


def test_errors_have_openais_shape(servers):
    server = servers["ngram"]
    client = server.client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert (not_found.value.status_code, not_found.value.code, not_found.value.param) == (
        404,
        "model_not_found",
        "model",
    )
    cases = [
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"stop": 3}, "stop"),
        ({"max_tokens": 600}, "max_tokens"),  # prompt + max_tokens beyond the window
    ]
    for options, param in cases:
        body = {"max_tokens": 4, **options}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=server.model, messages=MESSAGES, **body)
        assert refused.value.param == param, options
        assert refused.value.type == "BadRequestError"
    long_prompt = [{"role": "user", "content": " ".join(["wing"] * 600)}]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=server.model, messages=long_prompt, max_tokens=4)
    assert too_long.value.param == "messages"
    assert "maximum context length is 512 tokens" in too_long.value.message
    # Unknown fields are ignored, as vLLM does; the connection serves on after errors.
    text, _ = stream(server, client, max_tokens=4, extra_body={"no_such_field": 1})
    assert text


def test_concurrent_requests_are_served_one_at_a_time(servers, model_dirs):
    server = servers["ngram"]
    expected = "".join(reference(model_dirs["plain"], plain_prompt_ids(model_dirs["plain"]), method="ngram")[0])
    client = server.client()  # one client, one connection pool, as a benchmark runs it
    results: list[str] = []
    waiting_seen: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            waiting_seen.append(server.metrics()[("vllm:num_requests_waiting", None)])

    before = server.metrics()
    poller = threading.Thread(target=poll)
    poller.start()
    requests = [threading.Thread(target=lambda: results.append(stream(server, client)[0])) for _ in range(4)]
    for thread in requests:
        thread.start()
    for thread in requests:
        thread.join(60)
    done.set()
    poller.join()
    assert results == [expected] * 4
    assert max(waiting_seen) >= 1
    generated = (
        server.metrics()[("vllm:generation_tokens_total", None)] - before[("vllm:generation_tokens_total", None)]
    )
    assert generated == 4 * MAX_TOKENS
    # Sequential requests over the same keep-alive pool keep working.
    for _ in range(3):
        assert stream(server, client, max_tokens=4)[0] == " ".join(expected.split()[:4])


def test_a_client_that_leaves_mid_stream_stops_its_generation(servers):
    server = servers["ngram"]
    before = server.metrics()
    body = json.dumps(
        {"model": server.model, "messages": MESSAGES, "max_tokens": 480, "temperature": 0, "stream": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        while b'"delta": {"content": ' not in received:  # the first token, past the role chunk
            data = connection.recv(4096)
            assert data, received
            received += data
    # The lock is free again at once: the next request completes, and only its tokens counted
    # (the abandoned generation ended before its stats).
    _, chunks = stream(server, max_tokens=8)
    assert chunks[-1].usage.completion_tokens == 8
    after = server.metrics()
    assert after[("vllm:generation_tokens_total", None)] - before[("vllm:generation_tokens_total", None)] == 8
    assert after[("vllm:num_requests_running", None)] == 0


def test_server_build_serves_in_process(model_dirs):
    models = models_load(model_dirs["plain"], dtype="float32")
    with pytest.raises(GenerationError) as refused:
        server_build(models, speculative=SpeculativeConfig(method="draft"))
    assert refused.value.field == "speculative"
    server = server_build(models, speculative=SpeculativeConfig(method="ngram", k=K), served_model_name="local")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0)
        response = client.chat.completions.create(model="local", messages=MESSAGES, max_tokens=4, temperature=0)
        pieces, stats = reference(model_dirs["plain"], plain_prompt_ids(model_dirs["plain"]), max_tokens=4)
        assert response.choices[0].message.content == "".join(pieces)
        assert response.usage.completion_tokens == stats.completion_tokens
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
