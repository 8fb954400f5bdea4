"""Fuzzing the REST API against its own OpenAPI schema (schemathesis), and the OpenAI-compatible
API with random JSON bodies (hypothesis).

REST API v1: schemathesis loads ``/api/schema/`` from the site and, for every operation it
describes, runs its explicit examples, its coverage cases (boundaries, each constraint broken
once) and generated cases, valid and invalid, sent with a client key of every scope to the
site's WSGI application in this process. Every response must not be a 5xx and must conform to
the schema: a documented status, its content type, its body's schema and headers; a request
the schema calls invalid must be refused, and one it calls valid must not be (but for the
refusals listed in ``SEMANTIC_REFUSALS``, which no schema can express).

The calls run in this process, not behind uvicorn, so that each example runs in a savepoint
that is rolled back: every example meets the same tenant (a collection, ingested documents, a
failed document, a done answer) whatever the one before it created or deleted, and ingestion
queued on commit is never queued. Half of the cases get the tenant's real ids in place of the
generated ones (path parameters, ``collection``/``collections``) where these were generated
valid, so that requests reach the code behind a found object, not only 404s.

Answers: no generation route is configured, so every answer is extractive and done within its
request (docs/api.md): nothing is queued for a worker and nothing is left running. With a
route, the fuzzer would queue hundreds of generations for a worker that is not there (and
``?wait=`` would hold each request up to 60 s).

OpenAI-compatible API (``/v1/``): not in the OpenAPI schema (checked below: it is OpenAI's
protocol, described by OpenAI), so hypothesis sends random JSON, and valid bodies with random
fields, to ``/v1/chat/completions`` and ``/v1/embeddings``: a refusal is a 4xx in OpenAI's
error shape, never a 5xx, and an accepted request answers in OpenAI's shape.

Generation is deterministic (derandomized, no example database) and bounded per operation.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core.parameters import ParameterLocation
from schemathesis.openapi.checks import RejectedPositiveData

from billing import ledger
from frontdoors.openai_api.chat import ROLES
from tests.security.conftest import Tenant

pytestmark = [
    pytest.mark.django_db,
    # The event stream is an async view: under WSGI, Django reads it whole (it ends: answers are done).
    pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume asynchronous iterators:Warning"),
]

MAX_EXAMPLES = 25  # generated cases per operation and mode, besides the examples and coverage cases
OPENAI_EXAMPLES = 60
APPLICATION = get_wsgi_application()
OPERATIONS = {
    "GET /api/v1/collections",
    "POST /api/v1/collections",
    "GET /api/v1/collections/{collection_id}",
    "GET /api/v1/documents",
    "POST /api/v1/documents",
    "GET /api/v1/documents/{document_id}",
    "DELETE /api/v1/documents/{document_id}",
    "GET /api/v1/documents/{document_id}/file",
    "POST /api/v1/documents/{document_id}/retry",
    "POST /api/v1/documents/{document_id}/readers",
    "GET /api/v1/search",
    "POST /api/v1/search",
    "POST /api/v1/answers",
    "GET /api/v1/answers/{answer_id}",
    "GET /api/v1/answers/{answer_id}/stream",
    "GET /api/v1/conversations",
    "POST /api/v1/conversations",
    "GET /api/v1/conversations/{conversation_id}",
    "PATCH /api/v1/conversations/{conversation_id}",
    "DELETE /api/v1/conversations/{conversation_id}",
    "GET /api/v1/usage",
}
ID_PARAMETERS = ("collection_id", "document_id", "answer_id", "conversation_id")

# 400s for requests the schema describes as valid that no schema can express: names and ids
# that must exist in this workspace or this PostgreSQL, and files whose content is refused.
# Each is a 400 naming the field (docs/api.md, "Errors"). (code, field): how the message starts.
SEMANTIC_REFUSALS = {
    ("route_not_found", "route"): "no enabled route named",
    ("invalid_request", "collection"): "No collection",
    ("invalid_request", "collections"): "No collection",
    ("invalid_request", "conversation"): "No conversation",
    ("invalid_request", "text_search_config"): "PostgreSQL has no text-search configuration",
    ("invalid_request", "embedding_model"): "",
    ("invalid_request", "readers"): "no such ",
    ("document_rejected", "files"): "",
    # metadata is a JSON object sent as a text part: OpenAPI 3.0 describes the part as a string.
    ("invalid_request", "metadata"): "",
    # werkzeug's test client encodes an empty file part without the line break before the next
    # boundary, so Django reads no file at all (a real client's empty file is document_rejected).
    ("invalid_request", "files"): "This field is required.",
}


schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", APPLICATION)
schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True)
# Not the literals schemathesis can harvest from the application's modules: which modules are
# loaded depends on the other tests of the run, and the cases must not.
schema.config.analysis.constants.enabled = False
# The tenant's ids, set by ``known_ids`` for the module; drawn by ``flatmap_case``.
KNOWN: dict[str, list] = {}


def _with_known_ids(case, index: int):
    """``case`` with the tenant's ids (the ``index``-th, cycling) in its path parameters and
    ``collection``/``collections`` parameters or fields, where these were generated valid (an
    invalid component stays invalid: the case is checked as negative)."""
    if not KNOWN:  # schemathesis draws its explicit examples while collecting, before any tenant
        return case

    def pick(name: str):
        return KNOWN[name][index % len(KNOWN[name])]

    if case.path_parameters and not case.meta.is_negative_at(ParameterLocation.PATH):
        for name in set(ID_PARAMETERS) & set(case.path_parameters):
            case.path_parameters[name] = pick(name)
    containers = [(ParameterLocation.QUERY, case.query)]
    if isinstance(case.body, dict):
        containers.append((ParameterLocation.BODY, case.body))
    for location, values in containers:
        if values and not case.meta.is_negative_at(location):
            if "collection" in values:
                values["collection"] = pick("collection_id")
            if "collections" in values:
                values["collections"] = [pick("collection_id")]
            if "conversation" in values:
                values["conversation"] = pick("conversation_id")
    return case


@schema.hook
def flatmap_case(context, case):
    """Half of the cases as generated, half with the tenant's ids."""
    return st.one_of(
        st.just(case), st.integers(min_value=0, max_value=7).map(lambda index: _with_known_ids(case, index))
    )


