"""The REST API's DRF views: thin, each calls one service or selector of the search app.

Every view derives from ``ApiView``, which fixes how a request is authenticated (a client
key or a member's session), authorised (``scopes``: the key scope each method needs),
throttled, paginated, parsed and rendered, and how its errors look; so a view's own code is
the workspace-filtered query and the call. Objects are looked up inside the caller's
workspace only, so another workspace's ids answer 404 exactly as ids that do not exist.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, date, datetime

from django.db.models import Count, Q, QuerySet
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import NotFound
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import JSONParser, MultiPartParser
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from billing.selectors import usage_month_by_model
from frontdoors.api import serializers as api
from frontdoors.api.auth import ClientKeyAuthentication, Scope, WorkspaceAccess
from frontdoors.api.errors import RestApiError, api_exception_handler, error_json, invalid
from frontdoors.api.pagination import ApiPagination, query_integer
from frontdoors.api.schema import error_responses
from frontdoors.api.throttling import ApiRateThrottle
from frontdoors.files import document_file_response
from ragsite.audit import Action, audit_record
from search.answering.answers import answer_create, answer_stream_read, answers_readable
from search.answering.conversations import (
    conversation_create,
    conversation_delete,
    conversation_of,
    conversation_rename,
    conversation_turns,
    conversations_owned,
)
from search.models import Answer, Collection, Document
from search.scoping import collections_chosen, in_workspaces
from search.selectors import SearchError, chunk_search
from search.services import (
    collection_create,
    document_delete,
    document_readers_set,
    document_retry,
    documents_upload,
)

FINISHED = (Answer.Status.DONE, Answer.Status.FAILED)


class ApiView(GenericAPIView):
    """The API's policies; ``scopes`` maps an HTTP method to the key scope it needs (None: any key)."""

    authentication_classes = [ClientKeyAuthentication, SessionAuthentication]
    permission_classes = [WorkspaceAccess]
    throttle_classes = [ApiRateThrottle]
    renderer_classes = [JSONRenderer]
    parser_classes = [JSONParser]
    pagination_class = ApiPagination
    # No OPTIONS: the OpenAPI schema describes the API (DRF's OPTIONS would describe it again).
    http_method_names = ["get", "post", "delete", "head"]
    scopes: dict[str, str | None] = {}

    def scope_for(self, method: str) -> str | None:
        return self.scopes.get("GET" if method == "HEAD" else method)

    def initial(self, request, *args, **kwargs):
        # A method the endpoint does not have is a 405 for anyone, before authentication
        # (DRF would authenticate first): the schema says which methods exist anyway.
        method = request.method.lower()
        if method not in self.http_method_names or not hasattr(self, method):
            self.http_method_not_allowed(request)
        super().initial(request, *args, **kwargs)

    def get_exception_handler(self):
        return api_exception_handler

    @property
    def workspace(self):
        return self.request.access.workspace

    def scoped(self, model):
        """``model``'s rows in the caller's workspace: every tenant read of these views (search.scoping)."""
        return in_workspaces(model, self.workspace, self.reader)

    @property
    def reader(self):
        """What the caller may read (search.access)."""
        return self.request.access.reader

    def audit(self, action: str, **event) -> None:
        """An event of this request in the audit log (ragsite.audit): by its key or user."""
        access = self.request.access
        audit_record(
            action, key=access.key, user=access.user, request=self.request, workspace_id=self.workspace.pk, **event
        )

    def audited_document(self, action: str, document_id: int, *, audit_found: bool = True) -> Document:
        """The caller's document ``document_id`` (404 if it may not read it), with ``action``
        in the audit log: done, or refused as not found."""
        try:
            document = _document(self.workspace, self.reader, document_id)
        except NotFound:
            self.audit(action, target=f"document:{document_id}", outcome="not_found")
            raise
        if audit_found:
            self.audit(action, target=f"document:{document.pk}", detail={"title": document.title})
        return document


