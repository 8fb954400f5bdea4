"""Conversations through the REST API: created, listed (a key's own, latest turn first), read
with their answers, renamed, deleted; questions asked within one are read as follow-ups."""

from __future__ import annotations

import uuid

import pytest

from search.models import Answer, Conversation
from tests.search.answering.test_conversations import FIRST, FOLLOW_UP, FOLLOW_UP_QUERY, TRAVEL
from tests.search.files import ingest_texts as ingest

pytestmark = pytest.mark.django_db


@pytest.fixture
def travel(handbook):
    ingest(handbook, TRAVEL)
    return handbook


def test_a_conversation_is_created_asked_in_listed_read_renamed_and_deleted(travel, make_key, client_for):
    api = client_for(make_key("generate"))
    created = api.post("/api/v1/conversations", {}, format="json")
    assert created.status_code == 201, created.content
    conversation = created.json()
    assert (conversation["title"], conversation["turns"]) == ("", 0)
    assert conversation["url"] == f"http://testserver/api/v1/conversations/{conversation['id']}"

    asked = {"question": FIRST, "conversation": conversation["id"]}
    first = api.post("/api/v1/answers?wait=5", asked, format="json").json()
    follow = api.post("/api/v1/answers?wait=5", {**asked, "question": FOLLOW_UP}, format="json").json()
    assert first["conversation"] == follow["conversation"] == conversation["id"]
    assert (first["question"], first["retrieval_query"]) == (FIRST, FIRST)
    assert follow["retrieval_query"] == FOLLOW_UP_QUERY
    assert follow["stats"]["followup"]["method"] == "terms"

    listed = api.get("/api/v1/conversations").json()
    assert [(item["id"], item["title"], item["turns"]) for item in listed["results"]] == [
        (conversation["id"], FIRST, 2)
    ]
    read = api.get(conversation["url"]).json()
    assert [answer["id"] for answer in read["answers"]] == [first["id"], follow["id"]]
    assert read["answers"][1]["retrieval_query"] == follow["retrieval_query"]

    renamed = api.patch(conversation["url"], {"title": "  Per-diem   in Berlin "}, format="json")
    assert (renamed.status_code, renamed.json()["title"], renamed.json()["turns"]) == (200, "Per-diem in Berlin", 2)
    assert api.delete(conversation["url"]).status_code == 204
    assert api.get(conversation["url"]).status_code == 404
    assert not Answer.objects.filter(pk__in=[first["id"], follow["id"]]).exists()


def test_an_answer_without_a_conversation_starts_one_of_its_own(travel, make_key, client_for):
    api = client_for(make_key("generate"))
    answer = api.post("/api/v1/answers?wait=5", {"question": FIRST}, format="json").json()
    conversation = Conversation.objects.get(pk=answer["conversation"])
    assert (conversation.title, conversation.answers.count()) == (FIRST, 1)
    [listed] = api.get("/api/v1/conversations").json()["results"]
    assert (listed["id"], listed["turns"]) == (answer["conversation"], 1)


def test_a_key_sees_only_its_own_conversations(travel, make_key, client_for):
    mine, theirs = client_for(make_key("generate")), client_for(make_key("generate"))
    their_answer = theirs.post("/api/v1/answers", {"question": FIRST}, format="json").json()
    their_url = f"/api/v1/conversations/{their_answer['conversation']}"
    assert mine.get("/api/v1/conversations").json()["count"] == 0
    for method, body in (("get", None), ("patch", {"title": "Mine now"}), ("delete", None)):
        response = getattr(mine, method)(their_url, body, format="json")
        assert response.status_code == 404, (method, response.content)
        assert response.json()["error"] == {
            "code": "not_found",
            "message": f"No conversation {their_answer['conversation']} of yours in this workspace.",
        }
    refused = mine.post(
        "/api/v1/answers", {"question": FOLLOW_UP, "conversation": their_answer["conversation"]}, format="json"
    )
    assert (refused.status_code, refused.json()["error"]) == (
        400,
        {
            "code": "invalid_request",
            "message": f"No conversation {their_answer['conversation']} of yours in this workspace.",
            "field": "conversation",
        },
    )
    assert Conversation.objects.get(pk=their_answer["conversation"]).answers.count() == 1


def test_a_key_and_a_user_of_the_same_number_own_nothing_of_each_others(travel, acme, make_key, client_for):
    """Keys and users are numbered apart, and may share a number: a conversation is its owner's
    alone, a session's or a key's."""
    from django.contrib.auth import get_user_model

    from billing.models import ClientKey
    from search.models import Membership

    token = make_key("generate")
    key = ClientKey.objects.get(workspace=acme)
    while (user := get_user_model().objects.create_user(f"user-{uuid.uuid4().hex[:8]}")).pk < key.pk:
        pass
    while key.pk < user.pk:
        token = make_key("generate")
        key = ClientKey.objects.order_by("-pk").first()
    assert key.pk == user.pk
    Membership.objects.create(workspace=acme, user=user)
    session = client_for()
    session.force_login(user)
    users = session.post("/api/v1/answers", {"question": FIRST}, format="json").json()["conversation"]

    api = client_for(token)
    assert api.get("/api/v1/conversations").json()["count"] == 0
    assert api.get(f"/api/v1/conversations/{users}").status_code == 404
    refused = api.post("/api/v1/answers", {"question": FOLLOW_UP, "conversation": users}, format="json")
    assert (refused.status_code, refused.json()["error"]["field"]) == (400, "conversation")
    keys = api.post("/api/v1/answers", {"question": FIRST}, format="json").json()["conversation"]
    assert [item["id"] for item in session.get("/api/v1/conversations").json()["results"]] == [users]
    assert [item["id"] for item in api.get("/api/v1/conversations").json()["results"]] == [keys]
    assert Conversation.objects.get(pk=users).client_id == f"user:{user.pk}"
    assert Conversation.objects.get(pk=keys).client_id == f"key:{key.pk}"


def test_bad_conversation_requests_name_the_field(travel, make_key, client_for):
    api = client_for(make_key("generate"))
    url = api.post("/api/v1/conversations", {"title": "Trip"}, format="json").json()["url"]
    for body in ({"title": "   "}, {"title": "x" * 201}, {"title": None}):
        response = api.patch(url, body, format="json")
        assert (response.status_code, response.json()["error"]["field"]) == (400, "title"), body
    unchanged = api.patch(url, {}, format="json")  # PATCH: nothing given, nothing changed
    assert (unchanged.status_code, unchanged.json()["title"]) == (200, "Trip")
    response = api.post("/api/v1/answers", {"question": FIRST, "conversation": "not-a-uuid"}, format="json")
    assert (response.status_code, response.json()["error"]["field"]) == (400, "conversation")
    # A key without the generate scope has no conversations.
    search_only = client_for(make_key("search"))
    assert search_only.get("/api/v1/conversations").status_code == 403
