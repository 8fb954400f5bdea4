"""Answers: a question, the retrieved chunks, a routed generation, the stored cited answer.

``answer_create`` is the one entry point (UI, REST API, OpenAI-compatible endpoint):

1. validates the question (``AnswerError`` names the field) and the collections
   (``search.scoping.collections_chosen``);
2. asks the router for a route and canary arm (``inference.router.plan``, request id = the
   answer's id), unless the caller brings the plan it made;
3. retrieves with ``chunk_search`` (hybrid) and builds the prompt within the serving
   provider's context window (``search.answering.prompting``);
4. stores the ``Answer`` (``generating``, one INSERT with its links to the collections: a
   row and then its update were two round trips before the first token), submits the
   generation (``inference.router.submit``, queue ``gpu`` or ``remote``) with its outcome
   addressed to this answer, and returns the answer.

A request refused on the way (a route, speculative options, the prompt, the key's limits,
no usable key) is stored ``failed`` with its reason, and the error propagates.

The tokens stream into ``gen:<answer id>`` (``answer_stream_read``). When the generation
ends, however it ends, its outcome comes back once, in its ledger entry: the ledger's drain
(queue ``default``) stores the row and calls ``generation_outcome_take``, the consumer this
module registers for answers, and ``answer_finalize`` checks the text's citations against the
passages given (``search.answering.verification``: invented markers removed, sentences re-attributed
or given their citation, unsupported ones flagged; nothing supported: the answer abstains),
stores the text, its citations, the generation stats and the timings, marks the answer
``done`` or ``failed`` with the reason, and ends the stream with the stored answer
(``answer`` event, ``ANSWER_END``). Retrieval that does not answer the question abstains
before any generation (``search.answering.abstention``). docs/answers.md.

Without a configured route (``NoRouteConfigured``) the answer is extractive: the best
sentences of the top chunks, each with its ``[n]``, written to the same stream (deltas,
then ``stats``) and stored ``done`` at once with ``mode = extractive``. A named route that
does not exist (``RouteNotFound``) or cannot serve now (``RouteUnavailable``) fails the
answer with the reason and propagates, for the API to answer 400 or 503.

When one source alone is larger than the window, the answer is built by map-reduce (see
``search.answering.prompting``): the map requests are submitted in parallel, their outcomes addressed
to ``answer_map_collect``; the last one in submits the reduce request under the answer's own
id, whose outcome goes to ``answer_finalize`` as usual. A map request that fails fails the
answer at once, with its reason: an answer from part of its sources would not say so.
"""

from __future__ import annotations

import copy
import logging
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from datetime import timedelta

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import ledger, limits
from billing.limits import LimitExceeded
from billing.models import ClientKey
from inference import observers, router
from inference.errors import NoRouteConfigured, PoolWarming, RouteNotFound, RouteUnavailable, SpeculationUnavailable
from inference.models import Provider, Route
from inference.remote import trim_repetition
from inference.streams import StreamWriter, stream_aread, stream_key, stream_read
from ragsite import metrics, rows
from ragsite.errors import DomainError
from ragsite.logs import request_received_at
from ragsite.outages import outage_of
from ragsite.redis import Role, redis_async_client, redis_client
from search import analysis
from search.access import WORKSPACE, Reader, documents_unreadable
from search.answering import abstention, conversations, prompting, reranking, rewriting, wording
from search.answering.extractive import extractive_answer
from search.answering.streaming import OUTCOME_KIND, SENTENCE, Checking, checking_of, scoring, scoring_collection
from search.answering.verification import Verification
from search.embedders import DEFAULT_EMBEDDER
from search.models import Answer, Collection, Conversation, Workspace
from search.scoping import collections_chosen
from search.selectors import SearchError, chunk_search

logger = logging.getLogger(__name__)

QUESTION_MAX_CHARS = 4000
TOP_K_MAX = 50
# An answer still unfinished this long after it was asked lost its generation's message (a
# Redis that lost its queue): ``answers_reap`` fails it. Every other end reaches the answer
# through its ledger entry.
ANSWER_LOST_AFTER_S = 3600
# An answer's stream ends, for its readers, with the stored answer (``answer``: the text as
# verified, its citations and each sentence's support) or an ``error``; the generation's own
# ``stats`` comes before it.
ANSWER_END = ("answer", "error")


