"""Tenants and their documents.

A ``Workspace`` is the tenant boundary: every collection, document, answer and key
belongs to exactly one, and every query filters by it.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchVectorField
from django.db import models
from django.db.models import F, Func, Q
from django.db.models.functions import Coalesce
from django.utils import timezone
from pgvector.django import SparseVectorField, VectorField

# BM25 term weights live in a sparse vector whose indices are hashed lexemes (see the
# search_term_index SQL function): the dimension is pgvector's maximum.
BM25_DIMENSIONS = 1_000_000_000
# A document's and its chunks' readers (search.access): "*" for everyone the workspace admits.
READERS_OPEN = ["*"]


def readers_field() -> ArrayField:
    """Who may read a row (search.access): principals ``*``, ``u:<id>``, ``g:<id>``."""
    return ArrayField(models.CharField(max_length=24), default=list_open, db_default=READERS_OPEN)


def list_open() -> list[str]:
    return list(READERS_OPEN)


class RegConfigField(models.CharField):
    """A PostgreSQL text-search configuration (``regconfig``), e.g. ``english`` or ``simple``.

    Stored as ``regconfig`` so that ``to_tsvector(ts_config, text)`` is immutable and can
    feed a generated column; read back as its name.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("max_length", 63)
        super().__init__(*args, **kwargs)

    def db_type(self, connection):
        return "regconfig"

    def cast_db_type(self, connection):
        return "regconfig"


class Workspace(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="workspaces")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Role(models.TextChoices):
    """What a member may do in a workspace (search.scoping.role_in; docs/access.md, "Roles").
    Reading is always limited by each document's readers, whatever the role."""

    VIEWER = "viewer", "Viewer"  # searches, asks, opens and downloads what its readers allow
    EDITOR = "editor", "Editor"  # and uploads, retries and deletes documents, and sets their readers
    ADMIN = "admin", "Admin"  # and the workspace's members, groups and API keys (the admin console)


class Membership(models.Model):
    Role = Role  # Membership.Role, as before roles were shared with WorkspaceGroup

    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    # Editor by default: what a member could do before there were roles.
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.EDITOR)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["workspace", "user"], name="membership_unique_user")]

    def __str__(self) -> str:
        return f"{self.user} in {self.workspace} ({self.role})"


class WorkspaceGroup(models.Model):
    """Everyone in a group is a member of the workspace in this role: groups from the identity
    provider (ragsite.identity) give whole departments their workspaces without a row per
    person. A user in several ways holds the highest of their roles."""

    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="group_grants")
    group = models.ForeignKey("auth.Group", on_delete=models.CASCADE, related_name="workspace_grants")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["workspace", "group"], name="workspace_group_unique")]

    def __str__(self) -> str:
        return f"group {self.group} in {self.workspace} ({self.role})"


class Collection(models.Model):
    workspace_path = "workspace"  # search.scoping: how a front door finds its rows

    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="collections")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    # Every chunk of a collection is embedded by this model: vectors of two models are
    # never compared. ``manage.py reembed`` moves a collection to another model.
    embedding_model = models.CharField(max_length=200, default="all-MiniLM-L6-v2")
    embedding_dimensions = models.PositiveSmallIntegerField(default=384)
    text_search_config = RegConfigField(
        default="search_english",
        help_text=(
            "PostgreSQL text-search configuration: search_english (English as BM25 references analyse it),"
            " or any other, e.g. german, simple."
        ),
    )
    # The language chunks and queries are analysed in (search/analysis): "auto" reads each
    # one's own, so a collection of Japanese and English documents indexes each in its language.
    language = models.CharField(
        max_length=8,
        choices=[("auto", "Each text's own"), ("ja", "Japanese"), ("en", "English")],
        default="auto",
        help_text=(
            "The language chunks and queries are analysed in: auto reads each one's own (Japanese or the"
            " text-search configuration's language); ja or en fixes it."
        ),
    )
    # Corpus statistics for BM25, maintained in the same transaction as the chunks.
    chunk_count = models.PositiveBigIntegerField(default=0)
    lexeme_total = models.PositiveBigIntegerField(default=0)
    # The average chunk length that the stored BM25 weights were computed with.
    bm25_avgdl = models.FloatField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["workspace", "name"], name="collection_unique_name")]

    def __str__(self) -> str:
        return f"{self.workspace.slug}/{self.name}"


