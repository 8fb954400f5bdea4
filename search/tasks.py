"""Celery tasks of the search app: ingestion on queue ``ingest``, the short answer tasks on ``default``;
thin wrappers that load ids and call one service."""

from __future__ import annotations

import logging
import random

import redis
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import InterfaceError, OperationalError

from ragsite.celery import LONG_TASK_OPTIONS
from ragsite.redis import Role, redis_client
from search import bm25, vector_indexes
from search.answering import answers
from search.ingest import pipeline
from search.ingest.status import document_fail
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
    client = redis_client(Role.BROKER)
    count = client.incr(pipeline.interruptions_key(document_id))
    client.expire(pipeline.interruptions_key(document_id), 86400)
    return count >= INGEST_MAX_INTERRUPTIONS


@shared_task(name="search.tasks.document_ingest", bind=True, max_retries=MAX_RETRIES, **LONG_TASK_OPTIONS)
def document_ingest(self, document_id: int) -> str:
    try:
        if _interrupted_too_often(document_id):
            document = Document.objects.get(pk=document_id)
            document_fail(
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
        document_fail(document, f"ingestion took longer than the limit of {limit} s")
        return document.status
    except TRANSIENT_ERRORS as exc:
        if self.request.retries >= MAX_RETRIES:
            document = Document.objects.get(pk=document_id)
            document_fail(document, f"the database or broker stayed unavailable ({type(exc).__name__})")
            return document.status
        raise self.retry(exc=exc, countdown=_backoff(self.request.retries)) from exc


@shared_task(name="search.tasks.collection_bm25_refresh", **LONG_TASK_OPTIONS)
def collection_bm25_refresh(collection_id: int) -> float:
    return bm25.collection_bm25_refresh(collection_id=collection_id)


# Building the index over millions of chunks takes minutes: a longer limit than the default.
@shared_task(name="search.tasks.search_indexes_maintain", ignore_result=True, soft_time_limit=3300, time_limit=3500)
def search_indexes_maintain() -> str | None:
    return vector_indexes.search_indexes_maintain(min_chunks=settings.SEARCH_BM25_INDEX_MIN_CHUNKS)


# --------------------------------------------------------------------------- answers (queue ``default``)
# An answer's generation brings its outcome back in its ledger entry: the ledger's drain
# (``billing.tasks.ledger_drain``) hands it to ``search.answering.answers.generation_outcome_take``.


@shared_task(name="search.tasks.answers_reap", ignore_result=True, soft_time_limit=240, time_limit=280)
def answers_reap() -> int:
    """Beat: fail answers whose generation's message was lost (``search.answering.answers.answers_reap``)."""
    return answers.answers_reap()