class AnswerError(DomainError, ValueError):
    """A request that cannot be answered as asked; ``field`` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(message, field=field)


# --------------------------------------------------------------------------- create


def answer_create(
    *,
    workspace: Workspace,
    question: str,
    collections: Iterable[Collection | int] | None = None,
    asker=None,
    client_id: str = "",
    route_name: str | None = None,
    top_k: int = 8,
    max_tokens: int | None = None,
    temperature: float | None = None,
    client_key=None,
    speculative: dict | None = None,
    plan: router.Plan | None = None,
    conversation: Conversation | None = None,
    history: list[conversations.Turn] | None = None,
    documents_excluded: Iterable[int] = (),
    reader: Reader = WORKSPACE,
) -> Answer:
    """Answer ``question`` from ``collections`` (default: all of the workspace's); see the module docstring.

    ``conversation``: the caller's conversation (``conversations.conversation_of``) this
    question continues: its earlier turns are the history. ``history``: the earlier turns as
    the caller holds them (an OpenAI ``messages`` list), for a new conversation of its own.
    Neither: the first question of a new conversation. With a history the question is read
    as a follow-up (``conversations.followup_terms``; ``answer.retrieval_query`` is what was
    retrieved for, ``stats["followup"]`` how) and the turns go into the prompt.

    ``client_id``: whose canary arm applies, and who owns a new conversation; defaults to the
    ``client_key``'s when one asks, else the asker's (``conversations.client_id_of``).
    ``client_key``: the API key asking (``billing.models.ClientKey``): each generation
    request is admitted against its limits first (``billing.limits``) and billed to it; an
    extractive answer is admitted against them too, and costs nothing.
    ``speculative``: this request's speculative options (``{"enabled", "draft_model", "k"}``),
    which choose the endpoint that serves it (``inference.router.plan``); None: the route's.
    ``documents_excluded``: ids of documents retrieval leaves out, as if they were not there
    (``eval_answers --removed-source``: a question whose own passage is gone).
    ``reader``: who asks (search.access): retrieval reads only what it may read, and an earlier
    turn's answer that cites a document it may no longer read is left out of the history.
    ``plan``: the caller's ``router.plan`` for this request (``route_name``, ``client_id`` and
    ``speculative`` as given here), taken instead of planning again; None: planned here. The
    plan that served is ``answer.plan`` on the returned instance (None when extractive).
    Returns the stored answer: ``generating`` (follow ``answer_stream_read``), or ``done``
    when extractive. Raises ``AnswerError``, ``CollectionNotFound``, ``RouteNotFound``,
    ``SpeculationUnavailable`` (before any retrieval), ``RouteUnavailable`` or
    ``billing.limits.LimitExceeded``.
    """
    question = (question or "").strip()
    if not question:
        raise AnswerError("question", "the question is empty")
    if len(question) > QUESTION_MAX_CHARS:
        raise AnswerError(
            "question", f"the question is {len(question)} characters long, over the limit of {QUESTION_MAX_CHARS}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= TOP_K_MAX:
        raise AnswerError("top_k", f"top_k must be an integer from 1 to {TOP_K_MAX}, got {top_k!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise AnswerError("max_tokens", f"max_tokens must be a positive integer, got {max_tokens!r}")
    if temperature is not None and not (isinstance(temperature, int | float) and temperature >= 0):
        raise AnswerError("temperature", f"temperature must be a number >= 0, got {temperature!r}")
    chosen = collections_chosen(workspace, collections)
    client_id = (client_id or conversations.client_id_of(key=client_key, user=asker))[:100]

    started = time.perf_counter()
    # Built here, stored once it is planned and prompted (``_answer_store``): one INSERT on
    # the way to the first token rather than an INSERT and an UPDATE. ``created_at`` is now.
    if conversation is None:
        conversation = Conversation(workspace=workspace, owner=asker, client_id=client_id)
        conversation.title = conversations.title_from(question)
    elif history is not None:
        raise AnswerError("history", "give a conversation or a history, not both")
    elif conversation.workspace_id != workspace.pk:
        raise AnswerError("conversation", "the conversation is not in this workspace")
    else:
        history = conversations.history_of(conversation, reader=reader)
    answer = Answer(workspace=workspace, asker=asker, client_id=client_id, question=question, retrieval_query=question)
    answer.conversation = conversation
    answer.history = history or []  # for this call only: the turns the question is read with
    received = request_received_at()
    if received is not None:  # from the request's arrival to here: authentication, parsing, the route
        answer.timings["request_ms"] = round(max(0.0, answer.created_at.timestamp() - received) * 1000, 2)
    answer.client_key = client_key  # for this call only; the ledger rows record it
    answer.chosen_collections = chosen  # likewise: linked when the row is stored
    answer.documents_excluded = list(documents_excluded)  # likewise
    answer.reader = reader  # likewise
    try:
        return _answer_run(answer, chosen, route_name, top_k, max_tokens, temperature, started, speculative, plan)
    except Exception as exc:
        _answer_failed(answer, _reason(exc))
        raise


def _answer_store(answer: Answer) -> None:
    """Save the answer; the first time, insert it with its links to the collections asked:
    for a first question, with its new conversation, in one statement (on every request's
    way to its first token: a transaction of three INSERTs was four round trips); for a
    follow-up, in one transaction with its conversation's new turn."""
    if not answer._state.adding:
        answer.save()
        return
    conversation = answer.conversation
    new_conversation = conversation._state.adding
    links = [
        Answer.collections.through(answer_id=answer.pk, collection_id=collection.pk)
        for collection in answer.chosen_collections
    ]
    try:
        if new_conversation:  # a first question (every OpenAI-compatible request): one statement
            conversation.created_at = conversation.updated_at = answer.created_at
            rows.insert_together([conversation], [answer], links)
            return
        with transaction.atomic():
            conversations.turn_started(conversation, answer.question, at=answer.created_at)
            rows.insert_together([answer], links)
    except BaseException:
        answer._state.adding = True  # rolled back: still not stored
        conversation._state.adding = new_conversation
        raise


def _answer_failed(answer: Answer, reason: str) -> None:
    """An answer that could not be started keeps its reason: stored failed, or marked so."""
    if not answer._state.adding:
        answer_fail(answer.pk, reason)
        return
    answer.status, answer.error, answer.finished_at = Answer.Status.FAILED, reason, timezone.now()
    try:
        _answer_store(answer)
    except Exception:  # the database is what failed: the caller's error says why
        logger.warning("answer %s could not be stored failed (%s)", answer.pk, reason, exc_info=True)


def _reason(exc: Exception) -> str:
    if isinstance(
        exc,
        AnswerError | RouteNotFound | RouteUnavailable | SpeculationUnavailable | LimitExceeded,
    ):
        return str(exc)
    return f"the answer could not be started: {type(exc).__name__}: {exc}"


