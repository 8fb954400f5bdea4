"""Fixtures of the security tests: tenants, each a workspace with everything a caller of it can
reach (a collection with ingested documents, a failed document, an answer, a client key with
every scope and a member user), built from the product's own services.

``tenant_pair`` gives two of them, A and B, whose texts share no words, so that a search with
A's key for B's exact text can only find B's chunks by a leak.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from billing import client_keys
from billing.models import ClientKey
from search.access import readers_for
from search.answering.answers import answer_create
from search.models import Answer, Chunk, Collection, Document, Membership, Workspace
from search.services import (
    collection_create,
    document_create,
    document_delete,
    document_readers_set,
    workspace_create,
)
from tests.frontdoors.api.conftest import DOCUMENTS
from tests.search.files import ingest_texts

# B's texts: words that appear nowhere in A's, so any hit of them for A is B's.
SECRET_DOCUMENTS = {
    "ledger.md": "# Zanzibar ledger\n\nThe quokka treasury keeps its marmalade reserves in the Zanzibar vault. "
    "Only the harbour warden holds the vault's combination.",
    "recipe.md": "# Saffron recipe\n\nThe secret saffron glaze simmers for seventeen minutes with juniper and "
    "pomegranate molasses.",
}
# A's document that neither A's member nor A's key may read (readers: a group of nobody they
# are): its words are as secret to them as B's, through every URL (test_tenant_isolation).
RESTRICTED_TEXTS = {
    "prototype.md": "# Wombat prototype\n\nCharging the wombat prototype takes eleven minutes in the restricted "
    "cabinet. The robot battery of the wombat line is classified."
}
RESTRICTED_GROUP = "acme-restricted"
SECRET_COLLECTION = "Zanzibar ledgers"
SECRET_SENTENCE = "The quokka treasury keeps its marmalade reserves in the Zanzibar vault."
PASSWORD = "correct horse battery staple"
ALL_SCOPES = [scope.value for scope in ClientKey.Scope]


@dataclass
class Tenant:
    workspace: Workspace
    collection: Collection
    documents: list[Document]  # ingested (indexed)
    failed_document: Document  # stored, its ingestion failed: retryable
    answer: Answer  # asked with the key (extractive: no route is configured in tests), done
    member_answer: Answer  # the same question asked by the member, in a conversation of the member's
    chunk: Chunk
    key: ClientKey
    token: str  # the key's bearer token, every scope
    user: object  # a member (not staff) of this workspace only
    texts: dict[str, str] = field(default_factory=dict)
    # Ingested, readable only by RESTRICTED_GROUP, which neither the member nor the key reads as.
    restricted: Document | None = None


def _tenant_fill(workspace: Workspace, collection: Collection, texts: dict[str, str], question: str) -> Tenant:
    document_ids = ingest_texts(collection, texts)
    failed, _ = document_create(
        collection=collection, source_name="broken.txt", content=f"{workspace.slug} broken".encode(), enqueue=False
    )
    Document.objects.filter(pk=failed.pk).update(status=Document.Status.FAILED, error="the parser failed")
    failed.refresh_from_db()
    key, token = client_keys.client_key_create(workspace, f"{workspace.slug} key", scopes=ALL_SCOPES)
    user = get_user_model().objects.create_user(username=f"{workspace.slug}-member", password=PASSWORD)
    Membership.objects.create(workspace=workspace, user=user)
    answer = answer_create(workspace=workspace, question=question, client_key=key)
    member_answer = answer_create(workspace=workspace, question=question, asker=user)
    for done in (answer, member_answer):
        assert (done.status, done.mode) == (Answer.Status.DONE, Answer.Mode.EXTRACTIVE), done.error
    return Tenant(
        workspace=workspace,
        collection=collection,
        documents=list(Document.objects.filter(pk__in=document_ids).order_by("pk")),
        failed_document=failed,
        answer=answer,
        member_answer=member_answer,
        chunk=Chunk.objects.filter(document_id__in=document_ids).order_by("pk").first(),
        key=key,
        token=token,
        user=user,
        texts=texts,
    )


def tenant_pair_create() -> tuple[Tenant, Tenant]:
    """Tenants A (``acme``) and B (``beta``). Both collections are created before any chunk
    is written: a vector index cannot be created while the chunk table has pending trigger
    events in the transaction."""
    workspaces = [workspace_create(name="Acme", slug="acme"), workspace_create(name="Beta", slug="beta")]
    collections = [
        collection_create(workspace=workspaces[0], name="Handbook"),
        collection_create(workspace=workspaces[1], name=SECRET_COLLECTION),
    ]
    a = _tenant_fill(workspaces[0], collections[0], DOCUMENTS, "How long does charging take?")
    b = _tenant_fill(workspaces[1], collections[1], SECRET_DOCUMENTS, "Where are the marmalade reserves?")
    (restricted,) = ingest_texts(collections[0], RESTRICTED_TEXTS)
    a.restricted = document_readers_set(
        document=Document.objects.get(pk=restricted),
        readers=readers_for(groups=[Group.objects.create(name=RESTRICTED_GROUP).pk]),
    )
    return a, b


def tenant_pair_delete(pair: tuple[Tenant, Tenant]) -> None:
    """Everything ``tenant_pair_create`` made, documents first through the service that also
    takes their share out of the BM25 statistics (other tests' rankings read them)."""
    for tenant in pair:
        for document in Document.objects.filter(collection__workspace=tenant.workspace):
            document_delete(document=document)
        tenant.workspace.delete()  # collections, answers, keys, memberships
        tenant.user.delete()
    Group.objects.filter(name=RESTRICTED_GROUP).delete()


@pytest.fixture(scope="module")
def tenant_pair(django_db_setup, django_db_blocker) -> Iterator[tuple[Tenant, Tenant]]:
    """Tenants A and B, committed once for a module (building them ingests four documents) and
    deleted after it; each test still runs in its own transaction, rolled back, on top."""
    with django_db_blocker.unblock():
        pair = tenant_pair_create()
    try:
        yield pair
    finally:
        with django_db_blocker.unblock():
            tenant_pair_delete(pair)


@pytest.fixture
def tenant(tenant_pair, db) -> Tenant:
    """Tenant A alone (B exists beside it)."""
    return tenant_pair[0]