def query_data(request, *lists: str) -> dict:
    """The query parameters as plain data for a serializer: one value each, all values of
    the ``lists``. Not the QueryDict itself, on which DRF reads an empty value as an
    omitted one (HTML forms' way): here ``?status=`` is a bad status, as the schema says."""
    data = request.query_params.dict()
    for name in lists:
        if name in request.query_params:
            data[name] = request.query_params.getlist(name)
    return data


def _not_found(kind: str, object_id) -> NotFound:
    return NotFound(f"No {kind} {object_id} in this workspace.", code="not_found")


def _collections(workspace, reader):
    """The workspace's collections, each with the count of the documents ``reader`` may read:
    a count of all of them would tell a restricted document's existence."""
    readable = Q() if reader.unrestricted else Q(documents__readers__overlap=list(reader.principals))
    return in_workspaces(Collection, workspace).annotate(document_count=Count("documents", filter=readable))


# --------------------------------------------------------------------------- collections


class CollectionListView(ApiView):
    scopes = {"GET": Scope.SEARCH, "POST": Scope.DOCUMENTS}
    serializer_class = api.CollectionSerializer

    def get_queryset(self):
        return _collections(self.workspace, self.reader).order_by("name", "id")

    @extend_schema(
        operation_id="collections_list",
        summary="The workspace's collections",
        description="Scope: search.",
        responses={200: api.CollectionSerializer(many=True), **error_responses()},
    )
    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(
        operation_id="collections_create",
        summary="Create a collection",
        description="Scope: documents. A name already used in the workspace is a 409.",
        request=api.CollectionCreateSerializer,
        responses={201: api.CollectionSerializer, **error_responses(409, 415)},
    )
    def post(self, request):
        serializer = api.CollectionCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        name = serializer.validated_data["name"]
        if self.scoped(Collection).filter(name=name).exists():
            raise RestApiError(
                status.HTTP_409_CONFLICT, "conflict", f"The workspace has a collection named {name!r}.", field="name"
            )
        collection = collection_create(workspace=self.workspace, **serializer.validated_data)
        collection = self.get_queryset().get(pk=collection.pk)
        return Response(self.get_serializer(collection).data, status=status.HTTP_201_CREATED)


class CollectionDetailView(ApiView):
    scopes = {"GET": Scope.SEARCH}
    serializer_class = api.CollectionSerializer

    @extend_schema(
        operation_id="collections_get",
        summary="One collection",
        description="Scope: search.",
        responses={200: api.CollectionSerializer, **error_responses()},
    )
    def get(self, request, collection_id: int):
        collection = _collections(self.workspace, self.reader).filter(pk=collection_id).first()
        if collection is None:
            raise _not_found("collection", collection_id)
        return Response(self.get_serializer(collection).data)


# --------------------------------------------------------------------------- documents