@schema.hook
def filter_failure(context, failure, case, response):
    """Every failure counts but a refusal of valid data listed in ``SEMANTIC_REFUSALS``."""
    if isinstance(failure, RejectedPositiveData) and response.status_code == 400:
        error = json.loads(response.content)["error"]
        start = SEMANTIC_REFUSALS.get((error["code"], error.get("field")))
        return start is None or not error["message"].startswith(start)
    return True


@pytest.fixture(scope="module")
def known_ids(tenant_pair):
    a, _ = tenant_pair
    KNOWN.update(
        collection_id=[a.collection.pk],
        document_id=[*(document.pk for document in a.documents), a.failed_document.pk],
        answer_id=[str(a.answer.pk)],
        conversation_id=[str(a.answer.conversation_id)],
    )
    yield
    KNOWN.clear()


@pytest.fixture
def in_process_requests():
    """Requests to ``APPLICATION`` in this process keep the test's connection (Django's handler
    closes a connection in a transaction at each request's start and end)."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def calls(request):
    """The cases an operation's test sent, by the mode each was generated in."""
    sent: Counter = Counter()
    yield sent
    print(f"{request.node.name}: {dict(sent)}")
    assert sent["positive"] > 0 and sent["negative"] > 0, sent


def test_the_schema_describes_every_api_v1_operation_and_nothing_else():
    operations = {f"{result.ok().method.upper()} {result.ok().path}" for result in schema.get_all_operations()}
    # The OpenAI-compatible API (/v1/) is not in it: the property tests below fuzz it.
    assert operations == OPERATIONS


@schema.parametrize()
@settings(suppress_health_check=list(HealthCheck), deadline=None, database=None, derandomize=True)
def test_api_v1_answers_as_its_schema_says(case, tenant: Tenant, known_ids, in_process_requests, calls):
    calls[case.meta.generation.mode.value if case.meta else "explicit"] += 1
    with transaction.atomic():
        case.call_and_validate(headers={"Authorization": f"Bearer {tenant.token}"})
        transaction.set_rollback(True)


