"""The OpenAI-compatible API end to end, through the official ``openai`` client.

A real uvicorn process serves the site on the test database (one for the module: each
start costs seconds, and the embedder's first load more); tests commit their rows
(``transaction=True``) so that it sees them. Most tests run without a route (extractive
answers over a small ingested collection); the last one generates through the
OpenAI-protocol stand-in with ``remote`` and ``default`` workers.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import numpy as np
import openai
import pytest
from langchain_openai import ChatOpenAI

from billing import client_keys, ledger
from billing.models import UsageRecord
from inference.models import Provider, Route, UpstreamKey
from search.embedders import embedder_get
from search.models import Answer
from search.services import collection_create, workspace_create
from tests.conftest import web_server
from tests.search.answering.test_answers import DOCUMENTS
from tests.search.files import ingest_texts as ingest
from tests.upstream_server import upstream_log, upstream_script

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def site(django_db_setup, django_db_blocker, tmp_path_factory):
    """The site's base URL (``http://127.0.0.1:PORT``), served by uvicorn for the module's tests."""
    with django_db_blocker.unblock(), web_server(tmp_path_factory.mktemp("openai-web")) as base_url:
        yield base_url


@pytest.fixture
def workspace(db):
    workspace = workspace_create(name="Acme", slug="acme")
    ingest(collection_create(workspace=workspace, name="Handbook"), DOCUMENTS)
    return workspace


def client_for(site: str, token: str) -> openai.OpenAI:
    # No retries: a test sees each refusal itself (the SDK would wait out a Retry-After).
    return openai.OpenAI(base_url=f"{site}/v1", api_key=token, max_retries=0, timeout=60)


def key_for(workspace, *scopes: str, **limits) -> str:
    _, token = client_keys.client_key_create(workspace, f"key-{uuid.uuid4().hex[:6]}", scopes=list(scopes), **limits)
    return token


def answer_of(completion_id: str) -> Answer:
    return Answer.objects.get(pk=completion_id.removeprefix("chatcmpl-"))


QUESTION = [{"role": "user", "content": "How long does charging take?"}]


# --------------------------------------------------------------------------- extractive answers


def test_models_lists_what_answers_without_a_route(site, workspace):
    client = client_for(site, key_for(workspace, "search"))
    assert [model.id for model in client.models.list()] == ["extractive", "all-MiniLM-L6-v2"]
    assert client.models.retrieve("extractive").owned_by == "search"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")


def test_a_chat_completion_for_a_model_nothing_serves_is_openais_404(site, workspace):
    client = client_for(site, key_for(workspace, "generate"))
    for model in ("no-such-model-xyz", "gpt-4o-mini", "all-MiniLM-L6-v2"):  # an embedding model is no chat model
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model=model, messages=QUESTION)
        assert (caught.value.status_code, caught.value.param, caught.value.code) == (404, "model", "model_not_found")
        assert caught.value.body["message"] == (
            f"the model {model!r} does not exist or you do not have access to it: use one of extractive"
        )
    assert not Answer.objects.exists()  # refused before an answer was started


def test_a_chat_completion_is_the_extractive_answer_with_its_citations(site, workspace):
    client = client_for(site, key_for(workspace, "generate"))
    completion = client.chat.completions.create(
        model="extractive",  # without a default route the answer is extractive
        messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
    )
    answer = answer_of(completion.id)
    assert (answer.mode, answer.status, answer.question) == ("extractive", "done", QUESTION[0]["content"])
    assert answer.client_id == f"key:{answer.workspace.client_keys.get().pk}"
    assert completion.object == "chat.completion" and completion.model == "extractive"
    [choice] = completion.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", answer.text, "stop")
    assert "Charging takes 90 minutes." in answer.text
    assert completion.usage.total_tokens == 0  # no model ran
    assert completion.citations == [
        {key: citation[key] for key in ("number", "document_id", "chunk_id", "title", "start_offset", "end_offset")}
        for citation in answer.citations
    ]
    assert completion.citations and completion.inference_time_ms == answer.timings["prompt_ms"]
    assert completion.speculative is None  # no engine ran, so none reported anything


def test_the_messages_are_the_conversation_and_a_follow_up_cites_what_it_needs(site, db):
    from search.models import Document
    from tests.search.answering.test_conversations import FIRST, FOLLOW_UP, FOLLOW_UP_QUERY, TRAVEL

    workspace = workspace_create(name="Travel", slug="travel")
    ingest(collection_create(workspace=workspace, name="Handbook"), TRAVEL)
    client = client_for(site, key_for(workspace, "generate"))
    first = client.chat.completions.create(model="extractive", messages=[{"role": "user", "content": FIRST}])
    assert first.retrieval_query == FIRST
    messages = [
        {"role": "system", "content": "Answer in one sentence."},  # an instruction: no question, no turn
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": FOLLOW_UP},
    ]
    follow = client.chat.completions.create(model="extractive", messages=messages)
    answer = answer_of(follow.id)
    assert (answer.question, answer.retrieval_query) == (FOLLOW_UP, FOLLOW_UP_QUERY)
    assert follow.retrieval_query == answer.retrieval_query
    assert answer.stats["followup"]["method"] == "terms"
    # The passage the follow-up needs: the per-diem allowance in Berlin.
    per_diem = Document.objects.get(collection__workspace=workspace, source_name="per_diem.md")
    assert follow.citations[0]["document_id"] == per_diem.pk
    assert "EUR 90 a day in Berlin" in follow.choices[0].message.content
    # Each request is a conversation of its own: the messages carry the history, not the server.
    assert answer.conversation_id != answer_of(first.id).conversation_id
    assert answer.conversation.answers.count() == 1


def test_a_streamed_chat_completion_ends_with_the_usage_chunk(site, workspace):
    client = client_for(site, key_for(workspace, "generate"))
    stream = client.chat.completions.create(
        model="extractive", messages=QUESTION, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    answer = answer_of(chunks[0].id)
    assert {chunk.id for chunk in chunks} == {f"chatcmpl-{answer.pk}"}
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == answer.text != ""
    finish, usage = chunks[-2], chunks[-1]
    assert finish.choices[0].finish_reason == "stop" and finish.usage is None
    assert [c["chunk_id"] for c in finish.citations] == [c["chunk_id"] for c in answer.citations]
    assert usage.choices == [] and usage.usage.total_tokens == 0
    # Without include_usage there is no usage chunk.
    plain = list(client.chat.completions.create(model="extractive", messages=QUESTION, stream=True))
    assert plain[-1].choices[0].finish_reason == "stop"


def test_embeddings_are_the_built_in_models_and_are_billed_to_the_key(site, workspace):
    token = key_for(workspace, "search")
    client = client_for(site, token)
    texts = ["How long does charging take?", "Lift rises with the angle of attack."]
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the SDK asks for base64
    assert [item.index for item in response.data] == [0, 1]
    assert all(len(item.embedding) == 384 for item in response.data)
    expected = embedder_get("all-MiniLM-L6-v2").embed_documents(texts)
    for item, vector in zip(response.data, expected, strict=True):
        assert float(np.dot(item.embedding, vector)) > 0.999
    tokens = sum(len(embedder_get("all-MiniLM-L6-v2").token_offsets(text)) for text in texts)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    single = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0], encoding_format="float")
    assert np.allclose(single.data[0].embedding, response.data[0].embedding, atol=1e-3)

    ledger.usage_records_store()
    rows = UsageRecord.objects.filter(kind=UsageRecord.Kind.EMBEDDING, client_key__isnull=False)
    assert sorted(rows.values_list("prompt_tokens", flat=True)) == sorted([tokens, single.usage.prompt_tokens])
    assert set(rows.values_list("workspace_id", "model")) == {(workspace.pk, "all-MiniLM-L6-v2")}

    with pytest.raises(openai.NotFoundError) as caught:  # as OpenAI answers a model it does not serve
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (404, "model", "model_not_found")
    assert "'text-embedding-3-small' does not exist" in caught.value.message
    assert caught.value.message.endswith("use one of all-MiniLM-L6-v2")
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 400)
    assert caught.value.param == "input" and "at most 254" in caught.value.message


def test_refusals_are_the_sdks_own_exceptions(site, workspace):
    with pytest.raises(openai.AuthenticationError) as caught:
        client_for(site, "rk_notakey").chat.completions.create(model="extractive", messages=QUESTION)
    assert caught.value.code == "invalid_api_key"

    searcher = client_for(site, key_for(workspace, "search"))
    with pytest.raises(openai.PermissionDeniedError) as caught:
        searcher.chat.completions.create(model="extractive", messages=QUESTION)
    assert caught.value.code == "insufficient_scope"
    with pytest.raises(openai.PermissionDeniedError):
        client_for(site, key_for(workspace, "generate")).embeddings.create(model="all-MiniLM-L6-v2", input="x")

    generator = client_for(site, key_for(workspace, "generate"))
    for extra_body, param in [
        ({"speculative_decoding": {"enabled": True, "draft_tokens": 99}}, "speculative_decoding.draft_tokens"),
        ({"speculative_decoding": {"draft_tokens": 4, "ratio": 2}}, "speculative_decoding.ratio"),
        ({"enable_speculative": "on"}, "enable_speculative"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            generator.chat.completions.create(model="extractive", messages=QUESTION, extra_body=extra_body)
        assert caught.value.param == param, caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        generator.chat.completions.create(model="extractive", messages=[{"role": "assistant", "content": "Hi"}])
    assert caught.value.param == "messages"

    limited = client_for(site, key_for(workspace, "generate", requests_per_minute=1))
    limited.chat.completions.create(model="extractive", messages=QUESTION)
    with pytest.raises(openai.RateLimitError) as caught:
        limited.chat.completions.create(model="extractive", messages=QUESTION)
    assert caught.value.code == "rate_limited"
    assert 1 <= int(caught.value.response.headers["retry-after"]) <= 60


# --------------------------------------------------------------------------- generation


CITED = "Charging takes 90 minutes [1]."


def remote_route(upstream_server) -> str:
    api_key = f"sk-openai-api-{uuid.uuid4().hex}"
    provider = Provider.objects.create(
        name="stand-in",
        kind=Provider.Kind.OPENAI_COMPATIBLE,
        base_url=upstream_server,
        model="stand-in-7b",
        draft_model="stand-in-draft",
        first_token_timeout_s=20,
        total_timeout_s=60,
    )
    key = UpstreamKey(provider=provider, label="main")
    key.set_secret(api_key)
    key.save()
    Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=64)
    return api_key


def wait_done(answer_id, timeout: float = 30) -> Answer:
    deadline = time.monotonic() + timeout
    while (answer := Answer.objects.get(pk=answer_id)).status not in ("done", "failed"):
        assert time.monotonic() < deadline, f"answer {answer_id} still {answer.status}"
        time.sleep(0.1)
    return answer


@pytest.mark.slow
def test_a_generation_streams_with_usage_and_speculative_options_choose_and_never_reach_the_upstream(
    site, workspace, upstream_server, start_worker
):
    api_key = remote_route(upstream_server)
    # The upstream is a vLLM started with a draft model (declared: it is never sent).
    Provider.objects.filter(name="stand-in").update(speculative_method="draft", draft_model="stand-in-draft")
    upstream_script(upstream_server, api_key, ["ok", "ok", {"cut_after_tokens": 2}, {"status": 400}, {"status": 400}])
    client = client_for(site, key_for(workspace, "generate"))
    messages = [{"role": "user", "content": f"How long does charging take?\nREPLY: {CITED}"}]
    with start_worker(["remote"], pool="threads"), start_worker(["default"]):
        assert [model.id for model in client.models.list()][:2] == ["default", "stand-in-7b"]

        completion = client.chat.completions.create(
            model="default", messages=messages, extra_body={"enable_speculative": True, "draft_model": "stand-in-draft"}
        )
        assert completion.choices[0].message.content == CITED and completion.model == "default"
        assert completion.citations[0]["number"] == 1
        assert completion.speculative is None  # the stand-in reports no speculative figures
        assert completion.inference_time_ms > 0

        stream = client.chat.completions.create(
            model="stand-in-7b",  # the default route, by its model id
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative_decoding": {"enabled": True, "draft_tokens": 4}},
        )
        chunks = list(stream)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert streamed == CITED == wait_done(chunks[0].id.removeprefix("chatcmpl-")).text
        # One verified sentence, sent once it was complete and checked.
        assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]) == 1
        assert chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-2].speculative is None
        # No endpoint of the model proposes 6 tokens a step, or runs without speculation: 400, nothing sent.
        for options, param in (
            ({"speculative_decoding": {"draft_tokens": 6}}, "speculative_decoding.draft_tokens"),
            ({"enable_speculative": False}, "enable_speculative"),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="default", messages=messages, extra_body=options)
            assert caught.value.param == param, caught.value

        with pytest.raises(openai.APIError) as caught:  # cut mid-stream: the stream's error event
            list(client.chat.completions.create(model="default", messages=messages, stream=True))
        assert caught.value.code == "broken_stream"
        with pytest.raises(openai.InternalServerError) as caught:  # the upstream refused it: 502
            client.chat.completions.create(model="default", messages=messages)
        assert caught.value.code == "bad_request"
        assert caught.value.response.headers["x-should-retry"] == "false"  # it would fail the same again
        with pytest.raises(openai.InternalServerError):  # streamed: a failure before any token has its status
            client.chat.completions.create(model="default", messages=messages, stream=True)

    first, second, cut, refused, refused_streamed = upstream_log(upstream_server, api_key)
    # The options chose the endpoint; none of them, nor the provider's settings, went upstream.
    assert [entry["extra"] for entry in (first, second, cut, refused, refused_streamed)] == [{}] * 5
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (second["prompt_tokens"], 5)
    assert usage.total_tokens == second["prompt_tokens"] + 5
    assert (cut["outcome"], refused["outcome"], refused_streamed["outcome"]) == (
        "cut after 2 tokens",
        "status 400",
        "status 400",
    )


@pytest.mark.slow
def test_a_chat_completion_plans_its_route_once_and_the_answer_takes_the_plan(workspace, upstream_server, monkeypatch):
    """The door plans (the route, its arm, the endpoint for the speculative options) and
    ``answer_create`` takes that plan: a request whose route this process has resolved reads
    the routing version once, and nothing else of routing, before its message goes. No worker
    takes queue ``remote`` here: the messages wait there (read back, then removed)."""
    from frontdoors.openai_api import chat as chat_api
    from inference import router
    from tests.inference.routing_helpers import queue_purge, queued_request_ids

    remote_route(upstream_server)
    key = client_keys.client_key_authenticate(key_for(workspace, "generate"), scope="generate")
    request = chat_api.request_parse({"model": "default", "messages": QUESTION, "stream": True})
    queue_purge()
    try:
        chat_api.answer_start(key, request)  # resolves the route for this process

        reads = []
        fetch_one = router.fetch_one
        monkeypatch.setattr(router, "fetch_one", lambda sql, params: reads.append(sql) or fetch_one(sql, params))
        started = chat_api.answer_start(key, request)

        reads_of_a_resolved_route = "SELECT (SELECT version FROM inference_routingversion WHERE id = 1)"
        assert reads == [reads_of_a_resolved_route]
        asked = [str(answer.pk) for answer in Answer.objects.order_by("created_at")]
        assert queued_request_ids() == asked
        assert (started.model, started.answer.status, started.answer.route.name) == ("default", "generating", "default")
        # The default route's model id names the default route too (not the usual path: the
        # lookup of a route by that name, which finds none, comes first, then the default's
        # plan, resolved by the first such request).
        by_model_id = chat_api.request_parse({"model": "stand-in-7b", "messages": QUESTION})
        assert chat_api.answer_start(key, by_model_id).model == "default"
        reads.clear()
        assert chat_api.answer_start(key, by_model_id).model == "default"
        assert len(reads) == 2 and "r.name = " in reads[0] and reads[1] == reads_of_a_resolved_route
        assert len(queued_request_ids()) == 4
    finally:
        queue_purge()


def test_a_gpu_pool_reports_its_engines_figures_and_options_choose_between_pools(
    site, workspace, start_worker, ngram_pool, tmp_path
):
    """The n-gram vLLM pool, and a plain pool of the same model (our engine behind the same
    protocol, speculation off): the request's options choose, and each answer says what its
    engine reported."""
    from tests.pools import engine_serving

    speculating = Provider.objects.create(name="pool", **ngram_pool.provider_fields())
    Route.objects.create(name="pool", provider=speculating, is_default=True, max_tokens=12)
    client = client_for(site, key_for(workspace, "generate"))
    plain_server = engine_serving(
        ngram_pool.model, tmp_path / "plain.log", "--speculative", "off", name=ngram_pool.model
    )
    with plain_server as plain_url:
        plain = Provider.objects.create(
            name="plain", **{**ngram_pool.provider_fields(), "devices": [plain_url], "speculative_method": "off"}
        )
        with start_worker(["gpu"], pool="threads", concurrency=4), start_worker(["default"]):
            asked = client.chat.completions.create(
                model="pool", messages=QUESTION, extra_body={"speculative_decoding": {"draft_tokens": 4}}
            )
            unasked = client.chat.completions.create(model="pool", messages=QUESTION)
            off = client.chat.completions.create(
                model="pool", messages=QUESTION, extra_body={"enable_speculative": False}
            )
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(
                    model="pool", messages=QUESTION, extra_body={"enable_speculative": True, "draft_model": "other"}
                )
            assert (caught.value.param, caught.value.code) == ("draft_model", "model_not_found")
            stored = wait_done(asked.id.removeprefix("chatcmpl-"))
            wait_done(off.id.removeprefix("chatcmpl-"))

    spec = asked.speculative
    assert spec == stored.stats["speculative"]
    assert spec["spec_tokens"] == 4 and spec["draft_tokens_proposed"] >= spec["draft_tokens_accepted"] >= 0
    assert unasked.speculative is not None  # the route's own pool speculates
    assert off.speculative is None  # our engine with speculation off reports nothing
    assert (asked.usage.completion_tokens, asked.choices[0].finish_reason) == (12, "length")
    assert asked.inference_time_ms > 0
    # Greedy on the same pool: speculation changes the speed, never the text.
    assert unasked.choices[0].message.content == asked.choices[0].message.content
    ledger.usage_records_store()
    assert UsageRecord.objects.get(request_id=answer_of(asked.id).pk).provider_id == speculating.pk
    assert UsageRecord.objects.get(request_id=answer_of(off.id).pk).provider_id == plain.pk


# --------------------------------------------------------------------------- verified while streaming

# Replies the stand-in writes (a question's "REPLY: ..."), over the module's three documents:
# supported sentences, a number nothing supports, a lead-in, a loop, a wrong citation, a listing
# (one line each: the stand-in reads its reply from one line).
REPLIES = [
    "Charging takes 90 minutes [1].",
    "Here is what I found: charging takes 90 minutes [1].",
    "Charging takes 90 minutes [1]. The robot weighs 900 kg [1].",
    "The robot weighs 900 kg [1]. Charging takes 90 minutes [1].",
    "The Atlas-7 warehouse robot runs for 10 hours on one battery charge [1]. Charging takes 90 minutes.",
    "Charging takes 90 minutes [1]. Charging takes 90 minutes [1]. Charging takes 90 minutes [1].",
    "Sure! Charging takes 90 minutes [1]. The robot flies at 300 km/h [1]. It runs for 10 hours [1].",
    "Charging takes 90 minutes. [1] [7] Sources: robot.md",
    "The sources do not say how much the robot weighs.",
    "The robot is painted green and sings [1].",
    "Lift rises with the angle of attack until the wing stalls [1]. Charging takes 90 minutes [1].",
]
UNSUPPORTED = ["900 kg", "300 km/h", "painted green", "Sources: robot.md"]


def rest_deltas(site: str, token: str, answer_id) -> list[str]:
    """The texts of the ``delta`` events of ``GET /api/v1/answers/<id>/stream``, to its end."""
    request = urllib.request.Request(
        f"{site}/api/v1/answers/{answer_id}/stream", headers={"Authorization": f"Bearer {token}"}
    )
    texts, kind = [], None
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: ") and kind == "delta":
                texts.append(json.loads(line.removeprefix("data: "))["text"])
            elif line.startswith("data: ") and kind in ("answer", "error"):
                break
    return texts


@pytest.mark.slow
def test_a_streamed_answer_is_the_stored_answer_and_never_shows_what_its_check_withheld(
    site, workspace, upstream_server, start_worker
):
    """For each reply: the text a streaming client assembles (the official SDK and LangChain's
    ChatOpenAI, chunk by chunk; the REST API's Server-Sent Events) equals the non-streamed
    completion and the stored answer, and nothing the check withheld reaches it; asked for, the
    model's own tokens come marked unverified."""
    remote_route(upstream_server)
    token = key_for(workspace, "generate")
    client = client_for(site, token)
    langchain = ChatOpenAI(model="default", base_url=f"{site}/v1", api_key=token, max_retries=0, timeout=60)
    with start_worker(["remote"], pool="threads"), start_worker(["default"]):
        for reply in REPLIES:
            messages = [{"role": "user", "content": f"How long does charging take?\nREPLY: {reply}"}]
            whole = client.chat.completions.create(model="default", messages=messages)
            chunks = list(client.chat.completions.create(model="default", messages=messages, stream=True))
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            stored = wait_done(chunks[0].id.removeprefix("chatcmpl-"))
            assert streamed == whole.choices[0].message.content == stored.text, reply
            assert stored.verification["original_text"] == reply
            # The REST API's Server-Sent Events carry the same text, and so does LangChain's client.
            assert "".join(rest_deltas(site, token, stored.pk)) == stored.text, reply
            assert "".join(chunk.content for chunk in langchain.stream(messages)) == stored.text, reply
            for phrase in UNSUPPORTED:
                assert phrase not in streamed, (reply, streamed)
            assert not any(getattr(chunk, "unverified", False) for chunk in chunks)
        raw = list(
            client.chat.completions.create(
                model="default", messages=messages, stream=True, extra_body={"unverified_tokens": True}
            )
        )
        tokens = [chunk for chunk in raw if chunk.choices and chunk.choices[0].delta.content]
        assert "".join(chunk.choices[0].delta.content for chunk in tokens) == REPLIES[-1]
        assert all(chunk.unverified is True for chunk in tokens)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="default", messages=messages, extra_body={"unverified_tokens": True})
        assert caught.value.param == "unverified_tokens"