class DocumentListView(ApiView):
    scopes = {"GET": Scope.DOCUMENTS, "POST": Scope.DOCUMENTS}
    serializer_class = api.DocumentSerializer
    parser_classes = [MultiPartParser]

    def get_queryset(self):
        return self.scoped(Document)

    @extend_schema(
        operation_id="documents_list",
        summary="The workspace's documents, newest first",
        description="Scope: documents. Filter by collection and status.",
        parameters=[api.DocumentFilterSerializer],
        responses={200: api.DocumentSerializer(many=True), **error_responses()},
    )
    def get(self, request):
        filters = api.DocumentFilterSerializer(data=query_data(request))
        filters.is_valid(raise_exception=True)
        documents = self.get_queryset().order_by("-created_at", "-id")
        if "collection" in filters.validated_data:
            (collection,) = collections_chosen(
                self.workspace, [filters.validated_data["collection"]], field="collection"
            )
            documents = documents.filter(collection=collection)
        if "status" in filters.validated_data:
            documents = documents.filter(status=filters.validated_data["status"])
        page = self.paginate_queryset(documents)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(
        operation_id="documents_upload",
        summary="Upload one or several files into a collection",
        description=(
            "Scope: documents. `multipart/form-data` with `collection` and one `files` part per file. "
            "Each file becomes a queued document, ingested in the background: follow `status` and "
            "`progress` on the document. All or nothing: a refused file (empty, too large, of an "
            "unsupported type) stores none. The same bytes already in the collection return that "
            "document (`created: false`). 201 when at least one document is new, else 200."
        ),
        request={"multipart/form-data": api.DocumentUploadSerializer},
        responses={
            201: api.UploadResultSerializer,
            200: OpenApiResponse(api.UploadResultSerializer, description="Every file was already there."),
            **error_responses(413, 415),
        },
    )
    def post(self, request):
        upload = api.DocumentUploadSerializer(data=request.data, context={"workspace": self.workspace})
        upload.is_valid(raise_exception=True)
        data = upload.validated_data
        (collection,) = collections_chosen(self.workspace, [data["collection"]], field="collection")
        results = []
        for document, created in documents_upload(
            collection=collection,
            files=data["files"],
            title=data.get("title"),
            metadata=data.get("metadata"),
            readers=data.get("readers"),
            uploader=self.reader,
        ):
            document.created = created
            results.append(document)
        body = api.UploadResultSerializer({"documents": results}, context=self.get_serializer_context()).data
        any_created = any(document.created for document in results)
        return Response(body, status=status.HTTP_201_CREATED if any_created else status.HTTP_200_OK)


def _document(workspace, reader, document_id: int) -> Document:
    document = in_workspaces(Document, workspace, reader).filter(pk=document_id).first()
    if document is None:
        raise _not_found("document", document_id)
    return document


