"""An answer's events as Server-Sent Events: ``GET /api/v1/answers/<id>/stream``.

A plain async Django view, not a DRF one: under ASGI, Django buffers a
``StreamingHttpResponse`` over a synchronous iterator whole before sending it, and DRF's
views are synchronous. Here the response iterates an async generator over
``search.answering.answers.answer_stream_aread`` (Redis ``XREAD`` on the asyncio client), so each
event leaves as it is written, and a waiting reader holds no thread. Database work
(authentication, the answer's lookup, the replay of a stored answer) goes through
``sync_to_async``.

Authentication and the workspace are decided by ``auth.access_resolve``, as for the DRF
views (scope ``generate``); errors have the API's one shape.

Each event is ``event: <type>``, ``id: <Redis stream id>``, ``data: <JSON object>``. ``delta``
events carry the answer's verified text, sentence by sentence, the stored answer's text in
order; ``?unverified=true`` asks for the model's own tokens instead, each marked
``"unverified": true`` (docs/api.md). A client
resumes after the last id it saw with ``Last-Event-ID`` (EventSource sends it when it
reconnects) or ``?after=``. While nothing is written, a comment line (``: keep-alive``) goes
out every ``KEEPALIVE_SECONDS``, so proxies and clients see the connection alive; after
``STREAM_MAX_SECONDS`` without the end the response ends, and the client reconnects (the
``retry:`` hint says after how long) to resume where it was. A client resuming after the
stream's last event (``answer`` or ``error``) gets 204 No Content, which tells EventSource
to stop reconnecting: nothing more will come.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

from asgiref.sync import sync_to_async
from django.http import HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status

from billing import client_keys
from frontdoors.api.auth import Access, Scope, access_resolve, workspace_slug_of
from frontdoors.api.errors import RestApiError, api_error_of, error_json, invalid
from inference.streams import stream_key
from ragsite.redis import Role, redis_async_client
from search.access import answer_readable
from search.answering.answers import ANSWER_END, QUIET, answer_events, event_id_valid
from search.models import Answer
from search.scoping import in_workspaces

KEEPALIVE_SECONDS = 15.0
STREAM_MAX_SECONDS = 300.0
RECONNECT_MS = 1000


def sse_event(kind: str, event_id: str | None, data: dict) -> str:
    # json.dumps escapes newlines inside strings: the data is one line, as SSE needs.
    head = f"event: {kind}\nid: {event_id}\n" if event_id else f"event: {kind}\n"
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _access(request) -> Access:
    token = client_keys.bearer_token(request)
    key, user = None, None
    if token is not None:
        try:
            key = await sync_to_async(client_keys.client_key_authenticate)(token)
        except client_keys.ClientKeyError as exc:
            raise exceptions.AuthenticationFailed(exc.message, code=exc.code) from None
    else:
        user = await request.auser()
    return await sync_to_async(access_resolve)(
        key=key, user=user, scope=Scope.GENERATE, workspace_slug=workspace_slug_of(request)
    )


def _event_order(event_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = event_id.partition("-")
    return int(milliseconds), int(sequence or 0)


async def _ended_at_or_before(answer_id, status_now: str, after: str) -> bool:
    """Whether the answer's last event, its end (the stored ``answer`` or an ``error``), is at or before ``after``."""
    last = await redis_async_client(Role.STREAMS).xrevrange(stream_key(str(answer_id)), count=1)
    if last:
        event_id, fields = last[0]
        return fields[b"type"].decode() in ANSWER_END and _event_order(event_id.decode()) <= _event_order(after)
    # No stream (expired, or the answer failed before one began): a finished answer is
    # replayed from its row as events 0-1 to 0-3 (answer_stream_aread), 0-2 the last of a
    # failed one, 0-3 of a done one.
    if status_now == Answer.Status.DONE:
        return _event_order(after) >= (0, 3)
    return status_now == Answer.Status.FAILED and _event_order(after) >= (0, 2)


async def _events(answer_id, after: str, *, unverified: bool = False):
    """``search.answering.answers.answer_events`` as Server-Sent Events, for ``STREAM_MAX_SECONDS`` at
    most: then the response ends and the client resumes from its last id."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STREAM_MAX_SECONDS
    yield f"retry: {RECONNECT_MS}\n\n"
    events = answer_events(answer_id, after=after, slice_ms=int(KEEPALIVE_SECONDS * 1000), raw=unverified)
    async with aclosing(events):  # closed at once when the deadline ends the response early
        async for event in events:
            if event.kind != QUIET:
                yield sse_event(event.kind, event.id, event.data)
            elif loop.time() >= deadline:
                return
            else:
                yield ": keep-alive\n\n"


@csrf_exempt  # GET only; other methods get the API's 405 rather than Django's HTML CSRF 403
async def answer_stream(request, answer_id):
    if request.method != "GET":
        error = RestApiError(
            status.HTTP_405_METHOD_NOT_ALLOWED, "method_not_allowed", f'Method "{request.method}" not allowed.'
        )
        return error_json(error, headers={"Allow": "GET"})
    try:
        access = await _access(request)
        given = {"Last-Event-ID": request.headers.get("Last-Event-ID"), "after": request.GET.get("after")}
        for name, value in given.items():
            if value is not None and not event_id_valid(value):
                raise invalid(name, f"{name} must be an event id such as 1700000000000-0 (or 0: from the start).")
        # EventSource's own header, when it reconnects, wins over the URL it was opened with.
        after = given["Last-Event-ID"] or given["after"] or "0"
        unverified = request.GET.get("unverified", "false")
        if unverified not in ("true", "false"):
            raise invalid("unverified", f"unverified must be true or false, got {unverified!r}.")
        answers = in_workspaces(Answer, access.workspace).filter(pk=answer_id).only("status", "sources")
        answer = await sync_to_async(answers.first)()
        # One whose sources the caller may not all read (search.access) is not found either.
        if answer is None or not await sync_to_async(lambda: answer_readable(answer, access.reader))():
            raise exceptions.NotFound(f"No answer {answer_id} in this workspace.", code="not_found")
        status_now = answer.status
    except exceptions.APIException as exc:
        return error_json(api_error_of(exc))
    if after != "0" and await _ended_at_or_before(answer_id, status_now, after):
        return HttpResponse(status=status.HTTP_204_NO_CONTENT)
    response = StreamingHttpResponse(
        _events(answer_id, after, unverified=unverified == "true"), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response