def _answer_run(answer, collections, route_name, top_k, max_tokens, temperature, started, speculative, plan) -> Answer:
    why_extractive = None
    warming = None  # the route whose pool is starting, if that is why nothing generates
    if plan is not None:  # made by the caller for this request: the same choice, not planned twice
        plan = replace(plan, request_id=str(answer.id))
    else:
        try:
            plan = router.plan(
                route_name=route_name, client_id=answer.client_id, request_id=str(answer.id), speculative=speculative
            )
        except PoolWarming as exc:
            why_extractive = wording.MODEL_STARTING
            warming = exc.route
        except NoRouteConfigured:
            why_extractive = wording.NO_MODEL
    language = analysis.language_of(answer.question)
    route = plan.route if plan is not None else warming
    if route is not None and not route.answers_in(language):
        # The route's model does not write this language (started or not): the sources' own
        # sentences answer, and the answer says that is why.
        why_extractive = wording.LANGUAGE_NOT_SPOKEN.format(language=wording.LANGUAGE_NAMES.get(language, language))
        plan = None
    answer.plan = plan  # for this call only: the caller reports what serves it
    client_key = getattr(answer, "client_key", None)
    if plan is None and client_key is not None:
        _admit_extractive(client_key, answer.question)

    if plan is not None:  # past saturation, refused before it costs a search (stored failed, as at the publish)
        router.capacity_check(plan)

    if answer.history and collections:
        reading = _followup_read(answer, collections, plan, client_key, temperature)
        answer.retrieval_query = reading.query
        answer.stats["followup"] = reading.as_record()
    retrieve_started = time.perf_counter()
    if collections:
        try:
            sources = sources_retrieved(
                answer.retrieval_query,
                workspace=answer.workspace,
                collections=collections,
                top_k=top_k,
                documents_excluded=answer.documents_excluded,
                reader=answer.reader,
                stats=answer.stats,
            )
        except SearchError as exc:
            raise AnswerError("collections", str(exc)) from None
    else:
        sources = []  # a workspace without collections: nothing to retrieve, no statement sent
    answer.timings["retrieve_ms"] = _ms_since(retrieve_started)

    first = scoring_collection(collections, language)
    if plan is None:
        return _answer_extractive(answer, sources, first, started, why=why_extractive)
    # Sources that do not answer the question are not given to a model, which would answer
    # from them anyway: the answer declines at once, with the closest passages.
    # A route that never abstains does not pay for the judgement on its requests' path.
    if plan.route.abstains:
        relevance_started = time.perf_counter()
        relevance = abstention.relevance(
            answer.retrieval_query,
            sources,
            **scoring(first),
        )
        answer.timings["relevance_ms"] = _ms_since(relevance_started)
        answer.stats["relevance"] = round(relevance.score, 4)
        answer.stats.update(relevance.decided_by())
        if relevance.abstain:
            return _answer_abstained(answer, sources, relevance.closest, started, mode=Answer.Mode.GENERATED)

    prompt_started = time.perf_counter()
    try:
        budget = prompting.prompt_budget_for(plan.route, max_tokens=max_tokens)
        turns = [(turn.question, turn.answer) for turn in answer.history if turn.answer]
        prompt = prompting.prompt_plan(answer.question, sources, budget, plan.route.system_prompt, history=turns)
    except prompting.PromptTooLong as exc:
        raise AnswerError(exc.field, str(exc)) from None
    answer.timings["prompt_ms"] = _ms_since(prompt_started)
    answer.sources = [source.as_record() for source in prompt.sources]
    answer.route, answer.release, answer.arm = plan.route, plan.release, plan.arm
    answer.mode, answer.status = Answer.Mode.GENERATED, Answer.Status.GENERATING
    answer.stats = {
        "context": prompt.context_record(),
        **{k: v for k, v in answer.stats.items() if k in ("relevance", "reader", "reader_unavailable", "followup")},
    }
    common = {
        "temperature": temperature,
        "workspace_id": answer.workspace_id,
        "user_id": answer.asker_id,
        "client_key_id": client_key.pk if client_key is not None else None,
    }
    if prompt.strategy == "single":
        [request] = prompt.requests
        answer.timings["submit_ms"] = _ms_since(started)
        _answer_store(answer)
        _submit_admitted(client_key, plan, request, outcome_to=_to_answer(answer.id), **common)
        return answer

    maps = [
        {"request_id": str(uuid.uuid4()), "sources": request.source_numbers, "status": "pending"}
        for request in prompt.requests
    ]
    answer.stats["map_reduce"] = {
        "requested_route_id": plan.requested_route.id,
        "max_tokens": budget.max_tokens,
        "temperature": temperature,
        "client_key_id": common["client_key_id"],
        "speculative": plan.speculative,
        "provider_id": plan.provider.id,  # the endpoint the options chose: the reduce goes there too
        "maps": maps,
    }
    _answer_store(answer)
    # Long work shows progress: the answer's own stream says how far the map requests are.
    StreamWriter(str(answer.id)).write("progress", stage="map", done=0, total=len(maps))
    for index, (request, entry) in enumerate(zip(prompt.requests, maps, strict=True)):
        _submit_admitted(
            client_key,
            replace(plan, request_id=entry["request_id"]),
            request,
            outcome_to={"kind": OUTCOME_KIND, "answer_id": str(answer.id), "map": index},
            **common,
        )
    return answer


def sources_retrieved(
    question: str,
    *,
    workspace,
    collections,
    top_k: int,
    documents_excluded: Sequence[int] = (),
    reader: Reader = WORKSPACE,
    stats: dict | None = None,
) -> list[prompting.Source]:
    """The ``top_k`` chunks that answer ``question`` (hybrid search), numbered.

    A question in parts ("2025年度第3四半期と2026年度第2四半期の売上高をそれぞれ", "What is X, and
    how long is Y?") is also searched part by part, and the lists are interleaved rank by rank
    after the whole question's: each part's best passages are among the sources even when the
    whole question's top ``top_k`` all answer one part. With ``SEARCH_RERANK_TOP``, the whole
    question's first candidates are reordered by the reader first (``stats["rerank"]`` says
    what was done)."""
    parts = abstention.question_parts(question)
    queries = [question, *parts] if len(parts) > 1 else [question]
    rerank_top = settings.SEARCH_RERANK_TOP
    rankings = [
        chunk_search(
            query=query,
            workspace=workspace,
            collection_ids=collections,  # chosen when it was asked: no second query
            mode="hybrid",
            top_k=max(top_k, rerank_top) if index == 0 else top_k,
            snippets=False,
            syntax="question",  # a question's quotation marks quote; they do not filter
            documents_excluded=list(documents_excluded),
            reader=reader,
        ).hits
        for index, query in enumerate(queries)
    ]
    if rerank_top:
        result = reranking.reranked(question, rankings[0], rerank_top)
        rankings[0] = result.hits
        if stats is not None:
            stats["rerank"] = result.as_record()
    hits, seen = [], set()
    for rank in range(top_k):
        for ranking in rankings:
            if rank < len(ranking) and ranking[rank].chunk_id not in seen and len(hits) < top_k:
                seen.add(ranking[rank].chunk_id)
                hits.append(ranking[rank])
    return prompting.sources_from_hits(hits)


