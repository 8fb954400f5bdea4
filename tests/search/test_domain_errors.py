"""Every refusal of the domain (``ragsite.errors.DomainError``) as the two APIs render it: the
REST API's ``{"error": {"code", "message", "field"}}`` and OpenAI's shape, from one base."""

from __future__ import annotations

import json

import pytest

from billing.client_keys import ClientKeyError
from billing.limits import LimitExceeded, ModelUnpriced
from frontdoors.api.errors import api_error_of, error_json
from frontdoors.openai_api.errors import from_domain
from inference.backpressure import PoolFull, QueueFull
from inference.errors import RouteNotFound, RouteUnavailable, SpeculationUnavailable
from search.answering.answers import AnswerError
from search.answering.prompting import PromptTooLong
from search.selectors import SearchError
from search.services import DocumentRejected, DocumentTooLarge, StorageQuotaExceeded

# (the error, the REST API's (status, code, field, Retry-After), OpenAI's (status, code, param, x-should-retry))
CASES = [
    (LimitExceeded("rate_limited", 429, "1 per minute", 12.2), (429, "rate_limited", None, "13"),
     (429, "rate_limited", None, None)),
    (LimitExceeded("rate_limited", 429, "0 per minute"), (429, "rate_limited", None, None),
     (429, "rate_limited", None, "false")),
    (ModelUnpriced("no price"), (402, "model_unpriced", None, None), (402, "model_unpriced", None, None)),
    (ClientKeyError("invalid_api_key", "not valid"), (401, "invalid_api_key", None, None),
     (401, "invalid_api_key", None, None)),
    (ClientKeyError("insufficient_scope", "no scope", status=403), (403, "insufficient_scope", None, None),
     (403, "insufficient_scope", None, None)),
    (RouteUnavailable("cooling down", retry_after_s=3.5), (503, "route_unavailable", None, "4"),
     (503, "route_unavailable", None, None)),
    (RouteUnavailable("all disabled"), (503, "route_unavailable", None, None),
     (503, "route_unavailable", None, "false")),
    (PoolFull("pool", 8, 8, 2.0), (503, "route_unavailable", None, "2"), (503, "route_unavailable", None, None)),
    (QueueFull("gpu", 3, 3, 1.0), (503, "route_unavailable", None, "1"), (503, "route_unavailable", None, None)),
    (RouteNotFound("no route named 'x'"), (400, "route_not_found", "route", None),
     (404, "model_not_found", "model", None)),
    (SpeculationUnavailable("speculative.k", "no pool of k=9"), (400, "invalid_request", "speculative.k", None),
     (400, "invalid_value", "speculative.k", None)),
    (AnswerError("question", "empty"), (400, "invalid_request", "question", None),
     (400, "invalid_value", "question", None)),
    (PromptTooLong("max_tokens", "too long"), (400, "invalid_request", "max_tokens", None),
     (400, "invalid_value", "max_tokens", None)),
    (SearchError("mixed models"), (400, "invalid_request", None, None), (400, "invalid_value", None, None)),
    (DocumentRejected("empty file"), (400, "document_rejected", "files", None),
     (400, "document_rejected", "files", None)),
    (DocumentTooLarge("over 1 MB"), (413, "document_too_large", "files", None),
     (413, "document_too_large", "files", None)),
    (StorageQuotaExceeded("over quota"), (400, "document_rejected", "files", None),
     (400, "document_rejected", "files", None)),
]  # fmt: skip


@pytest.mark.parametrize(("error", "rest", "openai"), CASES, ids=[type(case[0]).__name__ for case in CASES])
def test_both_apis_render_every_domain_error_from_its_own_fields(error, rest, openai):
    response = error_json(api_error_of(error))
    body = json.loads(response.content)["error"]
    assert (response.status_code, body["code"], body.get("field"), response.get("Retry-After")) == rest
    assert body["message"] == str(error)

    mapped = from_domain(error).response()
    body = json.loads(mapped.content)["error"]
    assert (mapped.status_code, body["code"], body["param"], mapped.get("x-should-retry")) == openai
    assert body["message"] == str(error)
