"""Remote generation against the OpenAI-protocol stand-in (a real process), through the official client.

``stream_chat`` is the one client of every OpenAI-protocol server, an upstream's or a GPU
pool device's engine; ``generate_routed`` (on a route on the stand-in) is the task around it.
Each test uses its own API key, so the stand-in's per-key scripts and logs never mix
between tests. Timeouts are generous: the assertions are about outcomes, not speed.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time
import uuid
from datetime import UTC, datetime

import openai
import pytest

from inference.remote import (
    RemoteEndpoint,
    RemoteRequest,
    RemoteStats,
    UpstreamError,
    estimate_prompt_tokens,
    retry_after_seconds,
    speculative_report,
    stream_chat,
    transport,
)
from inference.requests import GenerationError
from inference.tasks import generate_routed
from tests.inference import routing_helpers
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
        "speculative",
    ]
    assert summary["tokens_per_s"] > 0
    # The stand-in reports no speculative figures: None, and no draft counters claiming 0 accepted.
    assert stats.speculative is None and summary["speculative"] is None


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


# --------------------------------------------------------------------------- what is sent


def test_the_endpoints_extra_body_is_sent_as_is_and_nothing_else(upstream_server, api_key):
    extra = {"top_k": 20, "repetition_penalty": 1.1}
    endpoint = RemoteEndpoint(upstream_server, api_key, "m", extra_body=extra)

    _, stats, error = run(endpoint, chat())

    assert error is None and stats is not None
    [seen] = upstream_log(upstream_server, api_key)
    assert seen["extra"] == {"top_k": 20, "repetition_penalty": 1.1}
    assert seen["speculative_config"] is None
    assert extra == {"top_k": 20, "repetition_penalty": 1.1}  # not modified


def test_a_request_has_no_speculative_field_any_more():
    assert "speculative" not in {field.name for field in dataclasses.fields(RemoteRequest)}
    with pytest.raises(TypeError):
        RemoteRequest(messages=[{"role": "user", "content": "hi"}], speculative={"method": "ngram", "k": 4})


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "speculation",
    [
        {"speculative_method": "ngram", "speculative_k": 5},
        {"speculative_method": "draft", "speculative_k": 3, "draft_model": "stand-in-0.5b"},
        {"speculative_method": "eagle3", "speculative_k": 2, "draft_model": "stand-in-eagle3"},
        {"speculative_method": "mtp", "speculative_k": 1, "speculative_adaptive_k": True},
    ],
)
def test_a_routes_speculative_settings_are_never_sent_upstream(upstream_server, speculation):
    """How an endpoint speculates is fixed when its server starts: the provider's settings
    select among endpoints and are not a request field (a hosted API would answer 400)."""
    provider = routing_helpers.provider_make(upstream_server, **speculation)
    _, secret = routing_helpers.key_make(provider)
    route = routing_helpers.route_make(provider)
    request_id = uuid.uuid4().hex

    result = generate_routed.run(request_id, routing_helpers.payload(route, PROMPT))

    assert result["status"] == "ok" and result["text"] == REPLY
    [seen] = upstream_log(upstream_server, secret)
    assert seen["speculative_config"] is None
    assert seen["extra"] == {}  # no speculative field under any other name either
    assert (seen["model"], seen["max_tokens"], seen["temperature"], seen["top_p"]) == ("stand-in-7b", 64, 0.0, 1.0)
    # Nothing reported back: no figures in the stats, none in the ledger.
    assert result["stats"]["speculative"] is None and "draft_tokens_proposed" not in result["stats"]
    row = routing_helpers.ledger_row(request_id)  # the drain the task sent, run here
    assert (row.status, row.draft_tokens_proposed, row.draft_tokens_accepted) == ("ok", 0, 0)


# --------------------------------------------------------------------------- the engine's speculative report


def vllm_metrics(**changes) -> dict:
    """``metrics`` as vLLM puts it on the usage chunk: 10 verify steps of k=4, 25 of 40 accepted."""
    spec = {
        "num_draft_tokens": 40,
        "num_accepted_draft_tokens": 25,
        "num_spec_steps": 10,
        "num_spec_tokens": 4,
        "mean_acceptance_length": 3.5,
        "draft_acceptance_rate": 0.625,
        "acceptance_histogram": [1, 2, 2, 1, 4],  # steps that accepted 0..4 tokens: 10 steps, 25 tokens
    }
    spec.update(changes)
    return {"speculative_decoding": {key: value for key, value in spec.items() if value is not ...}}


REPORT = {
    "draft_tokens_proposed": 40,
    "draft_tokens_accepted": 25,
    "draft_accepted": 0.625,
    "spec_steps": 10,
    "spec_tokens": 4,
    "mean_acceptance_length": 3.5,
    "acceptance_histogram": [1, 2, 2, 1, 4],
}


def test_a_valid_report_is_read_into_the_stats_shape():
    assert speculative_report(vllm_metrics()) == REPORT


def test_the_acceptance_rate_is_computed_not_taken_from_the_engine():
    report = speculative_report(vllm_metrics(num_draft_tokens=30, draft_acceptance_rate=0.9, num_spec_tokens=3))
    assert report["draft_accepted"] == round(25 / 30, 4) == 0.8333
    assert report["spec_tokens"] == 3


def test_nothing_proposed_is_a_report_with_no_rate():
    report = speculative_report(
        vllm_metrics(
            num_draft_tokens=0,
            num_accepted_draft_tokens=0,
            num_spec_steps=0,
            mean_acceptance_length=1.0,
            acceptance_histogram=[0, 0, 0, 0, 0],
        )
    )
    assert report == {
        "draft_tokens_proposed": 0,
        "draft_tokens_accepted": 0,
        "draft_accepted": None,
        "spec_steps": 0,
        "spec_tokens": 4,
        "mean_acceptance_length": 1.0,
        "acceptance_histogram": [0, 0, 0, 0, 0],
    }


@pytest.mark.parametrize(
    "metrics",
    [
        None,
        {},
        [],
        "speculative_decoding",
        {"speculative_decoding": None},
        {"speculative_decoding": [40, 25]},
        {"speculative_decoding": "40/25"},
        {"other": {"num_draft_tokens": 40, "num_accepted_draft_tokens": 25}},
        vllm_metrics(num_draft_tokens=...),
        vllm_metrics(num_accepted_draft_tokens=...),
        vllm_metrics(num_draft_tokens=None),
        vllm_metrics(num_draft_tokens=-40),
        vllm_metrics(num_accepted_draft_tokens=-1),
        vllm_metrics(num_draft_tokens=True),
        vllm_metrics(num_accepted_draft_tokens=False),
        vllm_metrics(num_draft_tokens=40.0),
        vllm_metrics(num_draft_tokens="40"),
        vllm_metrics(num_accepted_draft_tokens=41),  # accepted > proposed
    ],
)
def test_a_missing_malformed_or_inconsistent_report_is_none_never_zeros(metrics):
    assert speculative_report(metrics) is None


@pytest.mark.parametrize(
    "histogram",
    [
        [1, 2, 2, 1, 3],  # 9 steps, not 10
        [1, 2, 2, 1, 5],  # 11
        [],
        [1, 2, -2, 5, 4],
        [1, 2, 2, 1, 4.0],
        [True, 2, 2, 1, 4],
        "1,2,2,1,4",
        {"0": 1},
        None,
        ...,
    ],
)
def test_a_histogram_that_is_not_the_steps_one_is_dropped_alone(histogram):
    assert speculative_report(vllm_metrics(acceptance_histogram=histogram)) == {**REPORT, "acceptance_histogram": None}


def test_without_a_step_count_the_histogram_is_kept_unchecked():
    report = speculative_report(vllm_metrics(num_spec_steps=..., acceptance_histogram=[0, 1]))
    assert (report["spec_steps"], report["acceptance_histogram"]) == (None, [0, 1])
    assert speculative_report(vllm_metrics(num_spec_steps=-1))["spec_steps"] is None
    assert speculative_report(vllm_metrics(num_spec_tokens=True))["spec_tokens"] is None


@pytest.mark.parametrize("mean", [-1.0, True, "3.5", None, ...])
def test_a_bad_mean_acceptance_length_is_none(mean):
    assert speculative_report(vllm_metrics(mean_acceptance_length=mean)) == {**REPORT, "mean_acceptance_length": None}


def test_the_mean_acceptance_length_is_rounded_and_an_integer_one_made_a_float():
    assert speculative_report(vllm_metrics(mean_acceptance_length=3.456789))["mean_acceptance_length"] == 3.4568
    three = speculative_report(vllm_metrics(mean_acceptance_length=3))["mean_acceptance_length"]
    assert three == 3.0 and isinstance(three, float)


def stats_with(speculative: dict | None) -> RemoteStats:
    return RemoteStats(
        prompt_tokens=12,
        completion_tokens=30,
        time_to_first_token_ms=41.23456,
        total_ms=1500.0,
        finish_reason="length",
        usage_source="upstream",
        model="tiny",
        speculative=speculative,
    )


def test_stats_without_a_report_claim_no_draft_counts():
    assert stats_with(None).as_dict() == {
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "time_to_first_token_ms": 41.23,
        "tokens_per_s": 20.0,
        "total_ms": 1500.0,
        "finish_reason": "length",
        "usage_source": "upstream",
        "model": "tiny",
        "speculative": None,
    }


def test_stats_with_a_report_carry_it_and_its_draft_counts_at_the_top():
    summary = stats_with(dict(REPORT)).as_dict()
    assert summary == {
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "time_to_first_token_ms": 41.23,
        "tokens_per_s": 20.0,
        "total_ms": 1500.0,
        "finish_reason": "length",
        "usage_source": "upstream",
        "model": "tiny",
        "draft_tokens_proposed": 40,
        "draft_tokens_accepted": 25,
        "speculative": REPORT,
    }
    assert list(summary)[-3:] == ["draft_tokens_proposed", "draft_tokens_accepted", "speculative"]
    # Nothing proposed is still a report: zeros that were measured.
    zero = stats_with({**REPORT, "draft_tokens_proposed": 0, "draft_tokens_accepted": 0}).as_dict()
    assert (zero["draft_tokens_proposed"], zero["draft_tokens_accepted"]) == (0, 0)


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
    monkeypatch.setattr(transport, "_http", {"client": None, "pid": None})
    monkeypatch.setattr(transport, "_clients", type(transport._clients)())
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
        ({}, {"messages": []}, "messages"),
        ({}, {"stop": "###"}, "stop"),
        ({}, {"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"base_url": "ftp://example.com/v1"}, {}, "base_url"),
        ({"api_key": ""}, {}, "api_key"),
        ({"total_timeout_s": 0}, {}, "total_timeout_s"),
        ({"model": ""}, {}, "model"),
        ({"extra_body": ["speculative_config"]}, {}, "extra_body"),
        ({}, {"seed": 1.5}, "seed"),
        ({}, {"temperature": True}, "temperature"),
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


def upstream_route(upstream_server: str, **fields):
    """A route on the stand-in, its provider's one key: (route, secret)."""
    provider = routing_helpers.provider_make(upstream_server, **fields)
    _, secret = routing_helpers.key_make(provider)
    return routing_helpers.route_make(provider), secret


