"""What the API accepts and returns; each serializer is also its OpenAPI schema.

Input serializers bound every number and string (ids to PostgreSQL's bigint, text to what
the models hold, NUL characters refused by DRF), so that a request the schema allows never
reaches the database as something it would refuse. Output serializers read model
instances, the JSON the answers store (sources, citations) and plain dicts.
"""

from __future__ import annotations

import json

from django.core.validators import RegexValidator
from django.db import connection
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.reverse import reverse

from search import analysis
from search.access import AccessError, readers_for, readers_listed
from search.answering.answers import QUESTION_MAX_CHARS, TOP_K_MAX
from search.answering.conversations import TITLE_MAX_CHARS
from search.embedders import DEFAULT_EMBEDDER, EmbedderError, embedder_get
from search.models import Answer, Collection, Conversation, Document
from search.query_syntax import SYNTAXES
from search.selectors import MODES

# Ids are PostgreSQL bigints.
MAX_ID = 2**63 - 1
# Users and groups named as one document's readers, at most (each list).
READERS_MAX = 1000


class TextPattern(RegexValidator):
    """A pattern the schema states (drf-spectacular shows a ``RegexValidator``'s) and this
    validator checks, except in text holding NUL characters: DRF's ``CharField`` refuses
    those itself ("Null characters are not allowed": PostgreSQL text cannot hold them)."""

    def __call__(self, value):
        if "\x00" not in str(value):
            super().__call__(value)


# Text without NUL characters: what DRF accepts, said in the schema.
_NO_NUL = TextPattern(r"^[^\x00]*$")
# Something besides whitespace: a value that is blank once trimmed is refused by the schema too.
_NOT_BLANK = TextPattern(r"^[^\x00]*[^\x00\s][^\x00]*$", "This field may not be blank.")
SEARCH_TOP_K_MAX = 50
FILES_PER_UPLOAD_MAX = 20
COLLECTIONS_PER_REQUEST_MAX = 100
WAIT_MAX_SECONDS = 60


def _id_list(**kwargs) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=MAX_ID),
        allow_empty=False,
        min_length=1,  # the same as allow_empty=False, and what the schema says (minItems)
        max_length=COLLECTIONS_PER_REQUEST_MAX,
        **kwargs,
    )


def absolute_url(request, name: str, **kwargs) -> str:
    return reverse(f"api:{name}", kwargs=kwargs, request=request)


# --------------------------------------------------------------------------- errors


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Stable, for programs: e.g. invalid_request, rate_limited, not_found.")
    message = serializers.CharField(help_text="For people: what went wrong and what to do.")
    field = serializers.CharField(required=False, help_text="The request field or parameter at fault, if one is.")


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


# --------------------------------------------------------------------------- collections


class CollectionSerializer(serializers.ModelSerializer):
    document_count = serializers.IntegerField(read_only=True)
    url = serializers.SerializerMethodField()

    class Meta:
        model = Collection
        fields = [
            "id",
            "name",
            "description",
            "embedding_model",
            "embedding_dimensions",
            "text_search_config",
            "language",
            "document_count",
            "chunk_count",
            "created_at",
            "url",
        ]
        read_only_fields = fields

    def get_url(self, collection: Collection) -> str:
        return absolute_url(self.context["request"], "collection-detail", collection_id=collection.pk)


class CollectionCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200, validators=[_NOT_BLANK])
    description = serializers.CharField(
        max_length=10_000, required=False, allow_blank=True, default="", validators=[_NO_NUL]
    )
    embedding_model = serializers.CharField(
        max_length=200,
        required=False,
        validators=[_NO_NUL],
        default=DEFAULT_EMBEDDER,
        help_text=f"{DEFAULT_EMBEDDER} (built in) or openai:<model> (needs EMBEDDING_API_BASE_URL).",
    )
    text_search_config = serializers.CharField(
        max_length=63,
        required=False,
        validators=[_NO_NUL],
        default="search_english",
        help_text=(
            "PostgreSQL text-search configuration: search_english (the default: English as BM25 references"
            " analyse it: Lucene's 33 stop words, Snowball stemmer), or any other, e.g. english, german, simple."
        ),
    )

    language = serializers.ChoiceField(
        choices=analysis.LANGUAGES,
        required=False,
        default=analysis.AUTO,
        help_text=(
            "The language its documents and queries are analysed in: auto (the default: each chunk and query its"
            " own, Japanese or the text_search_config's), ja or en. A collection whose first document is Japanese"
            " is embedded by a multilingual model unless embedding_model is given."
        ),
    )

    def validate_embedding_model(self, value: str) -> str:
        try:
            embedder_get(value)
        except EmbedderError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value

    def validate_text_search_config(self, value: str) -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_ts_config WHERE cfgname = %s", [value])
            if cursor.fetchone() is None:
                raise serializers.ValidationError(f"PostgreSQL has no text-search configuration {value!r}.")
        return value


# --------------------------------------------------------------------------- documents


class DocumentProgressSerializer(serializers.Serializer):
    chunks_embedded = serializers.IntegerField(read_only=True)
    chunks_total = serializers.IntegerField(read_only=True, help_text="0 until the document is chunked.")


@extend_schema_field({"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string"}], "example": "hr"})
class IdOrName(serializers.JSONField):
    """A user or group, by id or by name (checked by ``search.access.readers_for``)."""


class ReadersSerializer(serializers.Serializer):
    """Who may read a document (search.access). Neither users nor groups: everyone in the
    workspace."""

    users = serializers.ListField(
        child=IdOrName(), required=False, default=list, max_length=READERS_MAX,
        help_text="Users, each by id or username.",
    )  # fmt: skip
    groups = serializers.ListField(
        child=IdOrName(), required=False, default=list, max_length=READERS_MAX,
        help_text="Groups, each by id or name.",
    )  # fmt: skip

    def validate(self, data):
        try:
            # Named within the caller's workspace only: another tenant's names are not confirmed.
            workspace = self.context["workspace"]
            data["principals"] = readers_for(users=data["users"], groups=data["groups"], workspace=workspace)
        except AccessError as exc:
            raise serializers.ValidationError({"readers": [exc.message]}) from None
        return data


class ReadersListedSerializer(serializers.Serializer):
    everyone = serializers.BooleanField(help_text="Open to everyone in the workspace.")
    users = serializers.ListField(child=serializers.IntegerField(), help_text="The users' ids.")
    groups = serializers.ListField(child=serializers.IntegerField(), help_text="The groups' ids.")


class DocumentSerializer(serializers.ModelSerializer):
    collection = serializers.IntegerField(source="collection_id", read_only=True)
    readers = serializers.SerializerMethodField()
    progress = DocumentProgressSerializer(source="*", read_only=True)
    error = serializers.CharField(read_only=True, help_text="Why ingestion failed; empty unless status is failed.")
    metadata = serializers.DictField(read_only=True)
    url = serializers.SerializerMethodField()

    class Meta:
        model = Document
        fields = [
            "id",
            "collection",
            "title",
            "source_name",
            "media_type",
            "size_bytes",
            "status",
            "progress",
            "error",
            "attempts",
            "metadata",
            "created_at",
            "updated_at",
            "indexed_at",
            "readers",
            "url",
        ]
        read_only_fields = fields

    @extend_schema_field(ReadersListedSerializer)
    def get_readers(self, document: Document) -> dict:
        return readers_listed(document.readers)

    def get_url(self, document: Document) -> str:
        return absolute_url(self.context["request"], "document-detail", document_id=document.pk)


class UploadedDocumentSerializer(DocumentSerializer):
    created = serializers.BooleanField(
        read_only=True, help_text="False: the same bytes were already in the collection; this is that document."
    )

    class Meta(DocumentSerializer.Meta):
        fields = [*DocumentSerializer.Meta.fields, "created"]
        read_only_fields = fields


