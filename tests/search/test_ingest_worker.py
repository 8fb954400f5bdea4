"""Ingestion through a real Celery worker process, including one killed mid-document."""

from __future__ import annotations

import os
import random
import signal

import psutil
import pytest

from search.models import Chunk, Document
from search.services import collection_create, document_create, workspace_create
from tests.polling import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WORDS = (
    "wing flow pressure boundary layer shock supersonic heat transfer panel flutter vortex drag lift "
    "turbulent laminar nozzle jet cylinder plate temperature velocity density wave theory experiment"
).split()


def long_text(sentences: int, seed: int = 1) -> str:
    rng = random.Random(seed)  # noqa: S311 (test data)
    lines = []
    for index in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 20))]
        lines.append(f"Section {index} says the {' '.join(words)}.")
    return " ".join(lines)


def test_an_uploaded_document_is_ingested_by_the_worker(start_worker, settings):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    with start_worker(["ingest"], env={"MEDIA_ROOT": str(settings.MEDIA_ROOT)}):
        document, created = document_create(
            collection=collection, source_name="note.txt", content=b"Receipts are due within 30 days."
        )
        assert created
        wait_for(
            lambda: Document.objects.get(pk=document.pk).status == "indexed",
            120,
            f"not indexed: {Document.objects.get(pk=document.pk).error}",
        )
    assert Chunk.objects.get(document=document).text == "Receipts are due within 30 days."


def test_a_task_redelivered_after_its_worker_process_was_killed_writes_the_chunks_once(start_worker, settings):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Long reads")
    with start_worker(["ingest"], env={"MEDIA_ROOT": str(settings.MEDIA_ROOT)}) as worker:
        document, _ = document_create(collection=collection, source_name="long.txt", content=long_text(3000).encode())
        wait_for(
            lambda: Document.objects.get(pk=document.pk).status == "embedding",
            120,
            "the worker never started embedding",
        )
        # The pool process running the task dies as the OOM killer would kill it.
        pool = psutil.Process(worker.process.pid).children()
        assert len(pool) == 1
        os.kill(pool[0].pid, signal.SIGKILL)

        final = wait_for(
            lambda: (d := Document.objects.get(pk=document.pk)).status in ("indexed", "failed") and d,
            300,
            "the document was not finished after the worker process was killed",
        )
        log = worker.log()
    assert final.status == "indexed", final.error
    assert final.attempts == 2  # the first delivery died; the redelivered one finished
    ordinals = list(Chunk.objects.filter(document=document).order_by("ordinal").values_list("ordinal", flat=True))
    assert ordinals == list(range(final.chunks_total))
    assert final.chunks_total > 256  # long enough that the kill landed mid-embedding
    assert "WorkerLostError" in log