@pytest.mark.django_db(transaction=True)
def test_the_task_writes_deltas_then_stats(upstream_server):
    route, secret = upstream_route(upstream_server)
    request_id = uuid.uuid4().hex
    result = generate_routed.run(request_id, routing_helpers.payload(route, PROMPT, stop=["zzz"], seed=3))
    events = routing_helpers.events_of(request_id)
    assert routing_helpers.kinds(events) == ["delta"] * len(WORDS) + ["stats"]
    assert routing_helpers.deltas(events) == WORDS
    assert events[-1][1] == {**result["stats"], "attempts": 1}
    assert (result["status"], result["text"], result["route"], result["attempts"]) == ("ok", REPLY, route.name, 1)
    assert result["stats"]["usage_source"] == "upstream" and result["stats"]["completion_tokens"] == len(WORDS)
    [seen] = upstream_log(upstream_server, secret)
    assert (seen["stop"], seen["seed"], seen["speculative_config"], seen["extra"]) == (["zzz"], 3, None, {})


@pytest.mark.django_db(transaction=True)
def test_the_task_reports_refused_requests_and_upstream_errors(upstream_server):
    route, secret = upstream_route(upstream_server)
    refused = uuid.uuid4().hex
    result = generate_routed.run(refused, routing_helpers.payload(route, PROMPT, top_p=0))
    [(kind, data)] = routing_helpers.events_of(refused)
    assert (kind, data["field"], data["kind"], data["retryable"]) == ("error", "top_p", "invalid_request", False)
    assert result["status"] == "error" and result["error"]["field"] == "top_p"
    assert upstream_log(upstream_server, secret) == []

    upstream_script(upstream_server, secret, [{"cut_after_tokens": 3}])
    cut = uuid.uuid4().hex
    result = generate_routed.run(cut, routing_helpers.payload(route, PROMPT))
    events = routing_helpers.events_of(cut)
    assert routing_helpers.kinds(events) == ["delta", "delta", "delta", "error"]
    error = events[-1][1]
    assert {key: error[key] for key in ("field", "kind", "status", "retry_after_s", "tokens_sent", "attempts")} == {
        "field": None,
        "kind": "broken_stream",
        "status": None,
        "retry_after_s": None,
        "tokens_sent": 3,
        "attempts": 1,
    }
    # Tokens had reached the stream: a restart would repeat them, so the request ends here.
    assert error["retryable"] is False and "not retried" in error["message"]
    assert secret not in error["message"] and secret not in repr(result)
    assert [entry["outcome"] for entry in upstream_log(upstream_server, secret)] == ["cut after 3 tokens"]