class UploadResultSerializer(serializers.Serializer):
    documents = UploadedDocumentSerializer(many=True, read_only=True)


@extend_schema_field({"type": "string", "example": '{"team": "support"}'})
class JSONObjectText(serializers.JSONField):
    """A JSON object sent as a text part of a multipart form."""


@extend_schema_field({"type": "string", "example": '{"users": [], "groups": []}'})
class ReadersText(serializers.JSONField):
    """A document's readers sent as a text part of a multipart form."""


class DocumentUploadSerializer(serializers.Serializer):
    collection = serializers.IntegerField(min_value=1, max_value=MAX_ID, help_text="The collection's id.")
    files = serializers.ListField(
        # An empty file is refused by document_create, as document_rejected naming it (docs/api.md).
        child=serializers.FileField(allow_empty_file=True),
        min_length=1,
        max_length=FILES_PER_UPLOAD_MAX,
        help_text="One or more files (repeat the part): text, Markdown, HTML, PDF or DOCX.",
    )
    title = serializers.CharField(
        max_length=500,
        required=False,
        validators=[_NO_NUL],
        help_text="Only with one file; default: from the file name.",
    )
    metadata = JSONObjectText(
        binary=True, required=False, help_text="A JSON object, as text, stored with each document."
    )
    readers = ReadersText(
        binary=True,
        required=False,
        help_text='Who may read the documents, as text: {"users": [...], "groups": [...]}, each by id or name. '
        "Default: everyone in the workspace.",
    )

    def validate_readers(self, value):
        if not isinstance(value, dict) or set(value) - {"users", "groups"}:
            raise serializers.ValidationError('Must be a JSON object with "users" and/or "groups".')
        readers = ReadersSerializer(data=value, context=self.context)
        if not readers.is_valid():
            errors = readers.errors
            raise serializers.ValidationError(errors.get("readers") or errors)
        return readers.validated_data["principals"]

    def validate_metadata(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("Must be a JSON object.")
        if "\\u0000" in json.dumps(value):
            raise serializers.ValidationError("Must not contain NUL characters.")
        return value


class DocumentFilterSerializer(serializers.Serializer):
    collection = serializers.IntegerField(
        min_value=1, max_value=MAX_ID, required=False, help_text="Only this collection's documents."
    )
    status = serializers.ChoiceField(choices=Document.Status.choices, required=False)


# --------------------------------------------------------------------------- search


class SearchSerializer(serializers.Serializer):
    query = serializers.CharField(
        max_length=1000, validators=[_NOT_BLANK], help_text='Words, "phrases", -excluded (see `syntax`).'
    )
    syntax = serializers.ChoiceField(
        choices=SYNTAXES,
        default="auto",
        help_text=(
            'search: "phrases" must appear, -word and -"phrase" must not. question: no syntax, every word ranks.'
            " auto: a question when the query ends with a question mark or has 8 words or more, else search."
        ),
    )
    collections = _id_list(required=False, help_text="Collection ids; default: all of the workspace's.")
    mode = serializers.ChoiceField(choices=MODES, default="hybrid")
    top_k = serializers.IntegerField(min_value=1, max_value=SEARCH_TOP_K_MAX, default=10)
    per_document = serializers.BooleanField(default=False, help_text="At most one result (its best) per document.")


class SearchHitSerializer(serializers.Serializer):
    rank = serializers.IntegerField()
    score = serializers.FloatField()
    chunk_id = serializers.IntegerField()
    document_id = serializers.IntegerField()
    document_title = serializers.CharField()
    document_url = serializers.URLField(help_text="The source document in this API.")
    collection_id = serializers.IntegerField()
    ordinal = serializers.IntegerField(help_text="The chunk's position in its document.")
    text = serializers.CharField()
    start_offset = serializers.IntegerField(help_text="Where the chunk starts in the document's text.")
    end_offset = serializers.IntegerField()
    snippet_html = serializers.CharField(help_text="HTML-escaped text with the matched words in <mark>.")
    dense_rank = serializers.IntegerField(allow_null=True)
    keyword_rank = serializers.IntegerField(allow_null=True)


class SearchResponseSerializer(serializers.Serializer):
    query = serializers.CharField()
    mode = serializers.ChoiceField(choices=MODES)
    syntax = serializers.ChoiceField(
        choices=["search", "question"], help_text="What the query was read as (with syntax: auto, what auto chose)."
    )
    keyword_path = serializers.ChoiceField(
        choices=["exact", "index"], allow_null=True, help_text="How keyword candidates were found; null without."
    )
    took_ms = serializers.FloatField()
    results = SearchHitSerializer(many=True)


# --------------------------------------------------------------------------- answers


class AnswerCreateSerializer(serializers.Serializer):
    question = serializers.CharField(max_length=QUESTION_MAX_CHARS, validators=[_NOT_BLANK])
    collections = _id_list(required=False, help_text="Collection ids; default: all of the workspace's.")
    route = serializers.CharField(
        max_length=100,
        required=False,
        validators=[_NO_NUL],
        help_text="A generation route by name; default: the default route.",
    )
    top_k = serializers.IntegerField(min_value=1, max_value=TOP_K_MAX, default=8, help_text="Passages retrieved.")
    max_tokens = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    temperature = serializers.FloatField(min_value=0, max_value=2, required=False)
    conversation = serializers.UUIDField(
        required=False,
        help_text=(
            "A conversation of yours that the question continues: it is read as a follow-up of the earlier "
            "turns. Default: the first question of a new conversation."
        ),
    )


class SourceSerializer(serializers.Serializer):
    number = serializers.IntegerField(help_text="The [n] the answer cites it by.")
    chunk_id = serializers.IntegerField()
    document_id = serializers.IntegerField()
    title = serializers.CharField(allow_blank=True)
    start_offset = serializers.IntegerField()
    end_offset = serializers.IntegerField()
    document_url = serializers.SerializerMethodField()

    def get_document_url(self, record: dict) -> str:
        return absolute_url(self.context["request"], "document-detail", document_id=record["document_id"])


class RetrievedSourceSerializer(SourceSerializer):
    score = serializers.FloatField()


class AnswerSerializer(serializers.ModelSerializer):
    collections = serializers.PrimaryKeyRelatedField(many=True, read_only=True)
    route = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    sources = RetrievedSourceSerializer(many=True, read_only=True, help_text="The numbered passages given.")
    citations = SourceSerializer(many=True, read_only=True, help_text="The sources the text cites, by [n].")
    stats = serializers.SerializerMethodField()
    timings = serializers.SerializerMethodField()
    sentences = serializers.SerializerMethodField()
    verification = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()
    stream_url = serializers.SerializerMethodField()
    withheld = serializers.SerializerMethodField()

    class Meta:
        model = Answer
        fields = [
            "id",
            "conversation",
            "status",
            "mode",
            "question",
            "retrieval_query",
            "text",
            "withheld",
            "error",
            "citations",
            "dropped_citations",
            "abstained",
            "grounded",
            "sentences",
            "verification",
            "sources",
            "collections",
            "route",
            "arm",
            "stats",
            "timings",
            "created_at",
            "finished_at",
            "url",
            "stream_url",
        ]
        read_only_fields = fields

    @extend_schema_field({"type": "object", "additionalProperties": True})
    def get_stats(self, answer: Answer) -> dict:
        """Tokens, speed, the context packed, the route that served; extractive: the sentences' scores."""
        return answer.stats

    @extend_schema_field({"type": "object", "additionalProperties": {"type": "number"}})
    def get_timings(self, answer: Answer) -> dict:
        return answer.timings

    @extend_schema_field(
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "start": {"type": "integer"},
                    "end": {"type": "integer"},
                    "citations": {"type": "array", "items": {"type": "integer"}},
                    "support": {"type": "number"},
                    "supported": {"type": "boolean"},
                    "action": {"type": "string"},
                },
            },
        }
    )
    def get_sentences(self, answer: Answer) -> list[dict]:
        """Each sentence of ``text`` (its span), the sources it cites, how well the best of them
        supports it, and what the check did (kept, reattributed, added, unsupported, ...)."""
        return (answer.verification or {}).get("sentences", [])

    @extend_schema_field({"type": "object", "additionalProperties": True})
    def get_verification(self, answer: Answer) -> dict:
        """What the citation check changed: markers removed, sentences re-attributed, citations
        added, sentences unsupported, and the text as generated (``original_text``)."""
        return {key: value for key, value in (answer.verification or {}).items() if key != "sentences"}

    def get_withheld(self, answer: Answer) -> bool:
        """True: it cites documents the caller may not read, so its text, sources and checks are left out."""
        return getattr(answer, "withheld", False)

    def get_url(self, answer: Answer) -> str:
        return absolute_url(self.context["request"], "answer-detail", answer_id=answer.pk)

    def get_stream_url(self, answer: Answer) -> str:
        return absolute_url(self.context["request"], "answer-stream", answer_id=answer.pk)