class DocumentDetailView(ApiView):
    scopes = {"GET": Scope.DOCUMENTS, "DELETE": Scope.DOCUMENTS}
    serializer_class = api.DocumentSerializer

    @extend_schema(
        operation_id="documents_get",
        summary="One document: its ingestion status and progress",
        description="Scope: documents.",
        responses={200: api.DocumentSerializer, **error_responses()},
    )
    def get(self, request, document_id: int):
        document = self.audited_document(Action.DOCUMENT_OPEN, document_id)
        return Response(self.get_serializer(document).data)

    @extend_schema(
        operation_id="documents_delete",
        summary="Delete a document, its chunks and its file",
        description="Scope: documents.",
        responses={204: OpenApiResponse(description="Deleted."), **error_responses()},
    )
    def delete(self, request, document_id: int):
        document_delete(document=_document(self.workspace, self.reader, document_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


class DocumentReadersView(ApiView):
    scopes = {"POST": Scope.DOCUMENTS}
    serializer_class = api.DocumentSerializer
    parser_classes = [JSONParser]

    @extend_schema(
        operation_id="documents_readers_set",
        summary="Set who may read a document",
        description=(
            "Scope: documents. Users and groups, each by id or name; neither: everyone in the workspace. "
            "The next search, answer and listing obey it; nothing is re-embedded. A user or group that does "
            "not exist is refused (400), naming it."
        ),
        request=api.ReadersSerializer,
        responses={200: api.DocumentSerializer, **error_responses()},
    )
    def post(self, request, document_id: int):
        readers = api.ReadersSerializer(data=request.data, context={"workspace": self.workspace})
        readers.is_valid(raise_exception=True)
        document = self.audited_document(Action.READERS_CHANGE, document_id, audit_found=False)
        before = list(document.readers)
        document = document_readers_set(document=document, readers=readers.validated_data["principals"])
        self.audit(
            Action.READERS_CHANGE,
            target=f"document:{document.pk}",
            detail={"title": document.title, "before": before, "after": list(document.readers)},
        )
        return Response(self.get_serializer(document).data)


class DocumentFileView(ApiView):
    scopes = {"GET": Scope.DOCUMENTS}

    def perform_content_negotiation(self, request, force=False):
        # The file is not rendered (a FileResponse passes DRF's renderers by); an error is JSON
        # whatever the client accepts, as for the other endpoints, rather than a 406.
        return super().perform_content_negotiation(request, force=True)

    @extend_schema(
        operation_id="documents_file",
        summary="Download a document's original file",
        description=(
            "Scope: documents. The bytes as they were uploaded, as `application/octet-stream`, an attachment "
            'named after the upload\'s `source_name`: `Content-Disposition: attachment; filename="..."` for an '
            "ASCII name, `filename*=utf-8''...` (percent-encoded UTF-8, RFC 6266 and 5987) for any other."
        ),
        parameters=[
            OpenApiParameter(
                "Content-Disposition",
                str,
                OpenApiParameter.HEADER,
                response=[200],
                description="`attachment` with the upload's file name.",
            )
        ],
        responses={
            (200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY, description="The file."),
            **error_responses(),
        },
    )
    def get(self, request, document_id: int):
        document = self.audited_document(Action.DOCUMENT_DOWNLOAD, document_id)
        try:
            return document_file_response(request._request, document)
        except FileNotFoundError:
            raise RestApiError(
                status.HTTP_404_NOT_FOUND, "not_found", f"The file of document {document_id} is missing from storage."
            ) from None


class DocumentRetryView(ApiView):
    scopes = {"POST": Scope.DOCUMENTS}
    serializer_class = api.DocumentSerializer

    @extend_schema(
        operation_id="documents_retry",
        summary="Queue a failed document for another attempt",
        description="Scope: documents. Only a `failed` document can be retried (else 409).",
        request=None,
        responses={202: api.DocumentSerializer, **error_responses(409)},
    )
    def post(self, request, document_id: int):
        document = _document(self.workspace, self.reader, document_id)
        if document.status != Document.Status.FAILED:
            raise RestApiError(
                status.HTTP_409_CONFLICT,
                "not_failed",
                f"Only a failed document can be retried; this one is {document.status}.",
            )
        return Response(self.get_serializer(document_retry(document=document)).data, status=status.HTTP_202_ACCEPTED)


# --------------------------------------------------------------------------- search


class SearchView(ApiView):
    scopes = {"GET": Scope.SEARCH, "POST": Scope.SEARCH}
    pagination_class = None

    def _search(self, data) -> Response:
        serializer = api.SearchSerializer(data=data)
        serializer.is_valid(raise_exception=True)
        params = serializer.validated_data
        collection_ids = params.get("collections")
        try:
            result = chunk_search(
                query=params["query"],
                workspace=self.workspace,
                collection_ids=collection_ids,
                mode=params["mode"],
                top_k=params["top_k"],
                per_document=params["per_document"],
                syntax=params["syntax"],
                reader=self.reader,
            )
        except SearchError as exc:  # what is left once the parameters are valid: collections that cannot mix
            self.audit(Action.SEARCH, outcome="refused", detail={"query": params["query"], "reason": str(exc)})
            raise invalid("collections", str(exc)) from None
        self.audit(Action.SEARCH, detail={"query": params["query"], "mode": params["mode"]})
        request = self.request
        body = {
            "query": result.query,
            "mode": result.mode,
            "syntax": result.syntax,
            "keyword_path": result.keyword_path,
            "took_ms": round(result.timings_ms.get("total", 0.0), 2),
            "results": [
                {
                    **{name: getattr(hit, name) for name in _HIT_FIELDS},
                    "rank": rank,
                    "document_url": api.absolute_url(request, "document-detail", document_id=hit.document_id),
                }
                for rank, hit in enumerate(result.hits, start=1)
            ],
        }
        return Response(api.SearchResponseSerializer(body).data)

    @extend_schema(
        operation_id="search_get",
        summary="Search passages (query parameters)",
        description="Scope: search. Repeat `collections` for several. The same as POST.",
        parameters=[api.SearchSerializer],
        responses={200: api.SearchResponseSerializer, **error_responses()},
    )
    def get(self, request):
        return self._search(query_data(request, "collections"))

    @extend_schema(
        operation_id="search_post",
        summary="Search passages",
        description=(
            "Scope: search. Hybrid (dense + BM25, fused by reciprocal rank), dense or keyword; best first, "
            "each with a highlighted snippet and a link to its document."
        ),
        request=api.SearchSerializer,
        responses={200: api.SearchResponseSerializer, **error_responses(415)},
    )
    def post(self, request):
        return self._search(request.data)


_HIT_FIELDS = (
    "score",
    "chunk_id",
    "document_id",
    "document_title",
    "collection_id",
    "ordinal",
    "text",
    "start_offset",
    "end_offset",
    "snippet_html",
    "dense_rank",
    "keyword_rank",
)


# --------------------------------------------------------------------------- answers


def answer_wait(answer: Answer, seconds: float) -> Answer:
    """The answer once finished, or as it is after ``seconds``. Follows its event stream
    (blocking reads, no polling) to the end, then the row until ``answer_finalize`` has
    stored it, which comes a moment after the stream's last event."""
    deadline = time.monotonic() + seconds
    last = "0"
    ended = answer.status in FINISHED
    while not ended and time.monotonic() < deadline:
        # Short blocking reads, so that the deadline is kept while nothing is written.
        block_ms = max(1, min(1000, int((deadline - time.monotonic()) * 1000)))
        try:
            for event_id, _, _ in answer_stream_read(answer, after=last, block_ms=block_ms):
                last = event_id
                if time.monotonic() >= deadline:
                    break
            else:
                ended = True
        except TimeoutError:
            pass
    while True:
        answer.refresh_from_db()
        if answer.status in FINISHED or time.monotonic() >= deadline:
            return answer
        time.sleep(0.05)


class AnswerCreateView(ApiView):
    scopes = {"POST": Scope.GENERATE}
    serializer_class = api.AnswerSerializer

    def get_throttles(self):
        return []  # billing.limits meters generations per key, inside answer_create

    @extend_schema(
        operation_id="answers_create",
        summary="Ask a question",
        description=(
            "Scope: generate. Retrieves passages from the collections and answers from them with [n] "
            "citations. 202: the answer is accepted; follow `stream_url` (Server-Sent Events) or read "
            "`url`. With `?wait=SECONDS` (0 to 60) the request waits for the answer: 200 when it finished "
            "in time, else 202 with its state then. Without any generation route the answer is "
            "extractive and done at once. Metered by the key's limits: 429 (requests or tokens per "
            "minute, `Retry-After`), 402 (monthly budget)."
        ),
        parameters=[
            OpenApiParameter(
                "wait",
                {"type": "integer", "minimum": 0, "maximum": api.WAIT_MAX_SECONDS},
                description="Seconds to wait for the answer to finish.",
            )
        ],
        request=api.AnswerCreateSerializer,
        responses={
            202: api.AnswerSerializer,
            200: OpenApiResponse(api.AnswerSerializer, description="Finished within `wait`."),
            **error_responses(402, 415, 503),
        },
    )
    def post(self, request):
        wait = query_integer(request, "wait", None, 0, api.WAIT_MAX_SECONDS)
        serializer = api.AnswerCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        params = serializer.validated_data
        access = request.access
        conversation = None
        if "conversation" in params:
            conversation = conversation_of(self.workspace, access.client_id, params["conversation"])
        answer = answer_create(
            workspace=self.workspace,
            conversation=conversation,
            question=params["question"],
            collections=params.get("collections"),
            asker=access.user,
            client_id=access.client_id,
            route_name=params.get("route"),
            top_k=params["top_k"],
            max_tokens=params.get("max_tokens"),
            temperature=params.get("temperature"),
            client_key=access.key,
            reader=access.reader,
        )
        self.audit(Action.ASK, target=f"answer:{answer.pk}", detail={"question": params["question"]})
        if wait is not None:
            answer = answer_wait(answer, wait)
        finished = wait is not None and answer.status in FINISHED
        body = self.get_serializer(answer).data
        return Response(
            body, status=status.HTTP_200_OK if finished else status.HTTP_202_ACCEPTED, headers={"Location": body["url"]}
        )


class AnswerDetailView(ApiView):
    scopes = {"GET": Scope.GENERATE}
    serializer_class = api.AnswerSerializer

    @extend_schema(
        operation_id="answers_get",
        summary="One answer: status, text, citations, sources, stats",
        description="Scope: generate.",
        responses={200: api.AnswerSerializer, **error_responses()},
    )
    def get(self, request, answer_id):
        answer = (
            self.scoped(Answer).filter(pk=answer_id).select_related("route").prefetch_related("collections").first()
        )
        if answer is None:
            raise _not_found("answer", answer_id)
        (answer,) = answers_readable([answer], self.reader)
        return Response(self.get_serializer(answer).data)


# --------------------------------------------------------------------------- conversations


def _conversations(view) -> QuerySet:
    """The caller's conversations (a key's, or a member's own), with their number of turns."""
    return conversations_owned(view.workspace, view.request.access.client_id).annotate(turn_count=Count("answers"))


def _conversation(view, conversation_id):
    conversation = _conversations(view).filter(pk=conversation_id).first()
    if conversation is None:
        raise NotFound(f"No conversation {conversation_id} of yours in this workspace.", code="not_found")
    return conversation


class ConversationListView(ApiView):
    scopes = {"GET": Scope.GENERATE, "POST": Scope.GENERATE}
    serializer_class = api.ConversationSerializer

    @extend_schema(
        operation_id="conversations_list",
        summary="Your conversations, the latest turn first",
        description="Scope: generate. A key lists the conversations it started; a member, their own.",
        responses={200: api.ConversationSerializer(many=True), **error_responses()},
    )
    def get(self, request):
        page = self.paginate_queryset(_conversations(self))
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(
        operation_id="conversations_create",
        summary="Start a conversation",
        description=(
            "Scope: generate. Ask its questions with `POST /api/v1/answers` and `conversation`: each one after "
            "the first is read as a follow-up of the turns before it."
        ),
        request=api.ConversationCreateSerializer,
        responses={201: api.ConversationSerializer, **error_responses(415)},
    )
    def post(self, request):
        serializer = api.ConversationCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        access = request.access
        conversation = conversation_create(
            workspace=self.workspace,
            owner=access.user,
            client_id=access.client_id,
            title=serializer.validated_data.get("title", ""),
        )
        return Response(self.get_serializer(_conversation(self, conversation.pk)).data, status=status.HTTP_201_CREATED)


class ConversationDetailView(ApiView):
    scopes = {"GET": Scope.GENERATE, "PATCH": Scope.GENERATE, "DELETE": Scope.GENERATE}
    serializer_class = api.ConversationDetailSerializer
    http_method_names = ["get", "patch", "delete", "head"]

    @extend_schema(
        operation_id="conversations_get",
        summary="One conversation with its answers, oldest first",
        description="Scope: generate.",
        responses={200: api.ConversationDetailSerializer, **error_responses()},
    )
    def get(self, request, conversation_id):
        conversation = _conversation(self, conversation_id)
        conversation.turn_list = answers_readable(
            conversation_turns(conversation).select_related("route").prefetch_related("collections"), self.reader
        )
        return Response(self.get_serializer(conversation).data)

    @extend_schema(
        operation_id="conversations_rename",
        summary="Rename a conversation",
        description="Scope: generate. A body without `title` changes nothing.",
        request=api.ConversationRenameSerializer,
        responses={200: api.ConversationSerializer, **error_responses(415)},
    )
    def patch(self, request, conversation_id):
        conversation = _conversation(self, conversation_id)  # another's is not found, whatever the body
        # PATCH: the fields given change, and a body without any changes nothing.
        serializer = api.ConversationRenameSerializer(data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        if "title" in serializer.validated_data:
            conversation = conversation_rename(conversation=conversation, title=serializer.validated_data["title"])
        return Response(api.ConversationSerializer(conversation, context=self.get_serializer_context()).data)

    @extend_schema(
        operation_id="conversations_delete",
        summary="Delete a conversation and its answers",
        description="Scope: generate. What its answers cost stays in the usage ledger.",
        responses={204: OpenApiResponse(description="Deleted."), **error_responses()},
    )
    def delete(self, request, conversation_id):
        conversation_delete(conversation=_conversation(self, conversation_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


# --------------------------------------------------------------------------- usage

MONTH_PATTERN = r"^[1-9][0-9]{3}-(0[1-9]|1[0-2])$"


class UsageView(ApiView):
    scopes = {"GET": None}
    pagination_class = None

    @extend_schema(
        operation_id="usage_get",
        summary="The caller's usage and cost in a month",
        description=(
            "Any valid key. From the usage ledger: the calling key's requests, tokens and exact cost in "
            "the month (UTC; default: this one), per model. For a session, the user's own requests in the "
            "workspace. Rows reach the ledger within seconds of a request's end."
        ),
        parameters=[
            OpenApiParameter(
                "month", str, description="YYYY-MM (UTC); default: the current month.", pattern=MONTH_PATTERN
            )
        ],
        responses={200: api.UsageSerializer, **error_responses()},
    )
    def get(self, request):
        month = request.query_params.get("month", datetime.now(UTC).strftime("%Y-%m"))
        if not re.fullmatch(MONTH_PATTERN, month):
            raise invalid("month", f"month must be YYYY-MM, got {month[:20]!r}")
        year, number = map(int, month.split("-"))
        access = request.access
        # Days and months are UTC (TIME_ZONE), as on the billing dashboards.
        if access.key is not None:
            per_model = usage_month_by_model(month=date(year, number, 1), client_key_id=access.key.pk)
        else:
            per_model = usage_month_by_model(
                month=date(year, number, 1), user_id=access.user.pk, workspace_id=self.workspace.pk
            )
        models = [
            {
                "model": row["model"],
                "provider": row["provider"],
                "requests": row["requests"],
                "errors": row["errors"],
                "prompt_tokens": row["prompt_tokens"],
                "completion_tokens": row["completion_tokens"],
                "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
                "cost_usd": row["cost_usd"],
                "unpriced_requests": row["unpriced"],
            }
            for row in per_model
        ]
        counts = ("requests", "errors", "prompt_tokens", "completion_tokens", "total_tokens", "unpriced_requests")
        totals = {name: sum(row[name] for row in models) for name in counts}
        key = access.key
        body = {
            "month": month,
            "client_key": None
            if key is None
            else {
                "id": key.pk,
                "name": key.name,
                "masked": key.masked,
                "requests_per_minute": key.requests_per_minute,
                "tokens_per_minute": key.tokens_per_minute,
                "monthly_budget_usd": key.monthly_budget_usd,
            },
            **totals,
            "cost_usd": sum((row["cost_usd"] for row in models), 0),
            "models": models,
        }
        return Response(api.UsageSerializer(body).data)


@csrf_exempt  # a 404 for every method: Django's CSRF check would answer unsafe ones with an HTML 403
def endpoint_not_found(request):
    """Any other path under /api/v1/: a 404 in the API's shape (Django's would be an HTML page)."""
    return error_json(
        RestApiError(status.HTTP_404_NOT_FOUND, "not_found", f"No API endpoint at {request.path}: see /api/docs/.")
    )
