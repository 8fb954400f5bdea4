"""Conversations: every answer is a turn of one, a follow-up is retrieved for with the turns
before it, and the prompt holds those turns within the window (search/answering/conversations.py)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from search.answering import conversations
from search.answering.answers import QUOTED_LEAD, AnswerError, answer_create
from search.answering.conversations import ConversationError, Turn, followup_terms, history_of
from search.answering.extractive import LEAD
from search.answering.prompting import PromptBudget, RemoteEstimate, Source, answer_messages, prompt_plan
from search.models import Answer, Conversation
from search.selectors import chunk_search
from search.services import collection_create, workspace_create
from tests.search.files import ingest_texts

TRAVEL = {
    "per_diem.md": "# Travel policy\n\nThe per-diem allowance for a business trip is EUR 90 a day in Berlin "
    "and CHF 120 a day in Zurich. Receipts are not needed for the per-diem allowance.",
    "office.md": "# Offices\n\nThe Berlin office is on Alexanderplatz. How much desk space it has depends on "
    "the floor: it is open from 8 to 18.",
    "parking.md": "# Parking\n\nStaff park in the garage under the building; a permit costs EUR 40 a month.",
}
FIRST = "What does the travel policy say about the per-diem allowance?"
FOLLOW_UP = "How much is it in Berlin?"
# What the follow-up is retrieved for after FIRST without a model: the earlier question whole, then it.
FOLLOW_UP_QUERY = f"{FIRST} {FOLLOW_UP}"


@pytest.fixture
def travel(db):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(collection, TRAVEL)
    return workspace, collection


@pytest.fixture
def ann(db):
    return get_user_model().objects.create_user("ann")


def _files(answer: Answer) -> list[str]:
    from search.models import Document

    names = dict(Document.objects.values_list("pk", "source_name"))
    return [names[source["document_id"]] for source in answer.sources]


def test_the_first_question_starts_a_conversation_titled_by_it(travel, ann):
    workspace, _ = travel
    answer = answer_create(workspace=workspace, question=f"  {FIRST}\n", asker=ann)

    conversation = answer.conversation
    stored = Conversation.objects.get(pk=conversation.pk)
    assert (stored.title, stored.owner, stored.client_id, stored.workspace) == (FIRST, ann, f"user:{ann.pk}", workspace)
    assert list(stored.answers.all()) == [answer]
    assert answer.retrieval_query == FIRST and "followup" not in answer.stats
    assert stored.created_at == stored.updated_at == answer.created_at


def test_a_follow_up_is_retrieved_for_with_the_question_before_it(travel, ann):
    workspace, _ = travel
    first = answer_create(workspace=workspace, question=FIRST, asker=ann)
    follow_up = answer_create(workspace=workspace, question=FOLLOW_UP, asker=ann, conversation=first.conversation)

    # Read with the question before it, whole: what "it" is.
    assert follow_up.retrieval_query == FOLLOW_UP_QUERY
    assert follow_up.stats["followup"] == {"method": "terms", "query": FOLLOW_UP_QUERY}
    # Alone, the follow-up finds the office (Berlin, "how much"); read with the turn before
    # it, the per-diem allowance in Berlin.
    alone = chunk_search(query=FOLLOW_UP, workspace=workspace, syntax="question").hits
    assert alone[0].document_id != follow_up.sources[0]["document_id"]
    assert _files(follow_up)[0] == "per_diem.md"
    # The same conversation, one turn more, listed first from now.
    conversation = Conversation.objects.get(pk=first.conversation_id)
    assert follow_up.conversation_id == conversation.pk and conversation.answers.count() == 2
    assert conversation.title == FIRST and conversation.updated_at == follow_up.created_at


def test_older_questions_add_their_telling_words_the_latest_turn_first(travel):
    _, collection = travel
    history = [Turn(question=FIRST, answer=""), Turn(question="Where is the Berlin office?", answer="")]
    reading = followup_terms("How much desk space does it have?", history, [collection])
    # The older question's words that a chunk holds and the query does not have yet, each in
    # one chunk of three (the same IDF: they keep the question's order); "what", "does",
    # "say" and "about" are in none, and could not match anything.
    assert reading.terms == ("travel", "policy", "per-diem", "allowance")
    assert (
        reading.query
        == "Where is the Berlin office? How much desk space does it have? travel policy per-diem allowance"
    )
    assert reading.as_record() == {"method": "terms", "query": reading.query, "terms": list(reading.terms)}
    # A first question is read as it is.
    assert followup_terms(FIRST, [], [collection]) == conversations.FollowupReading(query=FIRST, method="standalone")


def test_the_history_is_the_answered_turns_without_their_markers(travel, ann):
    workspace, _ = travel
    conversation = conversations.conversation_create(workspace=workspace, owner=ann)
    assert conversation.title == ""
    Answer.objects.create(
        workspace=workspace,
        conversation=conversation,
        question="Where is the office?",
        status=Answer.Status.DONE,
        text="It is on Alexanderplatz [1]. It opens at 8 [1][2].",
    )
    Answer.objects.create(
        workspace=workspace, conversation=conversation, question="Broken?", status=Answer.Status.FAILED, text="x"
    )
    Answer.objects.create(
        workspace=workspace,
        conversation=conversation,
        question="Who owns the moon?",
        status=Answer.Status.DONE,
        abstained=True,
        text="The sources do not say.",
    )
    assert history_of(conversation) == [
        Turn(question="Where is the office?", answer="It is on Alexanderplatz. It opens at 8."),
        Turn(question="Who owns the moon?", answer=""),
    ]
    # A conversation started empty is titled by its first question.
    answer_create(workspace=workspace, question=FIRST, asker=ann, conversation=conversation)
    assert Conversation.objects.get(pk=conversation.pk).title == FIRST


def test_a_quoted_answers_lead_line_is_not_part_of_the_turn():
    """What an answer quoted from its sources says is its quotes: a small model given the lead
    line as the assistant's earlier words writes it again, and nothing after it."""
    quotes = "- Switzerland: Full day: €68; Travel day: €36 [1]\n- Nordic countries: €64 [2]"
    without = "- Switzerland: Full day: €68; Travel day: €36\n- Nordic countries: €64"
    leads = (QUOTED_LEAD, "Extracted from the sources (no generation model is configured):", LEAD)
    for lead in leads:
        assert conversations.text_without_markers(f"{lead}\n\n{quotes}") == without
    # Only as the first line: the same words inside an answer are the answer's.
    said = "The policy says: Quoted from the sources (the handbook): see [1]."
    assert conversations.text_without_markers(said) == "The policy says: Quoted from the sources (the handbook): see."


