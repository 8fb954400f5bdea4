"""Chat completions over the answer pipeline: the request, the answer, the OpenAI shapes.

A chat request is answered by ``search.answering.answers.answer_create`` as the UI and the REST API
answer questions: the question is the text of the last ``user`` message, retrieval runs over
every collection of the key's workspace, the numbered sources and the instructions make the
prompt, and the generation is routed and billed to the key. The messages before it are the
conversation: each earlier user message a turn, answered by the assistant messages after it;
the question is read as a follow-up of those turns (retrieved for as a standalone question,
``retrieval_query`` in the response) and the turns go into the prompt (docs/openai.md).
System and developer messages are never a question or a turn.

``model`` picks the route: a route's name selects it; the default route's model id and
``extractive`` go to the default route; any other name is 404 ``model_not_found``, as
OpenAI answers it (an operator who wants SDK code's ``gpt-4o-mini`` served names a route so).
Without a default route the answer is extractive and the response's ``model`` says
``extractive``.

Limits: an answer is admitted against the key's limits by ``answer_create`` itself, an
extractive one too (it counts against the key's requests per minute, and costs nothing).
The route is planned once per request (``_planned``), here, and ``answer_create`` takes the plan.

``ChatCompletion`` turns the events of the answer's stream (``completion_events``, over
``search.answering.answers.answer_stream_aread``) into a ``chat.completion`` or its chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from django.conf import settings

from billing import limits
from billing.models import ClientKey
from frontdoors.openai_api import speculative
from frontdoors.openai_api.errors import from_domain, invalid, model_not_found
from inference import router
from inference.errors import NoRouteConfigured, PoolWarming, RouteNotFound, SpeculationUnavailable
from inference.models import Route
from ragsite.audit import Action, audit_record
from ragsite.errors import DomainError
from search.access import reader_of_key
from search.answering import answers, conversations, prompting
from search.models import Answer

EXTRACTIVE_MODEL = "extractive"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Fields that change what a completion is and that this API cannot honour: refused rather
# than ignored. Other OpenAI fields (user, seed, stop, top_p, metadata...) are accepted and
# have no effect (docs/openai.md).
UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "audio", "prediction")
# A wait on the answer's stream is cut in slices this long; after each empty one a
# streaming response sends an SSE comment, so that proxies keep the connection open.
READ_SLICE_MS = 10_000
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class ChatRequest:
    model: str
    question: str
    history: list[conversations.Turn]  # the earlier user messages and the replies to them
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float | None
    speculative: speculative.SpeculativeRequest
    # The model's tokens as it writes them, before their check, each chunk marked
    # "unverified": true; by default a stream carries the verified text only.
    unverified_tokens: bool = False


def _text_of(content, index: int) -> str:
    """A message's text: a string, or the text of its content parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    f"messages[{index}].content", "only text content parts are supported ({'type': 'text', ...})"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"messages[{index}].content", "content must be a string or a list of text parts")


def _history(said: list[tuple[str, str]]) -> list[conversations.Turn]:
    """The conversation before the question: each user message a turn, answered by the
    assistant messages after it (their citation markers removed). System and developer
    messages are instructions, never a question or a turn; tool messages are not turns."""
    turns: list[conversations.Turn] = []
    for role, text in said:
        if role == "user":
            turns.append(conversations.Turn(question=text.strip(), answer=""))
        elif turns:
            previous = turns[-1]
            reply = conversations.text_without_markers(text)
            answer = f"{previous.answer}\n{reply}".strip() if previous.answer else reply
            turns[-1] = conversations.Turn(question=previous.question, answer=answer)
    return [turn for turn in turns if turn.question]


def _positive_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise invalid(name, f"{name} must be a positive integer, got {value!r}")
    return value