def test_sending_the_task_keeps_the_payload_out_of_argsrepr(monkeypatch, api_key):
    from celery.app.task import Task

    sent = {}
    monkeypatch.setattr(Task, "apply_async", lambda self, args=None, kwargs=None, **options: sent.update(options))
    generate_routed.delay("r1", {"messages": [{"role": "user", "content": api_key}]})
    assert sent["argsrepr"] == "('r1', '<payload withheld>')"


# --------------------------------------------------------------------------- through a worker


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_requests_stream_through_a_remote_worker_with_threads(start_worker, upstream_server):
    from inference import router

    (slow, slow_key), (fast, fast_key), (faulted, fault_key) = (upstream_route(upstream_server) for _ in range(3))
    upstream_script(upstream_server, slow_key, [{"token_delay_ms": 250}])
    upstream_script(upstream_server, fault_key, [{"status": 400}])
    messages = [{"role": "user", "content": PROMPT}]
    with start_worker(["remote"], pool="threads", concurrency=4) as worker:
        plans = [router.plan(route_name=route.name, client_id="tests") for route in (slow, fast, faulted)]
        for plan in plans:
            router.submit(plan, messages=messages)
        slow_events, fast_events, faulted_events = (
            routing_helpers.events_of(plan.request_id, block_ms=60000) for plan in plans
        )
        rows = [routing_helpers.ledger_row(plan.request_id) for plan in plans]
        log = worker.log()

    for events in (fast_events, slow_events):
        assert routing_helpers.kinds(events) == ["delta"] * len(WORDS) + ["stats"]
        assert "".join(routing_helpers.deltas(events)) == REPLY
        assert events[-1][1]["completion_tokens"] == len(WORDS)
    [(kind, error)] = faulted_events
    assert (kind, error["kind"], error["status"], error["tokens_sent"], error["retryable"]) == (
        "error",
        "bad_request",
        400,
        0,
        False,
    )
    assert [(row.status, row.error_class, row.attempts) for row in rows] == [
        ("ok", "", 1),
        ("ok", "", 1),
        ("error", "bad_request", 1),
    ]
    # Threads: the quick request finished while the slow one (about 3.5 s of tokens) still ran.
    [slow_seen] = upstream_log(upstream_server, slow_key)
    [fast_seen] = upstream_log(upstream_server, fast_key)
    assert fast_seen["finished"] < slow_seen["finished"]
    assert "inference.tasks.generate_routed" in log
    for secret in (slow_key, fast_key, fault_key):
        assert secret not in log
    # The task's result went to its link alone: no answer's text waits in the result backend.
    from ragsite.redis import Role, redis_client

    stored = [redis_client(Role.BROKER).get(key) for key in redis_client(Role.BROKER).scan_iter("celery-task-meta-*")]
    assert [value for value in stored if value and REPLY.encode() in value] == []
