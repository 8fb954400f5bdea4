"""Ingestion throughput: the whole pipeline against the embedder alone, on the same texts.

    python -m benchmarks.ingest [--corpus DIR] [--docs N]

Each text is first stored as an uploaded document (the upload's share, timed apart as
``upload_store_seconds``). The pipeline run is then what the ingest queue does with stored
uploads, exactly as ``manage.py ingest`` runs it: read, parse, chunk, embed and write
(binary COPY, BM25 weights, term statistics, HNSW and GIN index maintenance, status and
progress updates). The embed-only run sends the very chunk texts the pipeline embedded
through the same embedder, in the same group size. ``ratio`` = pipeline chunks/s over
embed-only chunks/s: the share of the pipeline's time that is embedding.
After an untimed warm-up pass over the same texts (it loads the model and prepares the
kernels for every input shape, for both sides), the embed-only run goes once before the
pipeline and once after; the two are averaged.
"""

from __future__ import annotations

import argparse
import time
import uuid

from benchmarks.common import CRANFIELD, ROOT, django_setup, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(CRANFIELD), help="A BEIR-layout folder (default: Cranfield).")
    parser.add_argument("--docs", type=int, default=600, help="How many documents of the corpus to use.")
    args = parser.parse_args()
    django_setup()

    from pathlib import Path

    from django.conf import settings
    from django.db import transaction

    from search.beir import corpus_read, is_beir_dir
    from search.embedders import DEFAULT_EMBEDDER, embedder_get
    from search.ingest import bulk
    from search.ingest.chunking import chunk_text
    from search.ingest.parsers import parse_document
    from search.ingest.pipeline import EMBED_GROUP, embedding_input
    from search.models import Chunk, Document, Workspace
    from search.services import collection_create, document_create, document_delete, workspace_create

    corpus = Path(args.corpus)
    if is_beir_dir(corpus):
        texts = [(doc.title, doc.content()) for doc in corpus_read(corpus) if doc.content()][: args.docs]
    else:  # the demo corpus, repeated with a counter so every text is distinct
        files = sorted((ROOT / "demo" / "corpus").iterdir())
        texts = [(f.stem, f"{f.read_text()}\n\nCopy {i}.") for i in range(args.docs // len(files) + 1) for f in files]
        texts = texts[: args.docs]

    embedder = embedder_get(DEFAULT_EMBEDDER)
    # The chunk texts the pipeline will embed, computed with its own functions, so that the
    # embedder alone can run on them before and after the pipeline.
    inputs = []
    for title, text in texts:
        parsed = parse_document(text.encode(), media_type="text/plain")
        chunks = chunk_text(
            parsed.text,
            tokenize=embedder.token_offsets,
            max_tokens=embedder.max_tokens,
            overlap_tokens=settings.CHUNK_OVERLAP_TOKENS,
            headings=parsed.headings,
        )
        inputs += [embedding_input(title or parsed.title or "", chunk) for chunk in chunks]

    def embed_only() -> float:
        begun = time.perf_counter()
        for start in range(0, len(inputs), EMBED_GROUP):
            embedder.embed_documents(inputs[start : start + EMBED_GROUP])
        return time.perf_counter() - begun

    embed_only()  # untimed: loads the model and warms the kernels for every input shape, for both sides
    embed_before = embed_only()

    workspace = workspace_create(name="Benchmarks", slug="bench")
    collection = collection_create(workspace=workspace, name=f"ingest-{uuid.uuid4().hex[:8]}")
    try:
        # The uploads, stored as the web tier would.
        started = time.perf_counter()
        ids = []
        for start in range(0, len(texts), bulk.BATCH_DOCUMENTS):
            with transaction.atomic():  # one commit per batch of uploads, as manage.py ingest does
                for index, (title, text) in enumerate(texts[start : start + bulk.BATCH_DOCUMENTS], start):
                    document, _ = document_create(
                        collection=collection,
                        source_name=f"doc-{index}.txt",
                        content=text.encode(),
                        title=title or None,
                        enqueue=False,
                    )
                    ids.append(document.pk)
        store_seconds = time.perf_counter() - started
        # The pipeline: parse, chunk, embed and write, in batches.
        started = time.perf_counter()
        bulk.ingest_in_batches(ids)
        pipeline_seconds = time.perf_counter() - started
        failed = Document.objects.filter(collection=collection, status=Document.Status.FAILED).count()
        chunk_count = Chunk.objects.filter(collection=collection).count()
        embed_seconds = (embed_before + embed_only()) / 2
    finally:
        for document in Document.objects.filter(collection=collection):
            document_delete(document=document)
        collection.delete()
        Workspace.objects.filter(slug="bench", collections__isnull=True).delete()
    if chunk_count != len(inputs):
        raise SystemExit(
            f"the pipeline wrote {chunk_count} chunks ({failed} documents failed), the embed-only run had {len(inputs)}"
        )
    chunks = inputs

    pipeline_rate = len(chunks) / pipeline_seconds
    embed_rate = len(chunks) / embed_seconds
    report(
        "ingest",
        {
            "documents": len(texts),
            "failed": failed,
            "chunks": len(chunks),
            "upload_store_seconds": round(store_seconds, 2),
            "pipeline_seconds": round(pipeline_seconds, 2),
            "embed_only_seconds": round(embed_seconds, 2),
            "pipeline_chunks_per_s": round(pipeline_rate, 2),
            "embed_only_chunks_per_s": round(embed_rate, 2),
            "ratio": round(pipeline_rate / embed_rate, 3),
        },
    )


if __name__ == "__main__":
    main()
