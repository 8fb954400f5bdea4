"""Views of the browser UI (docs/ui.md).

Pages are server-rendered templates. htmx (from the django-htmx wheel) asks for fragments:
the Ask panel, upload reports, retry/delete, and the documents' status, polled every
second while a document is in progress. ``answer_event_stream`` serves an answer's stream as
Server-Sent Events; it is ``async`` and returns a StreamingHttpResponse over an async
generator, because under ASGI Django buffers a synchronous iterator whole before sending
any of it. Who may see what: ``frontdoors.ui.workspaces``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import redis
from asgiref.sync import sync_to_async
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Count, OuterRef, Subquery
from django.http import Http404, HttpResponse, HttpResponseForbidden, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext, ngettext
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from frontdoors.files import document_file_response
from frontdoors.ui.forms import MODE_CHOICES, ConversationRenameForm, ReadersForm, SearchForm, UploadForm
from frontdoors.ui.languages import domain_text, script_strings
from frontdoors.ui.rendering import answer_html, passage_context, sources_by_number
from frontdoors.ui.workspaces import member_required, workspace_choose
from inference.errors import RouteUnavailable
from ragsite.audit import Action, audit_record
from ragsite.errors import DomainError
from search.access import Reader, answer_readable, may_change_documents, reader_of_user, readers_for
from search.answering import conversations
from search.answering.answers import QUIET, answer_create, answer_events, answers_readable, event_id_valid
from search.models import Answer, Chunk, Document
from search.scoping import in_workspaces, workspaces_visible_to
from search.selectors import chunk_search
from search.services import (
    DocumentRejected,
    document_delete,
    document_readers_set,
    document_retry,
    documents_upload,
    source_name_clean,
)

logger = logging.getLogger(__name__)

RESULTS_PER_SEARCH = 10
RECENT_ON_SEARCH_PAGE = 5
ANSWERS_PER_PAGE = 25
DOCUMENTS_PER_PAGE = 50
FINAL_DOCUMENT_STATUSES = (Document.Status.INDEXED, Document.Status.FAILED)
FINAL_ANSWER_STATUSES = (Answer.Status.DONE, Answer.Status.FAILED)
# How long the event stream waits for an event before sending a keep-alive comment: under
# the Redis client's 30 s socket timeout, and under the idle limit of common proxies.
SSE_KEEPALIVE_MS = 15000
# When the connection drops, the browser reconnects after this long with the last event id.
SSE_RETRY_MS = 3000


def _form_errors(form) -> str:
    return " ".join(str(error) for errors in form.errors.values() for error in errors)


# --------------------------------------------------------------------------- search and ask


@require_GET
@member_required
def search_page(request):
    form = SearchForm(request.GET or None, workspace=request.workspace)
    result = error = None
    if form.is_bound and form.is_valid() and form.cleaned_data["q"].strip():
        try:
            result = chunk_search(
                query=form.cleaned_data["q"],
                workspace=request.workspace,
                collection_ids=form.collection_ids(),
                mode=form.cleaned_data["mode"],
                top_k=RESULTS_PER_SEARCH,
                reader=request.reader,
            )
        except DomainError as exc:  # collections that cannot be searched together, or not the workspace's
            error = domain_text(str(exc))
        audit_record(
            Action.SEARCH,
            user=request.user,
            request=request,
            workspace_id=request.workspace.pk,
            outcome="ok" if error is None else "refused",
            detail={"query": form.cleaned_data["q"], "mode": form.cleaned_data["mode"]},
        )
    names = {collection.pk: collection.name for collection in form.fields["collection"].queryset}
    recent = (
        in_workspaces(Answer, request.workspace)
        .filter(asker=request.user)
        .only("id", "question", "status", "mode", "created_at")[:RECENT_ON_SEARCH_PAGE]
    )
    return render(
        request,
        "search/search.html",
        {
            "form": form,
            "result": result,
            "hits": [(hit, names.get(hit.collection_id, "")) for hit in result.hits] if result else [],
            "error": error,
            "form_error": _form_errors(form) if form.is_bound else "",
            "mode_label": dict(MODE_CHOICES).get(result.mode, "") if result else "",
            "recent": recent,
            "has_collections": bool(names),
            "script_strings": script_strings(),
        },
    )


@require_POST
@member_required
def ask(request):
    """Start an answer (``answer_create``); htmx gets the answer panel, which streams it."""
    form = SearchForm(request.POST, workspace=request.workspace)
    if not form.is_valid():
        return _ask_refused(request, _form_errors(form), status=422)
    try:
        conversation = None
        if form.cleaned_data.get("conversation"):
            conversation = conversations.conversation_of(
                request.workspace, conversations.client_id_of(user=request.user), form.cleaned_data["conversation"]
            )
        answer = answer_create(
            workspace=request.workspace,
            question=form.cleaned_data["q"],
            collections=form.collection_ids(),
            asker=request.user,
            conversation=conversation,
            reader=request.reader,
        )
        audit_record(
            Action.ASK,
            user=request.user,
            request=request,
            workspace_id=request.workspace.pk,
            target=f"answer:{answer.pk}",
            detail={"question": form.cleaned_data["q"]},
        )
    except RouteUnavailable as exc:
        return _ask_refused(
            request, gettext("No model can answer now: %(reason)s") % {"reason": domain_text(str(exc))}, status=503
        )
    except DomainError as exc:  # the question (AnswerError), the collections, a full pool
        return _ask_refused(request, domain_text(str(exc)), status=422 if exc.status < 500 else exc.status)
    if not request.htmx:
        return redirect("ui:answer", answer_id=answer.pk)
    # Stream even a finished (extractive) answer: it arrives the same way as a generated one.
    return render(request, "search/_answer.html", {**_answer_context(answer, stream=True), "show_link": True})


def _ask_refused(request, message: str, *, status: int):
    if request.htmx:
        return render(request, "search/_ask_refused.html", {"message": message}, status=status)
    messages.error(request, message)
    return redirect("ui:search")


def _answer_context(answer: Answer, *, stream: bool) -> dict:
    # A withheld answer (search.access.answers_readable) is never streamed: its events hold its text.
    stream = stream and not getattr(answer, "withheld", False)
    cited = {citation["number"] for citation in answer.citations}
    why = (answer.stats.get("quoted_instead") or {}).get("why") or answer.stats.get("why")
    return {
        "answer": answer,
        # Why an extractive answer quotes: the answer's own reason, else that no model is set up.
        "extractive_why": domain_text(why or "no generation model is configured"),
        "stream": stream,
        "text_html": "" if stream else answer_html(answer.text, answer.sources, answer.verification.get("sentences")),
        "unsupported": sum(s.get("action") == "unsupported" for s in answer.verification.get("sentences", [])),
        "sources": [{**source, "cited": source["number"] in cited} for source in answer.sources],
        "source_links": sources_by_number(answer.sources),
    }


@require_GET
@member_required
def answer_detail(request, answer_id):
    """An answer in its conversation's thread: every turn in order (those still generating
    stream), and for the conversation's owner a box for the next question under the last."""
    answer = get_object_or_404(in_workspaces(Answer, request.workspaces).select_related("conversation"), pk=answer_id)
    (answer,) = answers_readable([answer], request.reader)
    conversation = answer.conversation
    turns = [
        {**_answer_context(turn, stream=turn.status not in FINAL_ANSWER_STATUSES), "current": turn.pk == answer.pk}
        for turn in answers_readable(
            conversations.conversation_turns(conversation).select_related("asker"), request.reader
        )
    ]
    owner = (
        conversation.client_id == conversations.client_id_of(user=request.user)
        and conversation.workspace_id == request.workspace.pk
    )
    # A follow-up searches what the last turn searched, when that was one collection.
    last_collections = list(turns[-1]["answer"].collections.values_list("pk", flat=True)) if turns else []
    return render(
        request,
        "search/answer.html",
        {
            **_answer_context(answer, stream=answer.status not in FINAL_ANSWER_STATUSES),
            "conversation": conversation,
            "turns": turns,
            "owner": owner,
            "follow_up_form": SearchForm(initial={"conversation": conversation.pk}, workspace=request.workspace)
            if owner
            else None,
            "follow_up_collection": last_collections[0] if len(last_collections) == 1 else None,
            "rename_form": ConversationRenameForm(initial={"title": conversation.title}) if owner else None,
            "script_strings": script_strings(),
        },
    )