def _followup_read(answer, collections, plan, client_key, temperature) -> conversations.FollowupReading:
    """How a follow-up is retrieved for: rewritten by the plan's model when there is one
    (``search.answering.rewriting``), else, or when the rewrite fails or is late, the term-based
    reading, which then says why the rewrite was not used."""
    fallback, rewrite_ms = "", None
    if plan is not None and settings.FOLLOWUP_REWRITE:
        started = time.perf_counter()
        try:
            query = rewriting.followup_rewrite(
                answer.question,
                answer.history,
                plan,
                lambda planned, request, **submit: _submit_admitted(client_key, planned, request, **submit),
                workspace_id=answer.workspace_id,
                user_id=answer.asker_id,
                client_key_id=client_key.pk if client_key is not None else None,
            )
            answer.timings["rewrite_ms"] = _ms_since(started)
            return conversations.FollowupReading(query=query, method="model", rewrite_ms=answer.timings["rewrite_ms"])
        except rewriting.RewriteFailed as exc:
            fallback, rewrite_ms = str(exc), _ms_since(started)
            answer.timings["rewrite_ms"] = rewrite_ms
            logger.info("answer %s: follow-up read by its terms: %s", answer.id, fallback)
    reading = conversations.followup_terms(answer.question, answer.history, collections)
    return replace(reading, fallback=fallback, rewrite_ms=rewrite_ms)


def _admit_extractive(client_key: ClientKey, question: str) -> None:
    """An answer no model generates has no generation to admit: it is admitted here against
    the key's limits (it counts against its requests per minute like any other), and
    released at once, since it costs nothing."""
    admission = limits.admission_reserve(
        client_key,
        model=DEFAULT_EMBEDDER,
        local=True,
        prompt_tokens=prompting.RemoteEstimate.text(question),
        max_tokens=0,
    )
    limits.admission_release(admission)


def _submit_admitted(client_key, plan: router.Plan, request, **submit) -> None:
    """``router.submit`` the request, admitted first against the client key's limits
    (its reservation travels with it and is settled with its ledger row); released if it
    could not be sent."""
    if client_key is None:
        router.submit(plan, messages=request.messages, max_tokens=request.max_tokens, **submit)
        return
    provider = plan.provider
    admission = limits.admission_reserve(
        client_key,
        model=provider.model,
        local=provider.is_local,
        prompt_tokens=request.prompt_tokens,
        max_tokens=request.max_tokens,
    )
    try:
        router.submit(
            plan, messages=request.messages, max_tokens=request.max_tokens, admission=admission.as_json(), **submit
        )
    except BaseException:
        limits.admission_release(admission)
        raise


def _answer_extractive(answer: Answer, sources, collection: Collection | None, started: float, *, why: str) -> Answer:
    """The answer from the sources' own sentences, scored with ``collection``'s embedding
    model and text-search configuration (``_scoring_collection``). ``why``: why no model
    generates it, said in its first line, in the question's language."""
    extract_started = time.perf_counter()
    language = analysis.language_of(answer.question)
    extractive = extractive_answer(
        answer.retrieval_query or answer.question,
        sources,
        **scoring(collection),
        lead=wording.said("extracted", language, why=wording.why_said(why, language)),
        language=language,
    )
    answer.timings["prompt_ms"] = _ms_since(extract_started)
    answer.stats.update(extractive.decided_by)
    if extractive.abstained:
        answer.stats["relevance"] = extractive.relevance
        return _answer_abstained(
            answer, sources, extractive.closest, started, mode=Answer.Mode.EXTRACTIVE, text=extractive.text
        )
    by_number = {source.number: source for source in sources}
    cited = []
    for extract in extractive.extracts:
        if extract.number not in {c["number"] for c in cited}:
            record = by_number[extract.number].as_record()
            cited.append({key: record[key] for key in _CITATION_KEYS})
    answer.mode, answer.status = Answer.Mode.EXTRACTIVE, Answer.Status.DONE
    answer.sources = [source.as_record() for source in sources]
    answer.text = extractive.text
    answer.citations = cited
    answer.dropped_citations = 0
    # Quoted sentences are their sources' own words: each is supported by the passage it cites.
    answer.grounded = 1.0 if extractive.extracts else None
    answer.timings["total_ms"] = _ms_since(started)
    answer.stats = {
        **{k: v for k, v in answer.stats.items() if k == "followup"},
        "mode": Answer.Mode.EXTRACTIVE.value,
        "why": why,
        "sentences": len(extractive.extracts),
        "scores": [extract.score for extract in extractive.extracts],
        "relevance": extractive.relevance,
        **extractive.decided_by,
    }
    answer.finished_at = timezone.now()
    _answer_store(answer)
    metrics.answer_checked(answer.mode, answer.grounded, answer.abstained)
    _stream_stored(answer)
    return answer


def _answer_abstained(answer: Answer, sources, closest: list[dict], started: float, *, mode, text: str = "") -> Answer:
    """The sources do not answer the question: one plain sentence and the closest passages,
    stored ``done`` and ``abstained`` without any generation."""
    by_number = {source.number: source for source in sources}
    text = text or abstention.declined_text(closest, analysis.language_of(answer.question))
    answer.mode, answer.status, answer.abstained = mode, Answer.Status.DONE, True
    answer.sources = [source.as_record() for source in sources]
    answer.text = text
    cited = [by_number[c["number"]].as_record() for c in closest if c["number"] in by_number]
    answer.citations = [{key: record[key] for key in _CITATION_KEYS} for record in cited]
    answer.dropped_citations = 0
    answer.grounded = None
    answer.timings["total_ms"] = _ms_since(started)
    answer.stats = {
        **answer.stats,
        "mode": Answer.Mode(mode).value,
        "abstained": True,
        "closest": closest,
    }
    answer.finished_at = timezone.now()
    _answer_store(answer)
    metrics.answer_checked(answer.mode, answer.grounded, answer.abstained)
    _stream_stored(answer)
    return answer