def test_a_conversation_of_another_workspace_or_a_history_beside_one_is_refused(travel, ann):
    workspace, _ = travel
    other = workspace_create(name="Other", slug="other")
    theirs = conversations.conversation_create(workspace=other)
    with pytest.raises(AnswerError) as refused:
        answer_create(workspace=workspace, question=FIRST, conversation=theirs)
    assert (refused.value.field, str(refused.value)) == ("conversation", "the conversation is not in this workspace")
    mine = conversations.conversation_create(workspace=workspace, owner=ann)
    with pytest.raises(AnswerError) as refused:
        answer_create(workspace=workspace, question=FIRST, conversation=mine, history=[])
    assert refused.value.field == "history"
    assert not Answer.objects.filter(conversation__in=[theirs, mine]).exists()


def test_titles_are_one_line_and_bounded(db):
    long = "word " * 100
    title = conversations.title_from(long)
    assert len(title) <= conversations.TITLE_MAX_CHARS and title.endswith("…") and "\n" not in title
    assert conversations.title_from("a\n  b\tc") == "a b c"
    workspace = workspace_create(name="Acme", slug="acme")
    conversation = conversations.conversation_create(workspace=workspace, title="Trip")
    for bad, message in (
        ("   ", "the title is empty"),
        ("x" * 201, "the title is 201 characters long, over 200"),
        ("a\x00b", "the title holds a NUL character"),
    ):
        with pytest.raises(ConversationError) as refused:
            conversations.conversation_rename(conversation=conversation, title=bad)
        assert (refused.value.field, str(refused.value)) == ("title", message)
    assert conversations.conversation_rename(conversation=conversation, title=" Trip  to Berlin ").title == (
        "Trip to Berlin"
    )


def test_deleting_a_conversation_deletes_its_answers(travel, ann):
    workspace, _ = travel
    first = answer_create(workspace=workspace, question=FIRST, asker=ann)
    answer_create(workspace=workspace, question=FOLLOW_UP, asker=ann, conversation=first.conversation)
    kept = answer_create(workspace=workspace, question="Where do staff park?", asker=ann)
    conversations.conversation_delete(conversation=first.conversation)
    assert list(Answer.objects.all()) == [kept]


# --------------------------------------------------------------------------- the prompt


SOURCE = Source(
    number=1, chunk_id=1, document_id=1, title="Travel policy", text="EUR 90 a day in Berlin.", start_offset=0,
    end_offset=23, score=1.0,
)  # fmt: skip


def _budget(window: int) -> PromptBudget:
    return PromptBudget(counter=RemoteEstimate(), window=window, max_tokens=64, margin=16)


def test_the_prompt_holds_the_latest_turns_that_fit_their_share_oldest_dropped_first():
    history = [(f"Question {n} " + "word " * 40, f"Answer {n} " + "word " * 40) for n in range(1, 7)]
    budget = _budget(1200)
    plan = prompt_plan(FOLLOW_UP, [SOURCE], budget, history=history)

    [request] = plan.requests
    kept = (plan.history_given, plan.history_left_out)
    assert kept[0] >= 1 and kept[1] >= 1 and sum(kept) == 6
    # The latest turns, in their order, between the instructions and the sources.
    expected = answer_messages(FOLLOW_UP, plan.sources, history=history[-kept[0] :])
    assert request.messages == expected
    assert [m["role"] for m in request.messages] == ["system", *["user", "assistant"] * kept[0], "user"]
    count = budget.counter.messages
    bare = count(answer_messages(FOLLOW_UP, []))
    turns = count(answer_messages(FOLLOW_UP, [], history=history[-kept[0] :])) - bare
    one_more = count(answer_messages(FOLLOW_UP, [], history=history[-kept[0] - 1 :])) - bare
    assert turns <= 0.25 * budget.prompt_limit < one_more
    assert request.prompt_tokens == count(request.messages) <= budget.prompt_limit
    assert plan.sources == [SOURCE]
    assert plan.context_record()["history_turns"] == kept[0]
    assert plan.context_record()["history_left_out"] == kept[1]


def test_a_prompt_without_history_is_as_before():
    plan = prompt_plan(FIRST, [SOURCE], _budget(4096))
    assert plan.requests[0].messages == answer_messages(FIRST, [SOURCE])
    assert "history_turns" not in plan.context_record()
