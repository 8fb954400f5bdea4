"""Celery tasks of the search app (queue ``ingest``): thin wrappers that load ids and call one service."""

from __future__ import annotations

import random

import redis
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import InterfaceError, OperationalError

from ragsite.celery import LONG_TASK_OPTIONS
from search.ingest import pipeline
from search.models import Document

# Infrastructure hiccups (database restart, broker blip) are retried with backoff;
# anything wrong with the document itself ends as `failed` inside the pipeline.
TRANSIENT_ERRORS = (OperationalError, InterfaceError, redis.ConnectionError)
MAX_RETRIES = 6


def _backoff(retries: int) -> float:
    """Exponential backoff with full jitter: 2, 4, 8 ... seconds, capped at 2 minutes."""
    return random.uniform(0, min(120, 2 ** (retries + 1)))  # noqa: S311 (not for security)


@shared_task(name="search.tasks.document_ingest", bind=True, max_retries=MAX_RETRIES, **LONG_TASK_OPTIONS)
def document_ingest(self, document_id: int) -> str:
    try:
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
    from search.vector_indexes import search_indexes_maintain as maintain

    return maintain(min_chunks=settings.SEARCH_BM25_INDEX_MIN_CHUNKS)
