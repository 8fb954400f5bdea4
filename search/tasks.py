"""Celery tasks of the search app: ingestion on queue ``ingest``, the short answer tasks on ``default``;
thin wrappers that load ids and call one service."""

from __future__ import annotations

import logging
import random

import redis
from celery import Task, shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import InterfaceError, OperationalError

from ragsite.celery import LONG_TASK_OPTIONS
from ragsite.redis import redis_client
from search import answers, vector_indexes
from search.ingest import pipeline
from search.models import Document

logger = logging.getLogger(__name__)

# Infrastructure hiccups (database restart, broker blip) are retried with backoff;
# anything wrong with the document itself ends as `failed` inside the pipeline.
TRANSIENT_ERRORS = (OperationalError, InterfaceError, redis.ConnectionError)
MAX_RETRIES = 6


def _backoff(retries: int) -> float:
    """Exponential backoff with full jitter: 2, 4, 8 ... seconds, capped at 2 minutes."""
    return random.uniform(0, min(120, 2 ** (retries + 1)))  # noqa: S311 (not for security)


# A document whose ingestion was cut off this many times (its worker process died each time:
# a file that crashes a parser, a worker short of memory) fails instead of being redelivered
# for ever: ingestion tasks are requeued when their worker is lost (reject_on_worker_lost).
INGEST_MAX_INTERRUPTIONS = 3
_IN_PROGRESS = (Document.Status.PARSING, Document.Status.CHUNKING, Document.Status.EMBEDDING)


def _interrupted_too_often(document_id: int) -> bool:
    """Counts a delivery that finds its document still in progress (the previous delivery's
    worker died mid-way); True once that has happened ``INGEST_MAX_INTERRUPTIONS`` times."""
    status = Document.objects.filter(pk=document_id).values_list("status", flat=True).first()
    if status not in _IN_PROGRESS:
        return False
    client = redis_client()
    count = client.incr(pipeline.interruptions_key(document_id))
    client.expire(pipeline.interruptions_key(document_id), 86400)
    return count >= INGEST_MAX_INTERRUPTIONS


@shared_task(name="search.tasks.document_ingest", bind=True, max_retries=MAX_RETRIES, **LONG_TASK_OPTIONS)
def document_ingest(self, document_id: int) -> str:
    try:
        if _interrupted_too_often(document_id):
            document = Document.objects.get(pk=document_id)
            pipeline.document_fail(
                document,
                f"ingestion was cut off {INGEST_MAX_INTERRUPTIONS} times: the worker process died while working on "
                "this file each time (a file that crashes a parser, or a worker short of memory); retry it once "
                "the cause is fixed",
            )
            return document.status
        return pipeline.document_ingest(document_id=document_id).status
    except Document.DoesNotExist:
        return "deleted"  # removed while queued: nothing to do
    except SoftTimeLimitExceeded:
        document = Document.objects.get(pk=document_id)
        limit = settings.CELERY_TASK_SOFT_TIME_LIMIT
        pipeline.document_fail(document, f"ingestion took longer than the limit of {limit} s")
        return document.status
    except TRANSIENT_ERRORS as exc:
        if self.request.retries >= MAX_RETRIES:
            document = Document.objects.get(pk=document_id)
            pipeline.document_fail(document, f"the database or broker stayed unavailable ({type(exc).__name__})")
            return document.status
        raise self.retry(exc=exc, countdown=_backoff(self.request.retries)) from exc


@shared_task(name="search.tasks.collection_bm25_refresh", **LONG_TASK_OPTIONS)
def collection_bm25_refresh(collection_id: int) -> float:
    return pipeline.collection_bm25_refresh(collection_id=collection_id)


# Building the index over millions of chunks takes minutes: a longer limit than the default.
@shared_task(name="search.tasks.search_indexes_maintain", ignore_result=True, soft_time_limit=3300, time_limit=3500)
def search_indexes_maintain() -> str | None:
    return vector_indexes.search_indexes_maintain(min_chunks=settings.SEARCH_BM25_INDEX_MIN_CHUNKS)


# --------------------------------------------------------------------------- answers (queue ``default``)
# Linked from ``inference.router.submit``: Celery calls them with the generation's result
# (``Outcome.result``) first. Both are short and idempotent (a finished answer, or a map
# already stored, is left as it is), so a redelivered message does no harm.


class _GenerationResultTask(Task):
    """A task called with a generation's result first (``router.submit``'s ``link``): the
    result holds the answer's text, so the copy of the arguments that Celery puts in message
    headers and log lines (``argsrepr``) leaves it out."""

    def apply_async(self, args=None, kwargs=None, **options):
        if args and "argsrepr" not in options:
            options["argsrepr"] = repr(("<result withheld>", *args[1:]))
        return super().apply_async(args, kwargs, **options)


@shared_task(
    name="search.tasks.answer_finalize", bind=True, base=_GenerationResultTask, ignore_result=True, max_retries=None
)
def answer_finalize(self, result: dict, answer_id: str) -> None:
    """Store the end of an answer's generation (``search.answers.answer_finalize``). When the
    result is not the generation's end (it went on on another queue), watch the stream."""
    _answer_step(
        self, answer_id, lambda: not answers.answer_finalize(answer_id=answer_id, result=result)[1], (answer_id,)
    )


@shared_task(
    name="search.tasks.answer_map_collect", bind=True, base=_GenerationResultTask, ignore_result=True, max_retries=None
)
def answer_map_collect(self, result: dict, answer_id: str, index: int) -> None:
    """Store one map request's notes of a map-reduce answer; the last submits the reduce."""
    _answer_step(
        self,
        answer_id,
        lambda: answers.answer_map_collect(answer_id=answer_id, index=index, result=result),
        (answer_id, index),
    )


def _answer_step(task, answer_id: str, step, args: tuple) -> None:
    """Run one answer task's ``step`` (True when done): transient database or Redis errors
    retry with backoff, anything else (or retries spent) fails the answer; not done yet
    (the generation has not ended) looks again later with a ``watch`` result."""
    try:
        done = step()
    except TRANSIENT_ERRORS as exc:
        if task.request.retries < MAX_RETRIES:
            raise task.retry(exc=exc, countdown=_backoff(task.request.retries)) from exc
        _answer_fail_on(exc, answer_id)
        raise
    except Exception as exc:
        _answer_fail_on(exc, answer_id)
        raise
    if not done:
        raise task.retry(args=({"status": "watch"}, *args), countdown=answers.FINALIZE_WATCH_INTERVAL_S)


@shared_task(name="search.tasks.answers_reap", ignore_result=True, soft_time_limit=240, time_limit=280)
def answers_reap() -> int:
    """Beat: end answers whose storing tasks were lost (``search.answers.answers_reap``)."""
    return answers.answers_reap()


@shared_task(name="search.tasks.answer_generation_lost", ignore_result=True)
def answer_generation_lost(task_id: str, answer_id: str) -> None:
    """``link_error`` of an answer's generation: its task failed without a result (the pool
    process died, or the hard time limit), so ``answer_finalize`` was never called. It
    runs now, without a result: it reads the stream, whose terminal ``error`` the worker's
    parent writes, and fails the answer with that reason."""
    answer_finalize.delay({"status": "lost", "task_id": task_id}, answer_id)


def _answer_fail_on(exc: Exception, answer_id: str) -> None:
    """A bug or a lasting outage must not leave an answer ``generating`` for ever."""
    try:
        answers.answer_fail(answer_id, f"the answer could not be stored: {type(exc).__name__}", end_stream=True)
    except Exception:  # the database or Redis is still down: the exception above is logged
        logger.exception("answer %s could not be marked failed", answer_id)