# --------------------------------------------------------------------------- OpenAI-compatible API

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(), st.text(max_size=20)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)
TEXT_PARTS = st.lists(
    st.fixed_dictionaries({"type": st.one_of(st.just("text"), JSON), "text": st.one_of(st.text(max_size=40), JSON)}),
    max_size=3,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(ROLES), JSON), "content": st.one_of(st.text(max_size=60), TEXT_PARTS, JSON)}
    ),
    max_size=3,
)
QUESTIONS = st.sampled_from(["How long does charging take?", "What raises lift?", "Atlas-7 battery"])
# Each field: a value the endpoint accepts, or any JSON.
CHAT_FIELDS = {
    "max_tokens": st.integers(min_value=1, max_value=4096),
    "max_completion_tokens": st.integers(min_value=1, max_value=4096),
    "temperature": st.floats(min_value=0, max_value=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "logprobs": st.just(False),
    "response_format": st.just({"type": "text"}),
    "tools": st.just([]),
    "speculative_decoding": st.fixed_dictionaries(
        {}, optional={"enabled": st.booleans(), "draft_tokens": st.integers(1, 16), "temperature": st.floats(0, 2)}
    ),
    "enable_speculative": st.booleans(),
    "draft_model": st.text(max_size=10),
    "top_p": JSON,
    "stop": JSON,
    "seed": JSON,
    "user": JSON,
}
EMBEDDING_FIELDS = {
    "encoding_format": st.sampled_from(["float", "base64"]),
    "dimensions": st.just(384),
    "user": JSON,
}


def _bodies(required: dict, fields: dict):
    """Raw bytes, any JSON, or (mostly) an object with the endpoint's required fields and up to
    three others, each a value the endpoint accepts or any JSON."""
    extras = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: st.one_of(fields[name], JSON) for name in names})
    )
    objects = st.tuples(st.fixed_dictionaries(required), extras).map(lambda parts: {**parts[0], **parts[1]})
    return st.one_of(st.binary(max_size=40), JSON.map(json.dumps), objects.map(json.dumps), objects.map(json.dumps))


CHAT_BODIES = _bodies(
    {
        "model": st.one_of(st.just("extractive"), st.text(max_size=10), JSON),
        "messages": st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": QUESTIONS}), min_size=1, max_size=2),
            MESSAGES,
            JSON,
        ),
    },
    CHAT_FIELDS,
)
EMBEDDING_BODIES = _bodies(
    {
        "model": st.one_of(st.just("all-MiniLM-L6-v2"), st.none(), st.text(max_size=10), JSON),
        "input": st.one_of(QUESTIONS, st.lists(QUESTIONS, min_size=1, max_size=3), st.text(max_size=40), JSON),
    },
    EMBEDDING_FIELDS,
)


def _assert_openai_answer(response, path: str) -> None:
    """A 4xx in OpenAI's error shape, or a 200 in the endpoint's own shape; never a 5xx."""
    assert response.status_code < 500, response.content
    if response.status_code >= 400:
        assert response["Content-Type"] == "application/json"
        error = json.loads(response.content)["error"]
        assert set(json.loads(response.content)) == {"error"}
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and isinstance(error["code"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        return
    assert response.status_code == 200
    if response.get("Content-Type") == "text/event-stream":
        events = b"".join(response.streaming_content).decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], events[-3:]
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2] if event.startswith("data: {")]
        assert chunks and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
        return
    body = json.loads(response.content)
    if path == "/v1/chat/completions":
        assert body["object"] == "chat.completion" and body["model"] == "extractive"
        assert body["choices"][0]["message"]["role"] == "assistant"
    else:
        assert body["object"] == "list" and body["data"]
        for item in body["data"]:
            assert item["object"] == "embedding"
            assert isinstance(item["embedding"], str) or all(math.isfinite(x) for x in item["embedding"])


@pytest.mark.parametrize(
    ("path", "bodies"), [("/v1/chat/completions", CHAT_BODIES), ("/v1/embeddings", EMBEDDING_BODIES)]
)
def test_openai_endpoints_refuse_any_body_with_a_4xx_in_openais_shape(path, bodies, tenant: Tenant, client):
    statuses: Counter = Counter()

    @given(body=bodies)
    @settings(
        max_examples=OPENAI_EXAMPLES,
        suppress_health_check=list(HealthCheck),
        deadline=None,
        database=None,
        derandomize=True,
    )
    def check(body: str | bytes):
        with transaction.atomic():
            response = client.post(
                path, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {tenant.token}"
            )
            _assert_openai_answer(response, path)
            statuses[response.status_code] += 1
            transaction.set_rollback(True)

    check()
    # The embeddings' ledger rows, queued in Redis, are stored now, in this test's transaction
    # (rolled back): a later test draining the ledger would otherwise store them in its own.
    ledger.usage_records_store()
    print(path, "statuses:", dict(statuses))
    assert statuses[400] > 0  # (what the shapes reach: both refusals and answers)
    assert statuses[200] > 0
