"""Views of the OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/embeddings``.

Every view is async: a streamed chat completion must be (under ASGI, Django buffers a
``StreamingHttpResponse`` over a synchronous iterator entirely before sending any of it),
and the others then wait on the database and the models without holding the thread that
runs Django's synchronous code. CSRF does not apply: callers authenticate with a bearer
client key, never with a cookie. Scopes: ``generate`` for chat completions, ``search`` for
embeddings (a building block of retrieval), any valid key for the model list.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from asgiref.sync import sync_to_async
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from billing import client_keys
from billing.models import ClientKey
from frontdoors.openai_api import chat as chat_api
from frontdoors.openai_api import embeddings as embeddings_api
from frontdoors.openai_api.errors import OpenAIError, from_domain, from_generation, invalid, model_not_found
from ragsite.outages import RETRY_AFTER_S, log_outage, outage_message, outage_of
from ragsite.overload import connection_give_back, slot_release
from search.embedders import DEFAULT_EMBEDDER
from search.models import Collection
from search.scoping import in_workspaces

logger = logging.getLogger(__name__)


def api_view(*methods: str):
    """An async API view: CSRF-exempt, ``methods`` only, every refusal and failure in OpenAI's
    error shape."""

    def decorate(view):
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request, *args, **kwargs):
            try:
                if request.method not in methods:
                    message = f"{request.method} is not allowed here; use {' or '.join(methods)}"
                    raise OpenAIError(405, message, code="method_not_allowed")
                return await view(request, *args, **kwargs)
            except OpenAIError as exc:
                return exc.response()
            except Exception as exc:
                if service := outage_of(exc):
                    log_outage(service, request, exc)
                    return OpenAIError(
                        503, outage_message(service), code="service_unavailable", retry_after_s=RETRY_AFTER_S
                    ).response()
                logger.exception("OpenAI-compatible API: %s %s failed", request.method, request.path)
                return OpenAIError(500, "the server failed to answer this request", code="internal_error").response()

        return wrapper

    return decorate


def _authenticate_sync(request, scope: str | None) -> ClientKey:
    try:
        return client_keys.client_key_authenticate(client_keys.bearer_token(request), scope=scope)
    except client_keys.ClientKeyError as exc:
        raise from_domain(exc) from None


async def _authenticate(request, scope: str | None) -> ClientKey:
    return await sync_to_async(_authenticate_sync)(request, scope)


def _body(request):
    try:
        return json.loads(request.body or b"null")
    except RequestDataTooBig:
        message = "the request body is larger than this server accepts (DATA_UPLOAD_MAX_MEMORY_SIZE): send less"
        raise invalid(None, message, "request_too_large") from None
    except ValueError:
        raise invalid(None, "the request body is not valid JSON", "invalid_json") from None


# --------------------------------------------------------------------------- models


def _model(model_id: str, owned_by: str, created: int = 0) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


def _models(key: ClientKey) -> list[dict]:
    """The chat models (``chat.chat_models``), then the embedding models."""
    found = {}
    for name, route in chat_api.chat_models():
        if route is None:
            found[name] = _model(name, "search")
        else:
            found[name] = _model(name, route.provider.name, int(route.created_at.timestamp()))
    embedders = set(in_workspaces(Collection, key.workspace_id).values_list("embedding_model", flat=True))
    for name in sorted({DEFAULT_EMBEDDER} | embedders):
        found.setdefault(name, _model(name, "search"))
    return list(found.values())


@api_view("GET")
async def models_list(request):
    key = await _authenticate(request, None)
    return JsonResponse({"object": "list", "data": await sync_to_async(_models)(key)})


@api_view("GET")
async def model_retrieve(request, model_id: str):
    key = await _authenticate(request, None)
    models = await sync_to_async(_models)(key)
    for model in models:
        if model["id"] == model_id:
            return JsonResponse(model)
    raise model_not_found(model_id, [model["id"] for model in models])


# --------------------------------------------------------------------------- chat completions


@api_view("POST")
async def chat_completions(request):
    chat, started = await sync_to_async(_chat_start)(request)
    slot_release(request)  # what follows waits on Redis: no thread, no database connection
    completion = chat_api.ChatCompletion(started)
    events = chat_api.completion_events(started, unverified=chat.unverified_tokens)
    if not chat.stream:
        async with aclosing(events):
            async for kind, data in events:
                if kind == "delta":
                    completion.text.append(data.get("text", ""))
                elif kind == "stats":
                    return JsonResponse(completion.completion(data))
                elif kind == "error":
                    raise from_generation(data)
        raise OpenAIError(502, "the answer's stream ended without a result", code="generation_failed")

    # Wait for the first event before answering, so that a generation that fails at once
    # (nothing can serve, the upstream refused the request) gets its own HTTP status.
    first = await anext(events)
    if first[0] == "error":
        await events.aclose()
        raise from_generation(first[1])
    response = StreamingHttpResponse(
        _sse(completion, first, events, include_usage=chat.include_usage), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response


def _chat_start(request) -> tuple[chat_api.ChatRequest, chat_api.Started]:
    """Authentication, the request, the answer's start: one trip to the thread that runs
    the synchronous database work (a trip for the key and another for the answer were both
    on every completion's time to first token). A bad key is refused before a bad body."""
    try:
        key = _authenticate_sync(request, ClientKey.Scope.GENERATE)
        chat = chat_api.request_parse(_body(request))
        return chat, chat_api.answer_start(key, chat, request=request)
    finally:
        connection_give_back()  # the stream that follows holds none (ragsite.overload)


def _data(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _sse(
    completion: chat_api.ChatCompletion,
    first: tuple[str, dict],
    events: AsyncIterator[tuple[str, dict]],
    *,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The Server-Sent Events of a streamed completion: the role, one chunk per delta, the
    chunk with the finish reason and our extra fields, the usage chunk when asked for, then
    ``[DONE]``. A failure after the response began ends the stream with ``data: {"error":
    ...}``, which the SDKs raise as ``APIError``."""

    async def from_first():
        yield first
        async for event in events:
            yield event

    try:
        yield _data(completion.chunk({"role": "assistant", "content": ""}, include_usage=include_usage))
        async with aclosing(from_first()) as all_events:
            async for kind, data in all_events:
                if kind == "keepalive":
                    yield b": keep-alive\n\n"
                elif kind == "delta" and data.get("text"):
                    marked = {"unverified": True} if data.get("unverified") else {}
                    yield _data(completion.chunk({"content": data["text"]}, include_usage=include_usage, **marked))
                elif kind == "stats":
                    reason = completion.finish_reason(data)
                    yield _data(completion.chunk({}, reason, include_usage=include_usage, **completion.extras(data)))
                    if include_usage:
                        yield _data(completion.usage_chunk(data))
                    yield b"data: [DONE]\n\n"
                elif kind == "error":
                    yield _data(from_generation(data).body())
    except Exception:
        logger.exception("OpenAI-compatible API: the stream of answer %s failed", completion.answer.id)
        yield _data(OpenAIError(500, "the server failed while streaming", code="internal_error").body())
    finally:
        await events.aclose()


# --------------------------------------------------------------------------- embeddings


@api_view("POST")
async def embeddings(request):
    key = await _authenticate(request, ClientKey.Scope.SEARCH)
    return JsonResponse(await embeddings_api.embeddings_create(key, embeddings_api.request_parse(_body(request))))


# --------------------------------------------------------------------------- anything else


@api_view("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
async def not_found(request):
    raise OpenAIError(
        404,
        f"no endpoint {request.method} {request.path}; this API serves /v1/models, /v1/chat/completions and "
        "/v1/embeddings",
        code="unknown_url",
    )
