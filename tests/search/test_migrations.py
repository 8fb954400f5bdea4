"""Upgrading keeps the data: migration search 0004 moves collections from PostgreSQL's
``english`` to ``search_english`` and recomputes their term statistics and BM25 weights
exactly as ingestion computes them; undone, it moves them back the same way."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from search.bm25 import collection_bm25_refresh
from search.models import Chunk, Collection
from search.selectors import chunk_search
from tests.search.files import ingest_texts

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("search", "0003_answer")]
AFTER = [("search", "0004_search_english_and_query_term_frequency")]

TEXTS = {
    "flow.md": "What is the flow over a wing? The flow over the wing is what lifts it, and what it does matters.",
    "heat.md": "Heat transfer at the stagnation point of a blunt body, and what the wall temperature does.",
    "shock.md": "A shock wave ahead of the body: its standoff distance, being small, is hard to measure.",
}


def migrate(targets) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)


def migrate_to_latest() -> None:
    """Every app at its newest migration, as the other tests expect to find the schema."""
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def state(collection_id: int) -> dict:
    """Everything BM25 keeps for a collection, and the chunks themselves."""
    # Only the columns every migration has: an older schema lacks later ones (language, 0010).
    collection = Collection.objects.only("text_search_config", "chunk_count", "lexeme_total", "bm25_avgdl").get(
        pk=collection_id
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT term, df FROM search_termstat WHERE collection_id = %s ORDER BY term", [collection_id])
        terms = cursor.fetchall()
        cursor.execute(
            "SELECT id, ts_config::text, tsv::text, bm25::text FROM search_chunk WHERE collection_id = %s ORDER BY id",
            [collection_id],
        )
        chunks = cursor.fetchall()
    return {
        "config": collection.text_search_config,
        "chunk_count": collection.chunk_count,
        "lexeme_total": collection.lexeme_total,
        "avgdl": collection.bm25_avgdl,
        "terms": terms,
        "chunks": chunks,
    }


def test_the_upgrade_recomputes_bm25_as_ingestion_does_and_can_be_undone(collection):
    assert collection.text_search_config == "search_english"
    ingest_texts(collection, TEXTS)
    collection_bm25_refresh(collection_id=collection.pk)  # the weights at the exact average length
    ingested = state(collection.pk)
    embeddings = {chunk.pk: list(chunk.embedding) for chunk in Chunk.objects.filter(collection=collection)}
    ranked = [
        hit.chunk_id
        for hit in chunk_search(
            query="what does the flow do", workspace=collection.workspace, mode="keyword", syntax="question"
        ).hits
    ]
    try:
        migrate(BEFORE)
        undone = state(collection.pk)
        assert undone["config"] == "english"
        assert {row[1] for row in undone["chunks"]} == {"english"}
        # PostgreSQL's english drops "what" and "does" (127 stop words); search_english keeps them.
        assert "'what'" not in " ".join(row[2] for row in undone["chunks"])
        assert undone["lexeme_total"] < ingested["lexeme_total"]
        assert undone["chunk_count"] == ingested["chunk_count"] == 3
        assert len(undone["terms"]) < len(ingested["terms"])

        migrate(AFTER)
        assert state(collection.pk) == ingested  # the same statistics and weights as ingestion wrote
    finally:
        migrate_to_latest()
    assert {chunk.pk: list(chunk.embedding) for chunk in Chunk.objects.filter(collection=collection)} == embeddings
    assert [
        hit.chunk_id
        for hit in chunk_search(
            query="what does the flow do", workspace=collection.workspace, mode="keyword", syntax="question"
        ).hits
    ] == ranked


def test_answers_asked_before_conversations_become_conversations_of_one_turn(workspace):
    from django.contrib.auth import get_user_model

    from search.models import Answer, Conversation

    ann = get_user_model().objects.create_user("ann")
    before = [("search", "0007_answer_created_when_asked")]
    try:
        migrate(before)
        old_answer = MigrationExecutor(connection).loader.project_state(before).apps.get_model("search", "Answer")
        asked = old_answer.objects.create(
            workspace_id=workspace.pk, asker_id=ann.pk, client_id="key-3", question="  How long\n does charging take? "
        )
        migrate_to_latest()
        answer = Answer.objects.get(pk=asked.pk)
        conversation = Conversation.objects.get(pk=asked.pk)  # the answer's own id
        assert answer.conversation == conversation
        assert answer.retrieval_query == answer.question == "  How long\n does charging take? "
        assert (conversation.title, conversation.owner, conversation.client_id, conversation.workspace) == (
            "How long does charging take?",
            ann,
            "key-3",
            workspace,
        )
        assert conversation.created_at == conversation.updated_at == answer.created_at
    finally:
        migrate_to_latest()


def test_bare_client_ids_are_named_a_users_or_a_keys(workspace):
    """A number was a user's id or an API key's: the asker's own is the user's, any other a key's."""
    from django.contrib.auth import get_user_model

    from search.models import Answer, Conversation

    ann = get_user_model().objects.create_user("ann")
    before = [("search", "0008_conversations")]
    ids = {}
    try:
        migrate(before)
        apps = MigrationExecutor(connection).loader.project_state(before).apps
        old_answer, old_conversation = apps.get_model("search", "Answer"), apps.get_model("search", "Conversation")
        for name, asker, client_id in (
            ("ann's", ann.pk, str(ann.pk)),  # the UI, or the REST API with ann's session
            ("a key's", None, str(ann.pk)),  # a key that has ann's number
            ("a key's, asked as ann", ann.pk, str(ann.pk + 41)),
            ("a tool's", None, "eval"),
            ("nobody's", None, ""),
        ):
            conversation = old_conversation.objects.create(
                workspace_id=workspace.pk, owner_id=asker, client_id=client_id, title=name
            )
            answer = old_answer.objects.create(
                workspace_id=workspace.pk, asker_id=asker, client_id=client_id, question=name, conversation=conversation
            )
            ids[name] = (conversation.pk, answer.pk)
        migrate_to_latest()
        named = {
            name: (Conversation.objects.get(pk=c).client_id, Answer.objects.get(pk=a).client_id)
            for name, (c, a) in ids.items()
        }
        assert named == {
            "ann's": (f"user:{ann.pk}", f"user:{ann.pk}"),
            "a key's": (f"key:{ann.pk}", f"key:{ann.pk}"),
            "a key's, asked as ann": (f"key:{ann.pk + 41}", f"key:{ann.pk + 41}"),
            "a tool's": ("eval", "eval"),
            "nobody's": ("", ""),
        }
        migrate(before)  # and back
        assert Conversation.objects.get(pk=ids["a key's"][0]).client_id == str(ann.pk)
    finally:
        migrate_to_latest()