def _stream_stored(answer: Answer) -> None:
    """An answer stored at once (extractive, abstained) on its stream, in the protocol of a
    generation: its text (one ``sentence`` event per line: nothing here is unverified),
    ``stats``, then the stored ``answer``."""
    try:
        writer = StreamWriter(str(answer.id))
        lines = answer.text.split("\n")
        for index, line in enumerate(lines):
            writer.write(SENTENCE, text=line if index == len(lines) - 1 else line + "\n")
        writer.write("stats", **answer.stats)
        writer.write("answer", **answer_record(answer))
    except redis.RedisError as exc:  # the stored answer stands; readers fall back to it
        logger.warning("answer %s not streamed: %s", answer.id, exc)


def answers_readable(answers: Iterable[Answer], reader: Reader) -> list[Answer]:
    """The answers as ``reader`` may see them (search.access): one whose sources include a
    document it may not read (someone else's answer, or its own before it lost access) keeps
    its question and status, and loses its text, sources, citations and checks (``withheld``
    set; a copy, never saved). Its passages must not reach anyone their document leaves out."""
    answers = list(answers)
    unreadable = documents_unreadable(
        {source["document_id"] for answer in answers for source in answer.sources or ()}, reader
    )
    shown = []
    for answer in answers:
        if any(source["document_id"] in unreadable for source in answer.sources or ()):
            answer = copy.copy(answer)
            # Said in the question's language, as the answer's other sentences about itself are.
            answer.text = wording.said("withheld", analysis.language_of(answer.question))
            answer.sources, answer.citations = [], []
            answer.verification, answer.grounded, answer.retrieval_query = {}, None, answer.question
            answer.stats = {key: value for key, value in answer.stats.items() if key in _STATS_WITHOUT_TEXT}
            answer.withheld = True
        shown.append(answer)
    return shown


# Figures of an answer that hold none of its passages' words (its other stats may: the
# follow-up's query, the quoted sentences' scores beside them...).
_STATS_WITHOUT_TEXT = frozenset({"prompt_tokens", "completion_tokens", "total_tokens", "cost_usd"})


def answer_record(answer: Answer) -> dict:
    """What readers get at the end of an answer's stream: the stored text and what was checked."""
    return {
        "status": answer.status,
        "mode": answer.mode,
        "text": answer.text,
        "citations": answer.citations,
        "dropped_citations": answer.dropped_citations,
        "abstained": answer.abstained,
        "grounded": answer.grounded,
        "sentences": (answer.verification or {}).get("sentences", []),
    }


_CITATION_KEYS = ("number", "chunk_id", "document_id", "title", "start_offset", "end_offset")


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


# --------------------------------------------------------------------------- end of generation


def answer_fail(answer_id, reason: str, *, end_stream: bool = False) -> None:
    """Mark an unfinished answer failed. ``end_stream``: also end its (empty) stream with an
    ``error`` event, for readers already waiting (no generation will write to it)."""
    Answer.objects.filter(pk=answer_id).exclude(status__in=[Answer.Status.DONE, Answer.Status.FAILED]).update(
        status=Answer.Status.FAILED, error=reason, finished_at=timezone.now()
    )
    if end_stream:
        writer = StreamWriter(str(answer_id))
        if writer.history()[1] not in ANSWER_END:
            writer.write("error", field=None, kind="answer_failed", message=reason)


def _stream_times(request_id: str) -> tuple[float | None, float | None]:
    """Unix ms of the stream's first ``delta`` and of its last event (Redis stream ids are
    the server's clock in ms)."""
    client = redis_client(Role.STREAMS)
    key = stream_key(request_id)
    first_delta = None
    for event_id, fields in client.xrange(key, count=50):
        if fields[b"type"] == b"delta":
            first_delta = float(event_id.split(b"-")[0])
            break
    last = client.xrevrange(key, count=1)
    return first_delta, (float(last[0][0].split(b"-")[0]) if last else None)


def _to_answer(answer_id) -> dict:
    return {"kind": OUTCOME_KIND, "answer_id": str(answer_id)}


def _outcome_read(outcome: dict) -> dict:
    """``{text, stats, error, route, provider, attempts}`` of a generation's outcome
    (``inference.execution.Outcome.result``)."""
    failed = outcome.get("status") == "error"
    return {
        "text": outcome.get("text") or "",
        "stats": outcome.get("stats") or {},
        "error": (outcome.get("error") or {"message": "the generation failed"}) if failed else None,
        "route": outcome.get("route"),
        "provider": outcome.get("provider"),
        "attempts": outcome.get("attempts"),
    }


@ledger.outcome_consumer(OUTCOME_KIND)
def generation_outcome_take(outcome: dict) -> None:
    """The consumer of outcomes addressed to answers (``billing.ledger`` calls it after the
    generation's ledger row is stored): the answer finalized,
    or one map request's notes collected. Idempotent. A transient database or Redis error is
    raised (the entry is taken again later); anything else fails the answer with its reason,
    so that no answer stays ``generating``."""
    to = outcome.get("to") or {}
    answer_id = to.get("answer_id")
    try:
        if to.get("map") is not None:
            answer_map_collect(answer_id=answer_id, index=int(to["map"]), outcome=outcome)
        else:
            answer_finalize(answer_id=answer_id, outcome=outcome)
    except Exception as exc:
        if outage_of(exc):  # the database or Redis away: the entry stays pending, claimed later
            raise
        # A bug must not leave the answer generating for ever.
        logger.exception("answer %s: the outcome of %s could not be stored", answer_id, outcome.get("request_id"))
        answer_fail(answer_id, f"the answer could not be stored: {type(exc).__name__}", end_stream=True)


def answer_finalize(*, answer_id, outcome: dict) -> Answer | None:
    """Store the end of an answer's generation (``outcome``: ``Outcome.result``). Idempotent:
    a finished answer is left as it is. Once stored, the answer is written to its stream as
    its last event (``answer``)."""
    answer, stored_now = _finalize_stored(answer_id, _outcome_read(outcome))
    if stored_now:  # after the commit: a reader of the event finds the same answer stored
        streamed = int((answer.verification or {}).get("streamed_chars", 0))
        _stream_end(answer.pk, answer_record(answer), unshown=answer.text[streamed:])
    return answer


