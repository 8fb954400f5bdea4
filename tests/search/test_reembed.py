"""Moving a collection to another embedding model (an OpenAI-compatible API, played by the
upstream stand-in), with searches never seeing two models at once."""

from __future__ import annotations

import pytest
from django.core.management import call_command

from search import embedders
from search.ingest import pipeline
from search.ingest.reembed import collection_reembed
from search.models import Chunk, Collection, TermStat
from search.selectors import chunk_search
from search.services import document_create

DOCS = {
    "robot.txt": "The warehouse robot carries pallets and charges its battery at night.",
    "travel.txt": "Receipts for travel must be submitted within thirty days.",
    "security.txt": "Report a lost laptop to the security team within four hours.",
}
MODEL = "openai:hash-embed"


@pytest.fixture
def remote_embedder(settings, upstream_server):
    settings.EMBEDDING_API_BASE_URL = upstream_server
    settings.EMBEDDING_API_KEY = "test-key"
    settings.EMBEDDING_API_DIMENSIONS = 64
    embedders.embedder_get.cache_clear()
    yield
    embedders.embedder_get.cache_clear()


@pytest.mark.django_db(transaction=True)  # a new model's vector index is created outside a transaction
def test_reembed_switches_the_collection_to_the_new_model(collection, remote_embedder):
    ids = {}
    for name, text in DOCS.items():
        document, _ = document_create(collection=collection, source_name=name, content=text.encode(), enqueue=False)
        ids[name] = document.pk
    pipeline.documents_ingest(document_ids=list(ids.values()))
    stats_before = dict(TermStat.objects.filter(collection=collection).values_list("term", "df"))

    seen_during = []

    def progress(done, total):
        # Mid-way, the collection still answers with its old model, one copy per document.
        hits = chunk_search(query="robot battery", workspace=collection.workspace, mode="hybrid", top_k=10).hits
        seen_during.append([hit.document_id for hit in hits])
        models = set(Chunk.objects.filter(collection=collection).values_list("embedding_model", flat=True))
        assert Collection.objects.get(pk=collection.pk).embedding_model == "all-MiniLM-L6-v2"
        assert models == {"all-MiniLM-L6-v2", MODEL}

    collection_reembed(collection_id=collection.pk, model=MODEL, on_progress=progress)

    for document_ids in seen_during:
        assert len(document_ids) == len(set(document_ids)) == 3
    collection.refresh_from_db()
    assert (collection.embedding_model, collection.embedding_dimensions) == (MODEL, 64)
    chunks = Chunk.objects.filter(collection=collection)
    assert set(chunks.values_list("embedding_model", "embedding_dimensions")) == {(MODEL, 64)}
    assert collection.chunk_count == chunks.count() == 3
    assert dict(TermStat.objects.filter(collection=collection).values_list("term", "df")) == stats_before
    dense = chunk_search(query="lost laptop security", workspace=collection.workspace, mode="dense", top_k=1)
    assert dense.hits[0].document_id == ids["security.txt"]


def test_reembed_command_refuses_unknown_models(collection):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="unknown embedding model 'nope'"):
        call_command("reembed", str(collection.pk), "--model", "nope")