def _conversations_of(request):
    return conversations.conversations_owned(request.workspace, conversations.client_id_of(user=request.user))


@require_GET
@member_required
def answers(request):
    """The user's conversations in the current workspace, the latest turn first, each linked
    to its last answer."""
    latest = (
        in_workspaces(Answer, request.workspace)
        .filter(conversation=OuterRef("pk"))
        .order_by("-created_at", "-pk")
        .values("pk")[:1]
    )
    mine = _conversations_of(request).annotate(turn_count=Count("answers"), latest_answer=Subquery(latest))
    page = Paginator(mine.filter(turn_count__gt=0), ANSWERS_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "search/answers.html", {"page": page})


@require_POST
@member_required
def conversation_rename_view(request, conversation_id):
    conversation = get_object_or_404(_conversations_of(request), pk=conversation_id)
    form = ConversationRenameForm(request.POST)
    try:
        if not form.is_valid():
            raise conversations.ConversationError("title", _form_errors(form))
        conversations.conversation_rename(conversation=conversation, title=form.cleaned_data["title"])
        messages.success(request, gettext("Conversation renamed."))
    except conversations.ConversationError as exc:
        messages.error(request, gettext("Not renamed: %(reason)s") % {"reason": domain_text(str(exc))})
    latest = conversations.conversation_turns(conversation).last()
    return redirect("ui:answer", answer_id=latest.pk) if latest is not None else redirect("ui:answers")