def _finalize_stored(answer_id, outcome: dict) -> tuple[Answer | None, bool]:
    """``(answer, stored_now)``: ``stored_now`` when this call stored it done."""
    with transaction.atomic():
        answer = Answer.objects.select_for_update().filter(pk=answer_id).first()
        if answer is None or answer.status in (Answer.Status.DONE, Answer.Status.FAILED):
            return answer, False
        error = outcome["error"]
        # A generation cut for repeating itself keeps one copy of the loop (the stream has all).
        answer.text = outcome["text"] if error else trim_repetition(outcome["text"], outcome["stats"])
        _, answer.dropped_citations = prompting.citations_resolve(answer.text, answer.sources)
        kept = {
            key: answer.stats[key] for key in ("context", "map_reduce", "relevance", "followup") if key in answer.stats
        }
        extra = {key: outcome.get(key) for key in ("route", "provider", "attempts") if outcome.get(key) is not None}
        answer.stats = {**outcome["stats"], **extra, **kept}
        if error:
            answer.stats["error"] = error
        else:
            _verify(answer)
        answer.citations, _ = prompting.citations_resolve(answer.text, answer.sources)
        answer.status = Answer.Status.FAILED if error else Answer.Status.DONE
        answer.error = _error_text(error) if error else ""
        answer.timings = {**answer.timings, **_timings(answer)}
        answer.finished_at = timezone.now()
        answer.save()
        if not error:  # a failed generation's stream already ends with its error
            metrics.answer_checked(answer.mode, answer.grounded, answer.abstained)
        return answer, not error


def _stream_end(answer_id, record: dict, *, unshown: str = "") -> None:
    """The stored answer as its stream's last event, after the verified text its stream has
    not carried yet (``unshown``: all of it when it was replaced, declined or quoted)."""
    try:
        writer = StreamWriter(str(answer_id))
        if unshown:
            writer.write(SENTENCE, text=unshown)
        writer.write("answer", **record)
    except redis.RedisError as exc:  # readers find the stored answer when they look again
        logger.warning("answer %s: its stream's end not written: %s", answer_id, exc)


def _verify(answer: Answer) -> None:
    """Check the generated text's sentences against the passages it was given (whole chunks,
    as the citations open them): invented markers removed, citations moved to the passage
    that supports the sentence or added, unsupported sentences withheld. The check made while
    the answer streamed (``search.answering.streaming``: ``stats["observed"]``) is the one
    kept, so that the stored text starts with what streaming clients were shown; without it
    (no observer ran), the whole text is checked now. When nothing in it is supported, or the
    model itself declined, the answer abstains, with the closest passages."""
    observed = answer.stats.pop(observers.OBSERVED, None) or {}
    checking = checking_of(answer)
    if not isinstance(checking, Checking):
        # Nothing to check against, and no reason to call it unsupported.
        answer.verification = {"skipped": checking}
        return
    if "verification" in observed:
        verification = Verification.from_dict(observed["verification"], observed["text"])
        streamed = int(observed.get("shown", 0))
    else:
        verifier = checking.verifier()
        verifier.finish(answer.text)
        verification, streamed = verifier.result(), 0
    collection, texts, abstains = checking.collection, checking.texts, checking.withhold
    answer.verification = {**verification.as_dict(), "original_text": answer.text, "streamed_chars": streamed}
    answer.text, answer.grounded = verification.text, verification.grounded
    # Nothing supported: no claim supported (0), or no claim at all (None: a lead-in only).
    if abstains and not verification.grounded and not verification.declined:
        if _quoted_instead(answer, texts, collection):
            return
    if abstains and (verification.declined or verification.grounded == 0):
        closest = sorted(answer.sources, key=lambda record: -record.get("score", 0.0))[: abstention.CLOSEST]
        closest = [
            {key: record.get(key) for key in ("number", "chunk_id", "document_id", "title", "score")}
            for record in closest
        ]
        answer.text, answer.abstained, answer.grounded = (
            abstention.declined_text(closest, analysis.language_of(answer.question)),
            True,
            None,
        )
        answer.verification["sentences"] = []
        answer.stats["closest"] = closest


# The first line of an answer whose model wrote nothing its sources support.
QUOTED_LEAD = wording.said("quoted", analysis.ENGLISH)


def _quoted_instead(answer: Answer, texts: dict[int, str], collection: Collection | None) -> bool:
    """The model's answer says nothing its sources support, though retrieval judged them to
    answer the question (they passed ``search.answering.abstention`` before it generated): their own
    sentences answer instead, as an extractive answer does, under ``QUOTED_LEAD``. "The sources
    do not answer" would be false here. False when they do not hold an answering sentence."""
    sources = [
        prompting.Source.from_record(record, texts[record["chunk_id"]])
        for record in answer.sources
        if record["chunk_id"] in texts
    ]
    extractive = extractive_answer(
        answer.retrieval_query or answer.question,
        sources,
        **scoring(collection),
        lead=wording.said("quoted", analysis.language_of(answer.question)),
        language=analysis.language_of(answer.question),
    )
    if extractive.abstained or not extractive.extracts:
        return False
    answer.mode, answer.text, answer.grounded = Answer.Mode.EXTRACTIVE, extractive.text, 1.0
    # The checked sentences are the model's (its text stays in ``original_text``), not these.
    answer.verification["sentences"] = []
    answer.verification["replaced_by"] = Answer.Mode.EXTRACTIVE.value
    answer.stats["quoted_instead"] = {
        "why": "nothing in the model's answer was supported by its sources",
        "sentences": len(extractive.extracts),
        "relevance": extractive.relevance,
    }
    return True


