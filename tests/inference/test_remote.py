"""Remote generation against the OpenAI-protocol stand-in (a real process), through the official client.

Each test uses its own API key, so the stand-in's per-key scripts and logs never mix
between tests. Timeouts are generous: the assertions are about outcomes, not speed.
"""

from __future__ import annotations

import math
import socket
import time
import uuid
from datetime import UTC, datetime

import openai
import pytest

from inference import remote
from inference.engine.speculative import GenerationError
from inference.remote import (
    RemoteEndpoint,
    RemoteRequest,
    RemoteStats,
    UpstreamError,
    estimate_prompt_tokens,
    retry_after_seconds,
    stream_chat,
)
from inference.streams import stream_read
from inference.tasks import generate_remote
from tests.upstream_server import upstream_log, upstream_reset, upstream_script

REPLY = "Lift rises with the angle of attack until the wing stalls near fifteen degrees."
WORDS = ["Lift", " rises", " with", " the", " angle", " of", " attack", " until", " the", " wing", " stalls"]
WORDS += [" near", " fifteen", " degrees."]
PROMPT = f"Answer from the passages.\nREPLY: {REPLY}"


@pytest.fixture
def api_key() -> str:
    return f"sk-test-{uuid.uuid4().hex}"


@pytest.fixture
def endpoint(upstream_server, api_key) -> RemoteEndpoint:
    return RemoteEndpoint(
        base_url=upstream_server, api_key=api_key, model="stand-in-7b", first_token_timeout_s=10, total_timeout_s=30
    )


def chat(prompt: str = PROMPT, **fields) -> RemoteRequest:
    return RemoteRequest(messages=[{"role": "user", "content": prompt}], **fields)


def run(endpoint: RemoteEndpoint, request: RemoteRequest) -> tuple[list[str], RemoteStats | None, UpstreamError | None]:
    """Deltas, stats and error of one call, collected."""
    deltas, stats = [], None
    try:
        for piece in stream_chat(endpoint, request):
            if isinstance(piece, RemoteStats):
                stats = piece
            else:
                deltas.append(piece)
    except UpstreamError as error:
        return deltas, stats, error
    return deltas, stats, None


# --------------------------------------------------------------------------- success


def test_the_reply_streams_as_deltas_with_the_upstreams_usage(endpoint, upstream_server, api_key):
    deltas, stats, error = run(endpoint, chat(temperature=0.7, top_p=0.9, seed=7, stop=("zzz",), max_tokens=64))

    assert error is None
    assert deltas == WORDS
    assert "".join(deltas) == REPLY
    [seen] = upstream_log(upstream_server, api_key)
    assert seen["key"] == api_key[-4:]
    assert seen["outcome"] == "ok" and seen["usage_sent"] is True
    assert (seen["model"], seen["stream"], seen["stream_options"]) == ("stand-in-7b", True, {"include_usage": True})
    assert (seen["max_tokens"], seen["temperature"], seen["top_p"], seen["seed"], seen["stop"]) == (
        64,
        0.7,
        0.9,
        7,
        ["zzz"],
    )
    assert seen["speculative_config"] is None and seen["extra"] == {}
    assert stats.usage_source == "upstream"
    assert (stats.prompt_tokens, stats.completion_tokens) == (seen["prompt_tokens"], seen["completion_tokens"])
    assert stats.completion_tokens == len(WORDS)
    assert stats.finish_reason == "stop" and stats.model == "stand-in-7b"
    assert 0 < stats.time_to_first_token_ms <= stats.total_ms
    summary = stats.as_dict()
    assert list(summary) == [
        "prompt_tokens",
        "completion_tokens",
        "time_to_first_token_ms",
        "tokens_per_s",
        "total_ms",
        "finish_reason",
        "usage_source",
        "model",
    ]
    assert summary["tokens_per_s"] > 0


def test_usage_is_counted_when_the_upstream_sends_none(endpoint, upstream_server, api_key):
    upstream_script(upstream_server, api_key, [{"no_usage": True}])
    deltas, stats, error = run(endpoint, chat())

    assert error is None and deltas == WORDS
    [seen] = upstream_log(upstream_server, api_key)
    assert seen["usage_sent"] is False
    assert stats.usage_source == "counted"
    assert stats.completion_tokens == len(deltas) == seen["completion_tokens"]
    assert stats.prompt_tokens == math.ceil(len(PROMPT) / 4) == estimate_prompt_tokens([{"content": PROMPT}])