@require_POST
@member_required
def conversation_delete_view(request, conversation_id):
    conversation = get_object_or_404(_conversations_of(request), pk=conversation_id)
    title = conversation.title
    conversations.conversation_delete(conversation=conversation)
    messages.success(request, gettext("Deleted the conversation “%(title)s” and its answers.") % {"title": title})
    return redirect("ui:answers")


@require_GET
async def answer_event_stream(request, answer_id):
    """An answer's events as Server-Sent Events: ``delta``, ``retry``, ``progress``, then
    ``stats`` or ``error``, each with its stream id, so that the browser's automatic
    reconnection resumes after the last event it received (``Last-Event-ID``)."""
    user = await request.auser()
    if not user.is_authenticated:
        return HttpResponse(gettext("Log in to follow this answer."), status=403, content_type="text/plain")
    if not await sync_to_async(_answer_visible)(user, answer_id):
        raise Http404("no such answer")
    after = request.headers.get("Last-Event-ID", "")
    response = StreamingHttpResponse(
        _answer_event_stream(answer_id, after if event_id_valid(after) else "0"),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a buffering proxy (nginx) passes each event on at once
    return response


def _answer_visible(user, answer_id) -> bool:
    """An answer of the user's workspaces whose sources the user may all read (search.access)."""
    answer = in_workspaces(Answer, workspaces_visible_to(user)).filter(pk=answer_id).only("sources").first()
    return answer is not None and answer_readable(answer, reader_of_user(user))


async def _answer_event_stream(answer_id, after: str):
    """``search.answering.answers.answer_events`` as Server-Sent Events."""
    yield f"retry: {SSE_RETRY_MS}\n\n"
    try:
        async for event in answer_events(answer_id, after=after, slice_ms=SSE_KEEPALIVE_MS):
            if event.kind == QUIET:
                yield ": keep-alive\n\n"
                continue
            data = json.dumps(event.data, separators=(",", ":"))
            yield (f"id: {event.id}\n" if event.id else "") + f"event: {event.kind}\ndata: {data}\n\n"
    except redis.RedisError:
        # Ending without a terminal event makes the browser reconnect (from the last id)
        # after SSE_RETRY_MS, by which time Redis may be back.
        logger.warning("answer %s: its stream could not be read", answer_id, exc_info=True)


@require_GET
@member_required
def passage(request, chunk_id):
    """A passage in its context; htmx (the citation dialog) gets the passage alone."""
    chunk = (
        in_workspaces(Chunk, request.workspaces, request.reader)
        .select_related("document__collection")
        .defer("embedding", "bm25", "tsv")
        .filter(pk=chunk_id)
        .first()
    )
    if chunk is None:
        audit_record(
            Action.DOCUMENT_OPEN, user=request.user, request=request, target=f"chunk:{chunk_id}", outcome="not_found"
        )
        raise Http404("no such passage")
    _document_audit(request, Action.DOCUMENT_OPEN, chunk.document, chunk=chunk.pk)
    template = "search/_passage.html" if request.htmx else "search/passage.html"
    return render(request, template, {"passage": passage_context(chunk, request.reader), "document": chunk.document})


# --------------------------------------------------------------------------- documents


@require_GET
@member_required
def documents(request):
    context = {
        "form": UploadForm(workspace=request.workspace),
        **_document_list(request),
        "script_strings": script_strings(),
    }
    return render(request, "search/documents.html", context)


@require_GET
@member_required
def document_list(request):
    """The documents table alone: what the page polls while a document is in progress."""
    return render(request, "search/_document_list.html", _document_list(request))


_LISTED_FIELDS = (
    "id",
    "title",
    "source_name",
    "status",
    "error",
    "chunks_total",
    "chunks_embedded",
    "updated_at",
    "collection__name",
    "readers",
)


def _document_list(request, *, page_number=None, note: str = "") -> dict:
    in_workspace = in_workspaces(Document, request.workspace, request.reader)
    listed = in_workspace.select_related("collection").only(*_LISTED_FIELDS)
    page = Paginator(listed, DOCUMENTS_PER_PAGE).get_page(page_number or request.GET.get("page"))
    counts = dict(in_workspace.order_by().values_list("status").annotate(count=Count("pk")))
    in_progress = sum(count for status, count in counts.items() if status not in FINAL_DOCUMENT_STATUSES)
    total = sum(counts.values())
    summary = gettext("No documents yet.")
    if total:
        indexed, failed = counts.get(Document.Status.INDEXED, 0), counts.get(Document.Status.FAILED, 0)
        summary = ngettext(
            "%(total)s document: %(indexed)s indexed, %(in_progress)s in progress, %(failed)s failed.",
            "%(total)s documents: %(indexed)s indexed, %(in_progress)s in progress, %(failed)s failed.",
            total,
        ) % {"total": total, "indexed": indexed, "in_progress": in_progress, "failed": failed}
    return {
        "page": page,
        "polling": in_progress > 0,
        "summary": f"{note} {summary}".strip(),
        "can_change": may_change_documents(request.user, request.workspace),
    }


@dataclass(frozen=True)
class UploadOutcome:
    kind: str  # added, duplicate or rejected
    message: str


def _upload(collection, files, readers: list[str] | None, uploader: Reader) -> list[UploadOutcome]:
    """What became of each file (``documents_upload``: all or nothing, as in the API)."""
    names = [source_name_clean(file.name) for file in files]
    try:
        stored = documents_upload(collection=collection, files=files, readers=readers, uploader=uploader)
    except DocumentRejected as exc:
        refusals = getattr(exc, "refusals", [exc])
        return [
            *(UploadOutcome("rejected", domain_text(str(refusal), names)) for refusal in refusals),
            UploadOutcome(
                "rejected",
                ngettext(
                    "Nothing was stored: remove or fix that file and upload again.",
                    "Nothing was stored: remove or fix those files and upload again.",
                    len(refusals),
                ),
            ),
        ]
    return [
        UploadOutcome(
            "added",
            gettext("%(name)s: queued for indexing in %(collection)s.") % {"name": name, "collection": collection.name},
        )
        if created
        else UploadOutcome(
            "duplicate",
            gettext("%(name)s: already in %(collection)s as “%(title)s”.")
            % {"name": name, "collection": collection.name, "title": document.title},
        )
        for name, (document, created) in zip(names, stored, strict=True)
    ]


@require_POST
@member_required
def upload(request):
    """Store the files as documents, ingestion queued (``documents_upload``: all or nothing)."""
    if not may_change_documents(request.user, request.workspace):
        if request.htmx:
            return render(request, "search/_upload_report.html", {"refused": _viewer_note()}, status=403)
        return HttpResponseForbidden(_viewer_note())
    form = UploadForm(request.POST, request.FILES, workspace=request.workspace)
    if not form.is_valid():
        if request.htmx:
            return render(request, "search/_upload_report.html", {"refused": _form_errors(form)}, status=422)
        messages.error(request, _form_errors(form))
        return redirect("ui:documents")
    groups = form.cleaned_data["readers"]
    # Restricted to groups: the uploader too, who would otherwise lose sight of the upload.
    readers = readers_for(users=[request.user.pk], groups=[group.pk for group in groups]) if groups else None
    outcomes = _upload(form.cleaned_data["collection"], form.cleaned_data["files"], readers, request.reader)
    if request.htmx:
        added = sum(outcome.kind == "added" for outcome in outcomes)
        note = ngettext("%(added)s of %(total)s file added.", "%(added)s of %(total)s files added.", len(outcomes))
        context = {
            "outcomes": outcomes,
            **_document_list(request, note=note % {"added": added, "total": len(outcomes)}),
        }
        # Every file refused: 422 (which htmx still shows), as for a refused form.
        refused = all(outcome.kind == "rejected" for outcome in outcomes)
        return render(request, "search/_upload_report.html", context, status=422 if refused else 200)
    levels = {"added": messages.SUCCESS, "duplicate": messages.INFO, "rejected": messages.ERROR}
    for outcome in outcomes:
        messages.add_message(request, levels[outcome.kind], outcome.message)
    return redirect("ui:documents")


def _member_document(request, document_id, action: str | None = None) -> Document:
    """The document, if the user may read it; else 404, and an ``action`` refused goes to the
    audit log (an attempt at another's document is what an auditor looks for)."""
    document = (
        in_workspaces(Document, request.workspaces, request.reader)
        .select_related("collection")
        .filter(pk=document_id)
        .first()
    )
    if document is None:
        if action is not None:
            audit_record(
                action, user=request.user, request=request, target=f"document:{document_id}", outcome="not_found"
            )
        raise Http404("no such document")
    return document


def _document_audit(request, action: str, document: Document, **detail) -> None:
    audit_record(
        action,
        user=request.user,
        request=request,
        workspace_id=document.collection.workspace_id,
        target=f"document:{document.pk}",
        detail={"title": document.title, **detail},
    )


def _viewer_note() -> str:
    return gettext(
        "Your role in this workspace is viewer: ask one of its admins to make you an editor to change documents."
    )


def _changeable_document(request, document_id) -> Document:
    """A document the user may read and change (an editor or admin of its workspace): 404
    when they may not read it, 403 when they may only read it."""
    document = _member_document(request, document_id)
    if not may_change_documents(request.user, document.collection.workspace_id):
        raise PermissionDenied(_viewer_note())
    return document


def _after_document_action(request, note: str):
    if request.htmx:
        context = _document_list(request, page_number=request.POST.get("page"), note=note)
        return render(request, "search/_document_list.html", context)
    messages.success(request, note)
    return redirect("ui:documents")


@require_POST
@member_required
def document_retry_view(request, document_id):
    document = document_retry(document=_changeable_document(request, document_id))
    return _after_document_action(request, gettext("“%(title)s” is queued again.") % {"title": document.title})


@require_GET
@member_required
def document_file(request, document_id):
    """The document's original file, as uploaded, under its name (a Japanese one too)."""
    document = _member_document(request, document_id, Action.DOCUMENT_DOWNLOAD)
    _document_audit(request, Action.DOCUMENT_DOWNLOAD, document)
    try:
        return document_file_response(request, document)
    except FileNotFoundError:
        raise Http404("the file of this document is missing from storage") from None


@require_http_methods(["GET", "POST"])
@member_required
def document_readers_view(request, document_id):
    """Who may read a document: its workspace's groups, or everyone. An editor who restricts it
    stays among its readers, as on upload, rather than locking themselves out."""
    document = _changeable_document(request, document_id)
    workspace = document.collection.workspace
    chosen = {int(principal[2:]) for principal in document.readers if principal.startswith("g:")}
    posted = request.POST if request.method == "POST" else None  # an empty POST: everyone
    form = ReadersForm(posted, workspace=workspace, initial={"groups": sorted(chosen)})
    if request.method == "POST" and form.is_valid():
        groups = form.cleaned_data["groups"]
        readers = readers_for(users=[request.user.pk], groups=[group.pk for group in groups]) if groups else ["*"]
        before = list(document.readers)
        document = document_readers_set(document=document, readers=readers)
        _document_audit(request, Action.READERS_CHANGE, document, before=before, after=list(document.readers))
        if groups:
            names = ", ".join(group.name for group in groups)
            note = gettext("“%(title)s” may now be read by %(groups)s and you.") % {
                "title": document.title,
                "groups": names,
            }
        else:
            note = gettext("“%(title)s” may now be read by everyone in the workspace.") % {"title": document.title}
        messages.success(request, note)
        return redirect("ui:documents")
    return render(request, "search/document_readers.html", {"document": document, "form": form})


@require_POST
@member_required
def document_delete_view(request, document_id):
    document = _changeable_document(request, document_id)
    document_delete(document=document)
    return _after_document_action(request, gettext("“%(title)s” deleted.") % {"title": document.title})


# --------------------------------------------------------------------------- workspace


@require_POST
@member_required
def workspace_switch(request):
    """Make another of the user's workspaces the current one (kept in the session)."""
    chosen = next((w for w in request.workspaces if w.slug == request.POST.get("workspace")), None)
    if chosen is None:
        raise Http404("no such workspace among yours")
    workspace_choose(request, chosen)
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        target = reverse("ui:search")
    return redirect(target)