def request_parse(body) -> ChatRequest:
    """The request, validated; ``OpenAIError`` (400) naming the field at fault."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        message = "model is required: a route's name (GET /v1/models lists them)"
        raise invalid("model", message, "missing_required_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects")
    said: list[tuple[str, str]] = []  # (role, text) of the user's and the assistant's messages, in order
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid(f"messages[{index}]", f"each message needs a role among {', '.join(ROLES)}")
        text = _text_of(message.get("content"), index)
        if message["role"] in ("user", "assistant"):
            said.append((message["role"], text))
    last_user = max((i for i, (role, _) in enumerate(said) if role == "user"), default=None)
    if last_user is None or not said[last_user][1].strip():
        raise invalid("messages", "the messages need a user message with the question (the last one is answered)")
    question = said[last_user][1]
    history = _history(said[:last_user])

    for name in UNSUPPORTED:
        if body.get(name):
            message = f"{name} is not supported: answers come from the documents' sources"
            raise invalid(name, message, "unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise invalid("n", f"only one choice is generated (n=1), got n={body['n']!r}", "unsupported_parameter")
    if body.get("logprobs"):
        raise invalid("logprobs", "logprobs are not available", "unsupported_parameter")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise invalid("response_format", "only text responses are supported", "unsupported_parameter")

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options", 'stream_options takes {"include_usage": true|false} only')
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise invalid("stream_options.include_usage", "include_usage must be true or false")

    max_tokens = _positive_int(body, "max_tokens")
    max_completion_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise invalid("max_completion_tokens", "max_tokens and max_completion_tokens differ: give one of them")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= speculative.TEMPERATURE_MAX
    ):
        raise invalid("temperature", f"temperature must be a number from 0 to 2, got {temperature!r}")
    unverified_tokens = body.get("unverified_tokens", False)
    if not isinstance(unverified_tokens, bool):
        raise invalid("unverified_tokens", f"unverified_tokens must be true or false, got {unverified_tokens!r}")
    if unverified_tokens and not stream:
        raise invalid("unverified_tokens", "unverified_tokens is only allowed when stream is true")
    options = speculative.parse(body)
    return ChatRequest(
        model=model.strip(),
        question=question,
        history=history,
        stream=bool(stream),
        include_usage=include_usage,
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        temperature=speculative.temperature_for(options, temperature),
        speculative=options,
        unverified_tokens=unverified_tokens,
    )


# --------------------------------------------------------------------------- the answer


@dataclass
class Started:
    """An answer on its way, and what the response reports about it."""

    answer: Answer
    model: str  # the route's name, or "extractive"
    created: int  # Unix seconds


def chat_models() -> list[tuple[str, Route | None]]:
    """The model ids a chat completion answers to, as ``GET /v1/models`` lists them: each
    enabled route by its name, then the default route again under its model's id, or
    ``extractive`` (None) when there is no default route."""
    routes = sorted(
        Route.objects.filter(enabled=True, provider__enabled=True).select_related("provider"), key=lambda r: r.name
    )
    models = [(route.name, route) for route in routes]
    default = next((route for route in routes if route.is_default), None)
    if default is None:
        models.append((EXTRACTIVE_MODEL, None))
    elif default.provider.model not in {name for name, _ in models}:
        models.append((default.provider.model, default))
    return models


def _planned(model: str, client_id: str, speculative_options: dict | None) -> tuple[str | None, router.Plan | None]:
    """The route a chat request's ``model`` names (None: the default one) and its plan, made
    once for the request (``answer_create`` takes it); ``OpenAIError`` 404 ``model_not_found``
    for a model nothing serves. A route's name, the default route's model id and
    ``extractive`` (the default route, else an extractive answer) are served. The plan is
    None where ``answer_create`` must plan again to tell why: no route or a warming pool
    (extractive), a disabled route or speculation no endpoint serves (the answer fails with
    the reason)."""
    route_name = None if model == EXTRACTIVE_MODEL else model
    try:
        return route_name, router.plan(route_name=route_name, client_id=client_id, speculative=speculative_options)
    except (NoRouteConfigured, PoolWarming, SpeculationUnavailable):
        return route_name, None
    except RouteNotFound as exc:
        if route_name is None:
            raise from_domain(exc) from None
    # Not an enabled route's name (the rare path: these queries are not on the usual one).
    if Route.objects.filter(name=model).exists():
        return route_name, None  # disabled: answer_create refuses it with its reason
    served = chat_models()
    if any(name == model for name, _ in served):  # the default route's model id
        return _planned(EXTRACTIVE_MODEL, client_id, speculative_options)
    raise model_not_found(model, [name for name, _ in served])


# answer_create's fields -> the request's (the collections are the key's: none to name).
_PARAMS = {"question": "messages", "collections": None}


def answer_start(key: ClientKey, chat: ChatRequest, *, request=None) -> Started:
    """Start the answer (synchronous: the database and the router); ``OpenAIError`` when it is
    refused. The question goes to the audit log (ragsite.audit), with ``request``'s client."""
    options = speculative.wanted(chat.speculative)
    client_id = conversations.client_id_of(key=key)
    route_name, plan = _planned(chat.model, client_id, options)
    try:
        answer = answers.answer_create(
            workspace=key.workspace,
            question=chat.question,
            client_key=key,
            client_id=client_id,
            route_name=route_name,
            max_tokens=chat.max_tokens,
            temperature=chat.temperature,
            speculative=options,
            plan=plan,
            history=chat.history,
            reader=reader_of_key(key),  # the user or group it acts for, else its workspace
        )
    except answers.AnswerError as exc:
        _asked_audit(key, chat, request, outcome="refused", reason=exc.message)
        param = _PARAMS.get(exc.field, exc.field)
        if exc.field == "max_tokens" and chat.max_tokens is None:
            param = None  # the route's own max_tokens: not the client's doing
        raise from_domain(exc, param=param) from None
    # A route, speculation the canary's endpoints cannot serve, no usable key, a key's limits.
    except DomainError as exc:
        _asked_audit(key, chat, request, outcome="refused", reason=exc.message)
        raise from_domain(exc) from None
    _asked_audit(key, chat, request, answer=answer)
    served = answer.plan
    generated = answer.mode == Answer.Mode.GENERATED and served is not None
    model = served.requested_route.name if generated else EXTRACTIVE_MODEL
    return Started(answer=answer, model=model, created=int(answer.created_at.timestamp()))