class Document(models.Model):
    workspace_path = "collection__workspace"  # search.scoping: how a front door finds its rows
    readers_path = "readers"  # search.scoping: who may read its rows (search.access)

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        PARSING = "parsing", "Parsing"
        CHUNKING = "chunking", "Chunking"
        EMBEDDING = "embedding", "Embedding"
        INDEXED = "indexed", "Indexed"
        FAILED = "failed", "Failed"

    collection = models.ForeignKey(Collection, on_delete=models.CASCADE, related_name="documents")
    title = models.CharField(max_length=500)
    source_name = models.CharField(max_length=500, help_text="The file name as uploaded.")
    media_type = models.CharField(max_length=100)
    file = models.FileField(upload_to="documents/%Y/%m/", max_length=500)
    size_bytes = models.PositiveBigIntegerField(default=0)
    # SHA-256 of the uploaded bytes: the same file uploaded twice is one document.
    content_sha256 = models.CharField(max_length=64)
    # SHA-256 of the normalised text, once parsed: the same text in another file format
    # is recognised as a duplicate too.
    sha256 = models.CharField(max_length=64, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    error = models.TextField(blank=True, help_text="Why ingestion failed, for operators.")
    chunks_total = models.PositiveIntegerField(default=0)
    chunks_embedded = models.PositiveIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    metadata = models.JSONField(default=dict, blank=True)
    # Who may read it (search.access), copied to its chunks; changed by ``document_readers_set``.
    readers = readers_field()
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    indexed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["collection", "content_sha256"], name="document_unique_content"),
            models.UniqueConstraint(
                fields=["collection", "sha256"], condition=~Q(sha256=""), name="document_unique_text"
            ),
        ]
        indexes = [GinIndex(fields=["readers"], name="document_readers_gin")]

    def __str__(self) -> str:
        return self.title


class Chunk(models.Model):
    """A passage of a document, the unit of retrieval.

    ``text == document_text[start_offset:end_offset]``. Written only by the ingestion
    pipeline, all chunks of a document in one transaction.
    """

    workspace_path = "collection__workspace"  # search.scoping: how a front door finds its rows
    readers_path = "readers"  # search.scoping: who may read its rows (search.access)

    document = models.ForeignKey(Document, on_delete=models.CASCADE, related_name="chunks")
    # Denormalised from the document so that filters and indexes need no join.
    collection = models.ForeignKey(Collection, on_delete=models.CASCADE, related_name="chunks", db_index=False)
    ordinal = models.PositiveIntegerField()
    text = models.TextField()
    start_offset = models.PositiveIntegerField()
    end_offset = models.PositiveIntegerField()
    token_count = models.PositiveIntegerField()
    embedding_model = models.CharField(max_length=200)
    embedding_dimensions = models.PositiveSmallIntegerField()
    # No fixed dimension: collections may use different models. Each dimension gets its
    # own partial HNSW index over ``embedding::halfvec(N)`` (see search/vector_indexes.py).
    embedding = VectorField()
    ts_config = RegConfigField()
    # The text's words as search.analysis read them, joined by spaces, where PostgreSQL cannot
    # split the text itself (Japanese, under search_japanese); None where it can.
    lexemes = models.TextField(null=True, blank=True)  # noqa: DJ001 (NULL: PostgreSQL splits the text)
    # Lexemes of the text (or of ``lexemes``), analysed by search_tsvector (search/text_normalization.py).
    tsv = models.GeneratedField(
        expression=Func(
            F("ts_config"),
            Coalesce(F("lexemes"), F("text")),
            function="search_tsvector",
            output_field=SearchVectorField(),
        ),
        output_field=SearchVectorField(),
        db_persist=True,
    )
    # Document-side BM25 weights (saturated term frequency, length-normalised), so that
    # keyword ranking is an inner product with the query's IDF vector.
    bm25 = SparseVectorField(dimensions=BM25_DIMENSIONS)
    # The document's readers, copied here so that rankings filter inside their index scans
    # (search.selectors) with no join; written with the document row locked.
    readers = readers_field()

    class Meta:
        ordering = ["document_id", "ordinal"]
        constraints = [
            models.UniqueConstraint(fields=["document", "embedding_model", "ordinal"], name="chunk_unique_ordinal"),
            models.CheckConstraint(condition=Q(end_offset__gt=F("start_offset")), name="chunk_offsets_ordered"),
        ]
        indexes = [
            GinIndex(fields=["tsv"], name="chunk_tsv_gin"),
            # A restricted reader's keyword ranking: the chunks holding a query word AND those it
            # may read, combined as bitmaps before any row is read (search.selectors).
            GinIndex(fields=["readers"], name="chunk_readers_gin"),
            models.Index(fields=["collection", "embedding_dimensions"], name="chunk_collection_dims"),
        ]

    def __str__(self) -> str:
        return f"{self.document_id}#{self.ordinal}"