def answers_reap() -> int:
    """Fail the answers still unfinished ``ANSWER_LOST_AFTER_S`` after they were asked. Every
    generation that ends, however it ends, brings its outcome in its ledger entry, which the
    drain takes and, should a drainer die, claims again (``billing.ledger``); what is left
    here lost its message before any worker ran it (a Redis that lost its queue), so that
    no answer stays ``generating`` for ever. An outcome that comes after all finds the answer
    failed and leaves it so (its row is stored). Beat runs it every 5 minutes; returns how
    many it failed."""
    cutoff = timezone.now() - timedelta(seconds=ANSWER_LOST_AFTER_S)
    stale = Answer.objects.filter(
        status__in=(Answer.Status.QUEUED, Answer.Status.GENERATING), created_at__lt=cutoff
    ).values_list("pk", flat=True)
    failed = 0
    for answer_id in list(stale[:1000]):
        logger.warning("answer %s unfinished after %d s: failed", answer_id, ANSWER_LOST_AFTER_S)
        answer_fail(
            answer_id,
            f"the generation never ended: no outcome came in {ANSWER_LOST_AFTER_S // 60} minutes "
            "(its message was lost before a worker ran it)",
            end_stream=True,
        )
        failed += 1
    return failed


def _error_text(error: dict) -> str:
    message = str(error.get("message") or "the generation failed")
    kind = error.get("kind")
    return f"{message} ({kind})" if kind and kind not in message else message


def _timings(answer: Answer) -> dict:
    """ttft_ms and total_ms from the question to the first token and to the stream's end;
    queue_ms: from submission until the worker began (the first token minus the
    generation's own time to first token). Web host and Redis clocks are assumed in sync."""
    created_ms = answer.created_at.timestamp() * 1000
    first_delta, last = _stream_times(str(answer.id))
    timings = {"total_ms": round((last if last is not None else time.time() * 1000) - created_ms, 2)}
    if first_delta is not None:
        timings["ttft_ms"] = round(first_delta - created_ms, 2)
        generation_ttft = answer.stats.get("time_to_first_token_ms")
        submitted = answer.timings.get("submit_ms")
        if generation_ttft is not None and submitted is not None and "map_reduce" not in answer.stats:
            timings["queue_ms"] = round(max(0.0, timings["ttft_ms"] - submitted - generation_ttft), 2)
    return timings


# --------------------------------------------------------------------------- map-reduce


def answer_map_collect(*, answer_id, index: int, outcome: dict) -> None:
    """Store one map request's notes (``outcome``: ``Outcome.result``); the last one in
    submits the reduce request. A map request that failed fails the answer at once, with its
    reason (the other maps still end, and are billed, but are not waited for). Idempotent:
    a map already stored, or a finished answer, is left as it is."""
    submit = None
    with transaction.atomic():
        locked = Answer.objects.select_for_update(of=("self",)).select_related("route__provider")
        answer = locked.filter(pk=answer_id).first()
        if answer is None or answer.status in (Answer.Status.DONE, Answer.Status.FAILED):
            return
        state = answer.stats["map_reduce"]
        entry = state["maps"][index]
        if entry["status"] != "pending":
            return
        result = _outcome_read(outcome)
        if result["error"]:
            entry.update(status="error", error=_error_text(result["error"]))
        else:
            entry.update(
                status="ok",
                note=trim_repetition(result["text"], result["stats"]),
                tokens=result["stats"].get("completion_tokens"),
            )
        done = sum(item["status"] != "pending" for item in state["maps"])
        StreamWriter(str(answer.id)).write("progress", stage="map", done=done, total=len(state["maps"]))
        failed = entry["status"] == "error"
        if not failed and any(item["status"] == "pending" for item in state["maps"]):
            answer.save(update_fields=["stats"])
            return
        notes = [item["note"] for item in state["maps"] if item["status"] == "ok"]
        failure = None
        if failed:
            failure = f"map request {index + 1} of {len(state['maps'])} failed: {entry['error']}"
        elif answer.route is None:
            failure = "the route of this answer was deleted before its final request"
        if failure:
            answer.save(update_fields=["stats"])
        else:
            sources = [
                prompting.Source(
                    number=record["number"],
                    chunk_id=record["chunk_id"],
                    document_id=record["document_id"],
                    title=record.get("title", ""),
                    text="",
                    start_offset=record.get("start_offset") or 0,
                    end_offset=record.get("end_offset") or 0,
                    score=record.get("score", 0.0),
                )
                for record in answer.sources
            ]
            try:
                budget = prompting.prompt_budget_for(answer.route, max_tokens=state["max_tokens"])
                request, dropped = prompting.reduce_request(
                    answer.question, notes, sources, budget, answer.route.system_prompt
                )
            except prompting.PromptTooLong as exc:
                failure = str(exc)
                answer.save(update_fields=["stats"])
            else:
                state["reduce"] = {"prompt_tokens": request.prompt_tokens, "notes_dropped": dropped}
                answer.timings["submit_ms"] = round((timezone.now() - answer.created_at).total_seconds() * 1000, 2)
                answer.save(update_fields=["stats", "timings"])
                requested = Route.objects.filter(pk=state.get("requested_route_id")).first() or answer.route
                chosen = state.get("provider_id")
                plan = router.Plan(
                    request_id=str(answer.id),
                    route=answer.route,
                    requested_route=requested,
                    release=answer.release,
                    arm=answer.arm,
                    speculative=state.get("speculative"),
                    speculating_provider=(
                        Provider.objects.filter(pk=chosen).first() if chosen != answer.route.provider_id else None
                    ),
                )

                def submit():
                    key_id = state.get("client_key_id")
                    _submit_admitted(
                        ClientKey.objects.filter(pk=key_id).first() if key_id else None,
                        plan,
                        request,
                        temperature=state.get("temperature"),
                        workspace_id=answer.workspace_id,
                        user_id=answer.asker_id,
                        client_key_id=key_id,
                        outcome_to=_to_answer(answer.id),
                    )

    if failure:
        answer_fail(answer.pk, failure, end_stream=True)
    elif submit is not None:
        try:
            submit()
        except Exception as exc:  # RouteUnavailable (every key cooling down), a broker outage
            logger.warning("answer %s: the reduce request was not sent", answer.pk, exc_info=True)
            answer_fail(answer.pk, f"the final request could not be sent: {_reason(exc)}", end_stream=True)


# --------------------------------------------------------------------------- reading


