"""``ragsite.rows.insert_together``: new rows of several tables in one statement, all or none."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection
from django.test.utils import CaptureQueriesContext

from ragsite.rows import insert_together
from search.models import Answer, Collection, Conversation
from search.services import collection_create, workspace_create

pytestmark = pytest.mark.django_db(transaction=True)  # the statement commits by itself


def _rows(workspace, collection, *, question: str):
    conversation = Conversation(workspace=workspace, client_id="7", title=question)
    answer = Answer(workspace=workspace, client_id="7", question=question, conversation=conversation)
    link = Answer.collections.through(answer_id=answer.pk, collection_id=collection.pk)
    return conversation, answer, link


def test_the_rows_of_three_tables_go_in_one_statement_with_their_fields_values():
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    conversation, answer, link = _rows(workspace, collection, question="How does lift change?")
    answer.stats = {"context": {"sources": 2}}

    with CaptureQueriesContext(connection) as queries:
        insert_together([conversation], [answer], [link])

    assert len(queries.captured_queries) == 1
    assert (conversation._state.adding, answer._state.adding) == (False, False)
    stored = Answer.objects.select_related("conversation").get(pk=answer.pk)
    assert (stored.question, stored.stats, stored.conversation.title) == (
        "How does lift change?",
        {"context": {"sources": 2}},
        "How does lift change?",
    )
    assert list(stored.collections.all()) == [collection]
    assert link.pk is None  # the database's own id, not read back


def test_a_failing_row_leaves_none_of_the_others():
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    conversation, answer, _ = _rows(workspace, collection, question="How does lift change?")
    missing = Answer.collections.through(answer_id=answer.pk, collection_id=collection.pk + 1000)

    with pytest.raises(IntegrityError):
        insert_together([conversation], [answer], [missing])

    assert (Conversation.objects.count(), Answer.objects.count()) == (0, 0)
    assert Collection.objects.count() == 1