def test_max_tokens_cuts_the_reply_with_finish_reason_length(endpoint):
    deltas, stats, error = run(endpoint, chat(max_tokens=3))
    assert error is None
    assert deltas == WORDS[:3]
    assert (stats.completion_tokens, stats.finish_reason) == (3, "length")


def test_the_stand_in_also_answers_without_streaming(upstream_server, api_key):
    client = openai.OpenAI(base_url=upstream_server, api_key=api_key, max_retries=0)
    response = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "what is lift"}])
    assert response.choices[0].message.content == "You said: what is lift"
    assert response.choices[0].finish_reason == "stop"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 5)
    assert upstream_log(upstream_server, api_key)[0]["stream"] is False


# --------------------------------------------------------------------------- speculative settings


@pytest.mark.parametrize(
    ("speculative", "expected"),
    [
        (
            {"method": "ngram", "k": 5},
            {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        ),
        (
            {"method": "ngram", "k": 3, "ngram_max": 6, "ngram_min": 1},
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 6, "prompt_lookup_min": 1},
        ),
        (
            {"method": "draft", "k": 4, "draft_model": "stand-in-0.5b"},
            {"method": "draft_model", "num_speculative_tokens": 4, "model": "stand-in-0.5b"},
        ),
        ({"method": "off"}, None),
    ],
)
def test_speculative_settings_arrive_as_vllms_speculative_config(
    endpoint, upstream_server, api_key, speculative, expected
):
    _, stats, error = run(endpoint, chat(speculative=speculative))
    assert error is None and stats is not None
    assert upstream_log(upstream_server, api_key)[0]["speculative_config"] == expected


def test_the_endpoints_extra_body_is_merged_and_the_route_wins(upstream_server, api_key):
    extra = {"top_k": 20, "speculative_config": {"method": "eagle", "num_speculative_tokens": 2, "model": "e"}}
    endpoint = RemoteEndpoint(upstream_server, api_key, "m", extra_body=extra)

    run(endpoint, chat(speculative={"method": "ngram", "k": 6}))
    run(endpoint, chat(speculative={"method": "off"}))
    run(endpoint, chat())

    merged, off, untouched = upstream_log(upstream_server, api_key)
    assert merged["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "model": "e",
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    assert merged["extra"]["top_k"] == 20
    assert off["speculative_config"] is None and off["extra"] == {"top_k": 20}
    assert untouched["speculative_config"] == extra["speculative_config"]
    assert extra == {"top_k": 20, "speculative_config": {"method": "eagle", "num_speculative_tokens": 2, "model": "e"}}


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    ("step", "kind", "retry_after_s", "retryable"),
    [
        ({"status": 429, "retry_after_ms": 1500}, "rate_limited", 1.5, True),
        ({"status": 429, "retry_after": "2"}, "rate_limited", 2.0, True),
        ({"status": 429}, "rate_limited", None, True),
        ({"status": 401}, "unauthorized", None, True),
        ({"status": 403}, "unauthorized", None, True),
        ({"status": 400}, "bad_request", None, False),
        ({"status": 404}, "bad_request", None, False),
        ({"status": 422}, "bad_request", None, False),
        ({"status": 500}, "server_error", None, True),
        ({"status": 503, "retry_after": "3"}, "server_error", 3.0, True),
    ],
)
def test_status_faults_map_to_kinds(endpoint, upstream_server, api_key, step, kind, retry_after_s, retryable):
    upstream_script(upstream_server, api_key, [step])
    deltas, stats, error = run(endpoint, chat())

    assert deltas == [] and stats is None
    assert (error.kind, error.status, error.retry_after_s, error.tokens_sent) == (
        kind,
        step["status"],
        retry_after_s,
        0,
    )
    assert error.retryable is retryable
    assert "127.0.0.1:" in error.message
    assert api_key not in error.message and api_key not in str(error) and api_key not in repr(error)
    # One attempt: the SDK's own retries are off.
    assert [entry["outcome"] for entry in upstream_log(upstream_server, api_key)] == [f"status {step['status']}"]