class TermStat(models.Model):
    """Document frequency of a hashed lexeme among a collection's chunks (BM25's IDF)."""

    collection = models.ForeignKey(Collection, on_delete=models.CASCADE, related_name="+")
    term = models.IntegerField()
    df = models.PositiveIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["collection", "term"], name="termstat_unique_term")]

    def __str__(self) -> str:
        return f"term {self.term} in {self.collection_id}: df {self.df}"


class Conversation(models.Model):
    """A thread of questions: each answer is one turn of exactly one conversation, and a
    follow-up is read with the turns before it (search/answering/conversations.py, docs/search.md).

    Owned by who started it (``client_id``: ``user:<id>`` or ``key:<id>``, as on an answer), and
    read only by them: a conversation is someone's line of thought, not the workspace's."""

    workspace_path = "workspace"  # search.scoping: how a front door finds its rows

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="conversations")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="conversations"
    )
    client_id = models.CharField(max_length=100, blank=True)
    # From its first question until renamed.
    title = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    # The latest turn's time: conversations are listed by it.
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-updated_at"]
        indexes = [models.Index(fields=["workspace", "client_id", "-updated_at"], name="conversation_owner_recent")]

    def __str__(self) -> str:
        return self.title


class Answer(models.Model):
    """A question answered from retrieved chunks, with numbered citations.

    Its ``id`` is also the generation's request id: the token stream is ``gen:<id>`` and the
    ledger row carries the same id.
    """

    workspace_path = "workspace"  # search.scoping: how a front door finds its rows

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        GENERATING = "generating", "Generating"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    class Mode(models.TextChoices):
        GENERATED = "generated", "Generated"
        EXTRACTIVE = "extractive", "Extractive (the sources' own sentences)"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="answers")
    asker = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="answers"
    )
    # Whose arm a canary release gives (a user's or an API key's id): sticky per client.
    client_id = models.CharField(max_length=100, blank=True)
    question = models.TextField()
    # The turn this answer is (its conversation's earlier answers are the turns before it).
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="answers")
    # What retrieval searched for: the question itself, or for a follow-up the standalone
    # question it was read as (``stats["followup"]`` says how).
    retrieval_query = models.TextField(blank=True)
    collections = models.ManyToManyField(Collection, related_name="answers")
    # [{number, chunk_id, document_id, score}]: the numbered sources the prompt gave.
    sources = models.JSONField(default=list, blank=True)
    route = models.ForeignKey("inference.Route", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    release = models.ForeignKey(
        "inference.CanaryRelease", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    arm = models.CharField(max_length=8, blank=True)
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.GENERATED)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    error = models.TextField(blank=True)
    text = models.TextField(blank=True)
    # [{number, chunk_id, document_id, title, start_offset, end_offset}] for each [n] used.
    citations = models.JSONField(default=list, blank=True)
    dropped_citations = models.PositiveIntegerField(
        default=0, help_text="Citations of a source number the prompt did not give."
    )
    # The sources did not answer the question (retrieval below the calibrated threshold, or
    # nothing in the generated text supported by a source): the text says so in one sentence
    # and ``stats["closest"]`` lists the nearest passages (search/answering/abstention.py).
    abstained = models.BooleanField(default=False)
    # The share of the answer's sentences that a cited source supports (search/answering/verification.py);
    # None when nothing was checked (a failed answer, an abstention).
    grounded = models.FloatField(null=True, blank=True)
    # Per sentence: {start, end, citations, support, supported, action}, and the counts of
    # markers removed, sentences re-attributed, citations added (search/answering/verification.py).
    verification = models.JSONField(default=dict, blank=True)
    stats = models.JSONField(default=dict, blank=True)
    # request_ms (the request's arrival to created_at, when a web request asked), then from
    # created_at: retrieve_ms, prompt_ms, submit_ms, queue_ms, ttft_ms, total_ms.
    timings = models.JSONField(default=dict, blank=True)
    # When it was asked: set as the instance is built (answer_create stores it later, once).
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["workspace", "-created_at"], name="answer_workspace_recent"),
            models.Index(fields=["conversation", "created_at"], name="answer_conversation_turns"),
        ]

    def __str__(self) -> str:
        return self.question[:80]

    def save(self, *args, **kwargs):
        # Every answer is a turn: one stored without a conversation (the shell, a fixture)
        # starts its own, as the migration gave each answer asked before conversations.
        if self.conversation_id is None and self._state.adding:
            self.conversation = Conversation.objects.create(
                id=self.id,
                workspace_id=self.workspace_id,
                owner_id=self.asker_id,
                client_id=self.client_id or (f"user:{self.asker_id}" if self.asker_id else ""),
                title=" ".join(self.question.split())[:200],
                created_at=self.created_at,
                updated_at=self.created_at,
            )
        super().save(*args, **kwargs)
