"""Refusals in OpenAI's shape: statuses, retry headers, and a failed generation's mapping."""

from __future__ import annotations

import json

import pytest

from billing.limits import LimitExceeded, ModelUnpriced
from frontdoors.openai_api.errors import from_domain, from_generation, invalid
from inference.errors import RouteUnavailable


def test_the_body_is_openais_error_object():
    response = invalid("speculative_decoding.draft_tokens", "must be from 1 to 16").response()
    assert response.status_code == 400
    assert json.loads(response.content) == {
        "error": {
            "message": "must be from 1 to 16",
            "type": "invalid_request_error",
            "param": "speculative_decoding.draft_tokens",
            "code": "invalid_value",
        }
    }
    assert "Retry-After" not in response and "x-should-retry" not in response


def test_a_rate_limit_says_when_to_come_back_and_a_limit_of_zero_says_never():
    response = from_domain(LimitExceeded("rate_limited", 429, "1 per minute", 12.2)).response()
    assert (response.status_code, response["Retry-After"], response["retry-after-ms"]) == (429, "13", "12200")
    never = from_domain(LimitExceeded("rate_limited", 429, "0 per minute", None)).response()
    assert never["x-should-retry"] == "false" and "Retry-After" not in never
    assert from_domain(LimitExceeded("budget_exhausted", 402, "spent")).status == 402
    assert from_domain(ModelUnpriced("no price")).code == "model_unpriced"


def test_an_unavailable_route_is_a_503_retried_only_when_a_key_comes_back():
    soon = from_domain(RouteUnavailable("cooling down", retry_after_s=3.5)).response()
    assert (soon.status_code, soon["Retry-After"]) == (503, "4") and "x-should-retry" not in soon
    assert from_domain(RouteUnavailable("all disabled")).response()["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("error", "status", "param", "retry"),
    [
        ({"kind": "unavailable", "retry_after_s": 2.0, "message": "m"}, 503, None, None),
        ({"kind": "unavailable", "retry_after_s": None, "message": "m"}, 503, None, False),
        ({"kind": "invalid_request", "field": "speculative.k", "message": "m"}, 400, "speculative.k", False),
        ({"kind": "bad_request", "status": 400, "message": "m"}, 502, None, False),
        ({"kind": "broken_stream", "tokens_sent": 3, "retryable": False, "message": "m"}, 502, None, None),
        ({"kind": "timeout", "message": "m"}, 504, None, None),
        ({"kind": "answer_failed", "message": "m"}, 502, None, None),
    ],
)
def test_a_failed_generation_maps_to_a_status(error, status, param, retry):
    mapped = from_generation(error)
    assert (mapped.status, mapped.param, mapped.code, mapped.retryable) == (status, param, error["kind"], retry)
