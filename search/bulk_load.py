"""Bulk loading for management commands: files, folders and BEIR corpora, in-process."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from django.db import connection, transaction
from tqdm import tqdm

from search.beir import corpus_read
from search.bm25 import collection_bm25_refresh
from search.ingest.pipeline import documents_ingest, documents_prepare, documents_write
from search.models import Collection, Document
from search.services import DocumentRejected, collection_create, document_create

# Documents per pipeline run: enough chunks for full embedder calls and one commit per batch.
BATCH_DOCUMENTS = 256


def _batches(items: Iterable, size: int = BATCH_DOCUMENTS):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def files_under(paths: Iterable[Path]) -> list[Path]:
    """Every regular, non-hidden file under the given files and folders, sorted."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(
                p for p in sorted(path.rglob("*")) if p.is_file() and not any(part.startswith(".") for part in p.parts)
            )
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{path} does not exist")
    return found


def files_store(
    collection: Collection, files: list[Path], *, readers: list[str] | None = None
) -> tuple[list[int], list[str]]:
    """Store files as queued documents, readable by ``readers`` (search.access; default: the
    whole workspace); returns their ids and the refusals (with reasons)."""
    ids: list[int] = []
    refused: list[str] = []
    for batch in _batches(files):
        with transaction.atomic():  # one commit per batch of uploads
            for path in batch:
                try:
                    document, _ = document_create(
                        collection=collection,
                        source_name=path.name,
                        content=path.read_bytes(),
                        readers=readers,
                        enqueue=False,
                    )
                except DocumentRejected as exc:
                    refused.append(str(exc))
                    continue
                ids.append(document.pk)
    return ids, refused


def beir_store(
    collection: Collection, directory: Path, *, readers: list[str] | None = None
) -> tuple[list[int], list[str]]:
    """Store a BEIR corpus as documents, each with its corpus id(s) in ``metadata["beir_ids"]``.

    Identical texts under two ids become one document listing both ids, so evaluation
    credits either id. Returns the new document ids and the refusals (empty entries).
    """
    ids: list[int] = []
    refused: list[str] = []
    for batch in _batches(corpus_read(directory)):
        with transaction.atomic():  # one commit per batch of uploads
            for item in batch:
                try:
                    document, created = document_create(
                        collection=collection,
                        source_name=f"{item.id}.txt",
                        content=item.content().encode("utf-8"),
                        title=item.title or None,
                        metadata={"beir_ids": [item.id]},
                        readers=readers,
                        enqueue=False,
                    )
                except DocumentRejected as exc:
                    refused.append(str(exc))
                    continue
                if not created and item.id not in document.metadata.get("beir_ids", []):
                    document.metadata.setdefault("beir_ids", []).append(item.id)
                    Document.objects.filter(pk=document.pk).update(metadata=document.metadata)
                if created:
                    ids.append(document.pk)
    return ids, refused


def pending(collection: Collection) -> list[int]:
    """Documents of the collection not indexed yet (new, failed earlier, or interrupted)."""
    return list(
        Document.objects.filter(collection=collection)
        .exclude(status=Document.Status.INDEXED)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def ingest_in_batches(document_ids: list[int], on_documents_done: Callable[[int], None] | None = None) -> None:
    """Run the pipeline batch by batch; a batch's database write overlaps the next batch's embedding.

    The write runs in a thread with its own database connection, so the model keeps the
    processor busy while PostgreSQL commits. Inside an open transaction (tests) another
    connection could not see the documents, so there everything runs in sequence.
    """
    batches = [document_ids[start : start + BATCH_DOCUMENTS] for start in range(0, len(document_ids), BATCH_DOCUMENTS)]
    if connection.in_atomic_block:
        for batch in batches:
            documents_ingest(document_ids=batch)
            if on_documents_done:
                on_documents_done(len(batch))
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-write") as writer:
        pending: Future | None = None
        pending_size = 0
        for batch in batches:
            _, prepared = documents_prepare(document_ids=batch)
            if pending is not None:
                pending.result()  # at most one write in flight; re-raises its error
                if on_documents_done:
                    on_documents_done(pending_size)
            pending, pending_size = writer.submit(_write_in_thread, prepared), len(batch)
        if pending is not None:
            pending.result()
            if on_documents_done:
                on_documents_done(pending_size)


def _write_in_thread(prepared) -> None:
    try:
        documents_write(prepared)
    finally:
        connection.close()  # this thread's own connection


def beir_collection_ingested(
    workspace, directory: Path, *, text_search_config: str | None = None, log: Callable[[str], None] | None = None
) -> Collection:
    """The workspace's collection of a BEIR corpus (``beir:<folder>``, a configuration's name
    after a colon when not the default), stored and ingested where it is not yet: evaluation
    commands ask over it. Progress goes to a bar, refusals and failures to ``log``."""
    default = Collection._meta.get_field("text_search_config").default
    config = text_search_config or default
    name = f"beir:{directory.resolve().name}" + (f":{config}" if config != default else "")
    collection = collection_create(workspace=workspace, name=name, text_search_config=config)
    if collection.text_search_config != config:
        raise ValueError(f"{collection.name} exists with text_search_config {collection.text_search_config}")
    log = log or (lambda line: None)
    new, refused = beir_store(collection, directory)
    if refused and new:
        log(f"{len(refused)} corpus entries refused, e.g. {refused[0]}")
    todo = pending(collection)
    if todo:
        log(f"ingesting {len(todo)} documents ({len(new)} new) into {collection.name}")
        with tqdm(total=len(todo), unit="doc", desc="ingest", disable=None) as bar:
            ingest_in_batches(todo, on_documents_done=bar.update)
        collection_bm25_refresh(collection_id=collection.pk)
    # Its first documents may have chosen its embedder (search/ingest/pipeline.py), and BM25 its length.
    collection.refresh_from_db()
    for document in Document.objects.filter(collection=collection, status=Document.Status.FAILED)[:20]:
        log(f"failed: {document.source_name}: {document.error}")
    return collection