def _asked_audit(key: ClientKey, chat: ChatRequest, request, *, answer=None, outcome="ok", reason="") -> None:
    detail = {"question": chat.question, **({"reason": reason} if reason else {})}
    target = f"answer:{answer.pk}" if answer is not None else ""
    audit_record(
        Action.ASK,
        key=key,
        request=request,
        workspace_id=key.workspace_id,
        target=target,
        outcome=outcome,
        detail=detail,
    )


async def completion_events(started: Started, *, unverified: bool = False) -> AsyncIterator[tuple[str, dict]]:
    """``search.answering.answers.answer_events`` as a completion needs them: ``delta`` (the
    verified text; the model's tokens, marked, with ``unverified``), then ``stats``
    or ``error``; ``stats`` comes once the answer is stored (its citations checked), with
    the stored answer as ``stats["answer"]`` (``search.answering.answers.answer_record``);
    ``("keepalive", {})`` after each quiet slice (and for map-reduce progress). Retry
    announcements are skipped. A stream quiet for longer than a request can take
    (``ROUTER_DEADLINE_S`` plus the time a request may wait in its queue) ends with an
    ``error`` of kind ``timeout``."""
    generation: dict = {}
    events = answers.answer_events(
        started.answer.id,
        slice_ms=READ_SLICE_MS,
        # The first read knows the answer is generating (it was just started).
        generating=started.answer.status == Answer.Status.GENERATING,
        quiet_limit_s=settings.ROUTER_DEADLINE_S + limits.RESERVATION_MARGIN_S,
        raw=unverified,
    )
    async with aclosing(events):
        async for event in events:
            if event.kind in ("delta", "error"):
                yield event.kind, event.data
                if event.kind == "error":
                    return
            elif event.kind == "stats":
                generation = event.data  # the stored answer follows once its citations are checked
            elif event.kind == "answer":
                yield "stats", {**generation, "answer": event.data}
                return
            elif event.kind in ("progress", answers.QUIET):
                yield "keepalive", {}


# --------------------------------------------------------------------------- the OpenAI shapes


def _speculative_stats(answer: Answer, stats: dict) -> dict | None:
    """What the serving engine reported of its speculative decoding for this answer
    (``inference.remote.speculative_report``), or None where it reported nothing: an engine
    that does not speculate, an upstream that does not say, an extractive answer."""
    if answer.mode == Answer.Mode.EXTRACTIVE:
        return None
    return stats.get("speculative")


class ChatCompletion:
    """The OpenAI objects of one answer: ``chat.completion`` or its chunks."""

    def __init__(self, started: Started):
        self.answer = started.answer
        self.base = {"id": f"chatcmpl-{started.answer.id}", "created": started.created, "model": started.model}
        self.text: list[str] = []

    def content(self, stats: dict) -> str:
        """The answer's text: as stored (its citations checked), else as streamed."""
        stored = stats.get("answer")
        return stored["text"] if stored else "".join(self.text)

    def citations(self, stats: dict) -> list[dict]:
        stored = stats.get("answer")
        if stored is not None:
            cited = stored["citations"]
        elif self.answer.mode == Answer.Mode.EXTRACTIVE:
            cited = self.answer.citations
        else:
            cited, _ = prompting.citations_resolve("".join(self.text), self.answer.sources)
        keys = ("number", "document_id", "chunk_id", "title", "start_offset", "end_offset")
        return [{key: citation.get(key) for key in keys} for citation in cited]

    def extras(self, stats: dict) -> dict:
        """The fields OpenAI does not have: sources cited, what the citation check found (each
        sentence's span in ``verified_content``, its support), speculation, inference time."""
        if self.answer.mode == Answer.Mode.EXTRACTIVE:
            inference_ms = self.answer.timings.get("prompt_ms")
        else:
            inference_ms = stats.get("total_ms")
        stored = stats.get("answer") or {}
        return {
            # What retrieval searched for: the question, or the follow-up read with the turns before it.
            "retrieval_query": self.answer.retrieval_query,
            "citations": self.citations(stats),
            "abstained": stored.get("abstained", False),
            "grounded": stored.get("grounded"),
            "sentences": stored.get("sentences", []),
            "verified_content": stored.get("text"),
            "speculative": _speculative_stats(self.answer, stats),
            "inference_time_ms": inference_ms,
        }

    @staticmethod
    def usage(stats: dict) -> dict:
        prompt, completion = int(stats.get("prompt_tokens") or 0), int(stats.get("completion_tokens") or 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def finish_reason(stats: dict) -> str:
        reason = stats.get("finish_reason")
        return reason if reason in FINISH_REASONS else "stop"

    def completion(self, stats: dict) -> dict:
        return {
            **self.base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.content(stats), "refusal": None},
                    "logprobs": None,
                    "finish_reason": self.finish_reason(stats),
                }
            ],
            "usage": self.usage(stats),
            **self.extras(stats),
        }

    def chunk(self, delta: dict, finish_reason: str | None = None, *, include_usage: bool, **extra) -> dict:
        if delta.get("content"):
            self.text.append(delta["content"])
        return {
            **self.base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            **({"usage": None} if include_usage else {}),
            **extra,
        }

    def usage_chunk(self, stats: dict) -> dict:
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": self.usage(stats)}