def test_the_key_is_scrubbed_from_an_upstream_message_that_echoes_it(endpoint, upstream_server, api_key):
    upstream_script(upstream_server, api_key, [{"status": 401}])
    _, _, error = run(endpoint, chat())
    assert "Incorrect API key provided: ***." in error.message
    assert api_key not in error.message
    assert api_key not in repr(endpoint)


def test_a_slow_first_byte_is_a_timeout(upstream_server, api_key):
    upstream_script(upstream_server, api_key, [{"first_byte_delay_ms": 3000}])
    endpoint = RemoteEndpoint(upstream_server, api_key, "m", first_token_timeout_s=0.5, total_timeout_s=30)
    deltas, _, error = run(endpoint, chat())
    assert deltas == []
    assert (error.kind, error.status, error.tokens_sent) == ("timeout", None, 0)
    assert "first_token_timeout_s=0.5" in error.message


def test_the_total_deadline_ends_a_slow_stream(upstream_server, api_key):
    upstream_script(upstream_server, api_key, [{"token_delay_ms": 400}])
    endpoint = RemoteEndpoint(upstream_server, api_key, "m", first_token_timeout_s=10, total_timeout_s=1.5)
    deltas, stats, error = run(endpoint, chat())
    assert stats is None
    assert error.kind == "timeout"
    assert error.tokens_sent == len(deltas) < len(WORDS)
    assert deltas == WORDS[: len(deltas)]
    assert "total_timeout_s=1.5" in error.message


def test_keep_alive_comments_do_not_hold_off_the_first_token_deadline(upstream_server, api_key):
    # The comments keep httpx's read timeout from firing and the SDK yields nothing for
    # them: the watchdog ends the call at its deadline, not when the token comes (8 s).
    upstream_script(upstream_server, api_key, [{"token_delay_ms": 8000, "keepalive_ms": 200}])
    endpoint = RemoteEndpoint(upstream_server, api_key, "m", first_token_timeout_s=1, total_timeout_s=30)
    started = time.monotonic()
    deltas, _, error = run(endpoint, chat())
    assert deltas == [] and (error.kind, error.tokens_sent) == ("timeout", 0)
    assert "first_token_timeout_s=1" in error.message
    assert time.monotonic() - started < 5


def test_a_stream_cut_after_three_tokens_is_broken_after_exactly_three_deltas(endpoint, upstream_server, api_key):
    upstream_script(upstream_server, api_key, [{"cut_after_tokens": 3}])
    deltas, stats, error = run(endpoint, chat())
    assert deltas == WORDS[:3]
    assert stats is None
    assert (error.kind, error.status, error.tokens_sent, error.retryable) == ("broken_stream", None, 3, True)
    assert upstream_log(upstream_server, api_key)[0]["outcome"] == "cut after 3 tokens"


def test_a_complete_stream_keeps_its_connection_and_a_cut_one_does_not(endpoint, upstream_server, api_key, monkeypatch):
    # A fresh connection pool, as in a new worker process.
    monkeypatch.setattr(remote, "_http", {"client": None, "pid": None})
    monkeypatch.setattr(remote, "_clients", type(remote._clients)())
    upstream_script(upstream_server, api_key, ["ok", "ok", {"cut_after_tokens": 2}, "ok"])

    outcomes = [run(endpoint, chat()) for _ in range(4)]

    assert [error.kind if error else "ok" for _, _, error in outcomes] == ["ok", "ok", "broken_stream", "ok"]
    ports = [entry["client_port"] for entry in upstream_log(upstream_server, api_key)]
    # The SDK stops at [DONE]; the end of the body is read for it, and the connection reused.
    assert ports[0] == ports[1] == ports[2]
    # The cut connection was closed: the next request opens another.
    assert ports[3] != ports[2]


def test_a_stream_that_ends_without_a_finish_reason_is_broken(endpoint, upstream_server, api_key):
    upstream_script(upstream_server, api_key, [{"end_after_tokens": 2}])
    deltas, _, error = run(endpoint, chat())
    assert deltas == WORDS[:2]
    assert (error.kind, error.tokens_sent) == ("broken_stream", 2)
    assert "without a finish_reason" in error.message