def answer_stream_read(answer: Answer, *, after: str = "0", block_ms: int = 15000) -> Iterator[tuple[str, str, dict]]:
    """The answer's events for a reader (the UI serves them as Server-Sent Events):
    ``(event_id, type, data)`` from ``after`` on, ``delta`` {text} ... then ``stats`` or
    ``error`` (a ``retry`` event may come in between: skip it). Pass the last id seen to
    resume. An answer whose stream has expired (an hour after its end) or never started (it
    failed before generation) is replayed from the stored answer as ids ``0-1``, ``0-2``.
    Raises ``TimeoutError`` when nothing arrives for ``block_ms`` (a map-reduce answer
    writes nothing until its final request starts): reconnect with the last id.
    """
    length, _ = StreamWriter(str(answer.id)).history()
    if length == 0:
        answer.refresh_from_db()
        replayed = _stored_events(answer, after)
        if replayed is not None:
            yield from replayed
            return
    yield from stream_read(str(answer.id), after=after, block_ms=block_ms, until=ANSWER_END)


def _stored_events(answer: Answer, after: str) -> list[tuple[str, str, dict]] | None:
    """A finished answer's events rebuilt from its record (its stream has expired or never
    existed), after ``after``; None while it is not finished."""
    if answer.status not in (Answer.Status.DONE, Answer.Status.FAILED):
        return None
    events = [("0-1", SENTENCE, {"text": answer.text})] if after < "0-1" and answer.text else []
    if answer.status == Answer.Status.DONE:
        if after < "0-2":
            events.append(("0-2", "stats", dict(answer.stats)))
        events.append(("0-3", "answer", answer_record(answer)))
    else:
        events.append(("0-2", "error", {"field": None, "kind": "answer_failed", "message": answer.error}))
    return events


# What a stream id looks like ("1700000000000-0"), or "0": from the start (the REST API's
# schema publishes the pattern).
EVENT_ID_PATTERN = r"^(0|[0-9]{1,20}-[0-9]{1,20})$"
_EVENT_ID = re.compile(EVENT_ID_PATTERN)


def event_id_valid(value: str) -> bool:
    """Whether ``value`` names a position in an answer's stream (a Redis stream id such as
    ``1700000000000-0``, or ``0`` for the start): what a reader resumes after."""
    return bool(_EVENT_ID.fullmatch(value))


@dataclass(frozen=True)
class AnswerEvent:
    """One event of an answer for a front door to format: ``kind`` is the stream's (``delta``,
    ``retry``, ``progress``, ``stats``, then ``answer`` or ``error``), or ``quiet`` (no ``id``)
    when nothing came for a slice: a door sends a keep-alive then, or stops."""

    kind: str
    data: dict
    id: str | None = None


QUIET = "quiet"


async def answer_events(
    answer_id,
    *,
    after: str = "0",
    slice_ms: int = 15000,
    generating: bool = False,
    quiet_limit_s: float | None = None,
    raw: bool = False,
):
    """An answer's events from ``after`` on, to its end (``answer`` or ``error``), for every
    front door (the UI's and the REST API's Server-Sent Events, the OpenAI-compatible
    stream): ``AnswerEvent``s, a ``quiet`` one after each ``slice_ms`` without any. After
    ``quiet_limit_s`` of quiet in a row it ends with an ``error`` of kind ``timeout``; an
    answer deleted meanwhile ends with an ``error`` of kind ``answer_deleted``. Redis
    errors propagate (a reader reconnects from the last id). ``generating``: see
    ``answer_stream_aread``.

    Its ``delta`` events are the answer's verified text (the stream's ``sentence`` events:
    the stored answer's text, in order, and nothing it withholds); the model's own tokens are
    left out. ``raw``: the model's tokens instead, each ``delta`` marked ``unverified`` (an
    answer that generated none, extractive or replayed, gives its verified text)."""
    last, quiet_s = after, 0.0
    model_tokens = False  # (raw) the stream has carried the model's own tokens
    while True:
        events = answer_stream_aread(answer_id, after=last, block_ms=slice_ms, generating=generating)
        generating = False  # after a quiet slice the stored answer is looked at again
        try:
            async with aclosing(events):
                async for event_id, kind, data in events:
                    last, quiet_s = event_id, 0.0
                    if kind == "delta":
                        model_tokens = True
                        if raw:
                            yield AnswerEvent("delta", {**data, "unverified": True}, event_id)
                    elif kind == SENTENCE:
                        if not (raw and model_tokens):
                            yield AnswerEvent("delta", data, event_id)
                    else:
                        yield AnswerEvent(kind, data, event_id)
            return
        except TimeoutError:
            quiet_s += slice_ms / 1000
            if quiet_limit_s is not None and quiet_s >= quiet_limit_s:
                message = f"the answer made no progress for {quiet_s:g} s"
                yield AnswerEvent("error", {"field": None, "kind": "timeout", "message": message})
                return
            yield AnswerEvent(QUIET, {})
        except Answer.DoesNotExist:
            yield AnswerEvent("error", {"field": None, "kind": "answer_deleted", "message": "the answer was deleted"})
            return


async def answer_stream_aread(answer_id, *, after: str = "0", block_ms: int = 15000, generating: bool = False):
    """``answer_stream_read`` for async views (Server-Sent Events under ASGI): the same
    events, the stored answer replayed when its stream has expired or never started.

    ``generating``: the caller has just seen the answer generating (it started it). Every
    way a generating answer ends writes its stream's last event (the generation, or
    ``answer_fail(end_stream=True)``), so its stream is read at once, without the round
    trips that look for a stored answer first: they were on every streamed answer's time
    to first token, since its stream does not exist yet when the reader starts."""
    if not generating and not await redis_async_client(Role.STREAMS).exists(stream_key(str(answer_id))):
        answer = await sync_to_async(Answer.objects.get)(pk=answer_id)
        replayed = _stored_events(answer, after)
        if replayed is not None:
            for event in replayed:
                yield event
            return
    async for event in stream_aread(str(answer_id), after=after, block_ms=block_ms, until=ANSWER_END):
        yield event