# --------------------------------------------------------------------------- conversations


class ConversationCreateSerializer(serializers.Serializer):
    title = serializers.CharField(
        max_length=TITLE_MAX_CHARS,
        required=False,
        validators=[_NOT_BLANK],
        help_text="Default: the first question, once asked.",
    )


class ConversationRenameSerializer(serializers.Serializer):
    title = serializers.CharField(max_length=TITLE_MAX_CHARS, validators=[_NOT_BLANK])


class ConversationSerializer(serializers.ModelSerializer):
    turns = serializers.IntegerField(source="turn_count", read_only=True, help_text="Questions asked in it.")
    url = serializers.SerializerMethodField()

    class Meta:
        model = Conversation
        fields = ["id", "title", "turns", "created_at", "updated_at", "url"]
        read_only_fields = fields

    def get_url(self, conversation: Conversation) -> str:
        return absolute_url(self.context["request"], "conversation-detail", conversation_id=conversation.pk)


class ConversationDetailSerializer(ConversationSerializer):
    answers = AnswerSerializer(many=True, read_only=True, source="turn_list", help_text="Its turns, oldest first.")

    class Meta(ConversationSerializer.Meta):
        fields = [*ConversationSerializer.Meta.fields, "answers"]
        read_only_fields = fields


# --------------------------------------------------------------------------- usage


def _usd(**kwargs) -> serializers.DecimalField:
    return serializers.DecimalField(max_digits=30, decimal_places=12, coerce_to_string=True, **kwargs)


class UsageTotalsSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    errors = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    cost_usd = _usd(help_text="Exact, of the priced requests only.")
    unpriced_requests = serializers.IntegerField(help_text="Requests of a model without a price: not in cost_usd.")


class UsageModelSerializer(UsageTotalsSerializer):
    model = serializers.CharField(allow_blank=True)
    provider = serializers.CharField(allow_blank=True)


class UsageKeySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    masked = serializers.CharField(help_text="rk_<prefix>_…<last four>")
    requests_per_minute = serializers.IntegerField(allow_null=True)
    tokens_per_minute = serializers.IntegerField(allow_null=True)
    monthly_budget_usd = serializers.DecimalField(max_digits=14, decimal_places=2, allow_null=True)


class UsageSerializer(UsageTotalsSerializer):
    month = serializers.CharField(help_text="YYYY-MM, UTC.")
    client_key = UsageKeySerializer(allow_null=True, help_text="The calling key; null for a session.")
    models = UsageModelSerializer(many=True)