def test_a_closed_port_is_a_connection_error(api_key):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = RemoteEndpoint(f"http://127.0.0.1:{port}/v1", api_key, "m", connect_timeout_s=2)
    _, _, error = run(endpoint, chat())
    assert (error.kind, error.status, error.tokens_sent) == ("connection", None, 0)
    assert f"127.0.0.1:{port}" in error.message and api_key not in error.message


def test_scripts_are_consumed_in_order_and_a_repeated_step_stays(endpoint, upstream_server, api_key):
    upstream_script(upstream_server, api_key, ["ok", {"status": 500}])
    outcomes = [run(endpoint, chat())[2] for _ in range(3)]
    assert [error.kind if error else None for error in outcomes] == [None, "server_error", None]

    upstream_script(upstream_server, api_key, [{"status": 401, "repeat": True}])
    assert [run(endpoint, chat())[2].kind for _ in range(2)] == ["unauthorized", "unauthorized"]
    assert [entry["outcome"] for entry in upstream_log(upstream_server, api_key)] == [
        "ok",
        "status 500",
        "ok",
        "status 401",
        "status 401",
    ]

    upstream_reset(upstream_server, api_key)
    assert upstream_log(upstream_server, api_key) == []
    assert run(endpoint, chat())[2] is None


def test_retry_after_accepts_milliseconds_seconds_and_http_dates():
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_seconds({"retry-after-ms": "1500", "retry-after": "9"}, now) == 1.5
    assert retry_after_seconds({"retry-after": "2"}, now) == 2.0
    assert retry_after_seconds({"retry-after": "Thu, 01 Jan 2026 12:00:30 GMT"}, now) == 30.0
    assert retry_after_seconds({"retry-after": "Thu, 01 Jan 2026 11:00:00 GMT"}, now) == 0.0
    assert retry_after_seconds({"retry-after": "soon"}, now) is None
    assert retry_after_seconds({}, now) is None


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("endpoint_fields", "request_fields", "field"),
    [
        ({}, {"temperature": -0.1}, "temperature"),
        ({}, {"top_p": 0.0}, "top_p"),
        ({}, {"top_p": 1.5}, "top_p"),
        ({}, {"max_tokens": 0}, "max_tokens"),
        ({}, {"speculative": {"method": "ngram", "k": 0}}, "speculative.k"),
        ({}, {"speculative": {"method": "ngram", "k": 17}}, "speculative.k"),
        ({}, {"speculative": {"method": "medusa"}}, "speculative.method"),
        ({}, {"speculative": {"method": "both"}}, "speculative.method"),
        ({}, {"speculative": {"method": "draft"}}, "speculative.draft_model"),
        ({}, {"speculative": {"method": "ngram", "lookahead": 3}}, "speculative.lookahead"),
        ({}, {"messages": []}, "messages"),
        ({}, {"stop": "###"}, "stop"),
        ({}, {"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"base_url": "ftp://example.com/v1"}, {}, "base_url"),
        ({"api_key": ""}, {}, "api_key"),
        ({"total_timeout_s": 0}, {}, "total_timeout_s"),
    ],
)
def test_validation_names_the_field_and_makes_no_request(
    upstream_server, api_key, endpoint_fields, request_fields, field
):
    endpoint = RemoteEndpoint(**{"base_url": upstream_server, "api_key": api_key, "model": "m", **endpoint_fields})
    request = RemoteRequest(**{"messages": [{"role": "user", "content": PROMPT}], **request_fields})
    with pytest.raises(GenerationError) as raised:
        stream_chat(endpoint, request)
    assert raised.value.field == field
    assert isinstance(raised.value, ValueError)
    assert upstream_log(upstream_server, api_key) == []


# --------------------------------------------------------------------------- the task, in this process


def _events(request_id: str) -> list[tuple[str, dict]]:
    return [(kind, data) for _, kind, data in stream_read(request_id, block_ms=30000)]


def _payload(upstream_server: str, api_key: str, **fields) -> dict:
    return {"base_url": upstream_server, "api_key": api_key, "model": "stand-in-7b", "prompt": PROMPT, **fields}


def test_the_task_writes_deltas_then_stats(upstream_server, api_key):
    request_id = uuid.uuid4().hex
    payload = _payload(upstream_server, api_key, speculative={"method": "ngram", "k": 2}, stop="zzz")
    result = generate_remote(request_id, payload)
    events = _events(request_id)
    assert [kind for kind, _ in events] == ["delta"] * len(WORDS) + ["stats"]
    assert "".join(data["text"] for kind, data in events if kind == "delta") == REPLY
    assert events[-1][1] == result
    assert result["usage_source"] == "upstream" and result["completion_tokens"] == len(WORDS)
    [seen] = upstream_log(upstream_server, api_key)
    assert seen["speculative_config"]["num_speculative_tokens"] == 2
    assert seen["stop"] == ["zzz"]


def test_the_task_reports_refused_requests_and_upstream_errors(upstream_server, api_key):
    refused = uuid.uuid4().hex
    generate_remote(refused, _payload(upstream_server, api_key, top_p=0))
    [(kind, data)] = _events(refused)
    assert (kind, data["field"]) == ("error", "top_p")
    assert upstream_log(upstream_server, api_key) == []

    upstream_script(upstream_server, api_key, [{"cut_after_tokens": 3}])
    cut = uuid.uuid4().hex
    result = generate_remote(cut, _payload(upstream_server, api_key))
    events = _events(cut)
    assert [kind for kind, _ in events] == ["delta", "delta", "delta", "error"]
    error = events[-1][1]
    assert {key: error[key] for key in ("field", "kind", "status", "retry_after_s", "tokens_sent", "retryable")} == {
        "field": None,
        "kind": "broken_stream",
        "status": None,
        "retry_after_s": None,
        "tokens_sent": 3,
        "retryable": True,
    }
    assert api_key not in error["message"] and api_key not in repr(result)


def test_sending_the_task_keeps_the_payload_out_of_argsrepr(monkeypatch, api_key):
    from celery.app.task import Task

    sent = {}
    monkeypatch.setattr(Task, "apply_async", lambda self, args=None, kwargs=None, **options: sent.update(options))
    generate_remote.delay("r1", {"api_key": api_key})
    assert sent["argsrepr"] == "('r1', '<payload withheld>')"


# --------------------------------------------------------------------------- through a worker


@pytest.mark.slow
def test_requests_stream_through_a_remote_worker_with_threads(start_worker, upstream_server, api_key):
    slow_key, fault_key = f"{api_key}-slow", f"{api_key}-fault"
    upstream_script(upstream_server, slow_key, [{"token_delay_ms": 250}])
    upstream_script(upstream_server, fault_key, [{"status": 429, "retry_after_ms": 1500}])
    with start_worker(["remote"], pool="threads", concurrency=4) as worker:
        slow, fast, faulted = (uuid.uuid4().hex for _ in range(3))
        generate_remote.delay(slow, _payload(upstream_server, slow_key))
        generate_remote.delay(fast, _payload(upstream_server, api_key))
        generate_remote.delay(faulted, _payload(upstream_server, fault_key))
        fast_events = _events(fast)
        faulted_events = _events(faulted)
        slow_events = _events(slow)
        log = worker.log()

    for events in (fast_events, slow_events):
        assert [kind for kind, _ in events] == ["delta"] * len(WORDS) + ["stats"]
        assert "".join(data["text"] for kind, data in events if kind == "delta") == REPLY
        assert events[-1][1]["completion_tokens"] == len(WORDS)
    [(kind, error)] = faulted_events
    assert (kind, error["kind"], error["status"], error["retry_after_s"], error["tokens_sent"]) == (
        "error",
        "rate_limited",
        429,
        1.5,
        0,
    )
    # Threads: the quick request finished while the slow one (about 3.5 s of tokens) still ran.
    [slow_seen] = upstream_log(upstream_server, slow_key)
    [fast_seen] = upstream_log(upstream_server, api_key)
    assert fast_seen["finished"] < slow_seen["finished"]
    assert "inference.tasks.generate_remote" in log
    assert api_key not in log
