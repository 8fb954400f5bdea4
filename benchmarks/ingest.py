"""Ingestion throughput: the whole pipeline against the embedder alone, on the same texts.

    python -m benchmarks.ingest [--corpus DIR] [--docs N]

The pipeline run stores each text as an uploaded document, then parses, chunks, embeds
and writes it (binary COPY, BM25 weights, HNSW and GIN index maintenance) exactly as
``manage.py ingest`` does. The embed-only run sends the very chunk texts the pipeline
embedded through the same embedder, in the same group size. ``ratio`` =
pipeline chunks/s over embed-only chunks/s: the share of time that is embedding.
The embed-only run is measured twice and averaged; both sides run in one process
with the model already loaded and warm.
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

    from search.beir import corpus_read, is_beir_dir
    from search.embedders import DEFAULT_EMBEDDER, embedder_get
    from search.ingest import bulk
    from search.ingest.chunking import TextChunk
    from search.ingest.pipeline import EMBED_GROUP, embedding_input
    from search.models import Chunk, Document, Workspace
    from search.services import collection_create, document_create, document_delete, workspace_create

    corpus = Path(args.corpus)
    if is_beir_dir(corpus):
        texts = [(doc.title, doc.content()) for doc in corpus_read(corpus)][: args.docs]
    else:  # the demo corpus, repeated with a counter so every text is distinct
        files = sorted((ROOT / "demo" / "corpus").iterdir())
        texts = [(f.stem, f"{f.read_text()}\n\nCopy {i}.") for i in range(args.docs // len(files) + 1) for f in files]
        texts = texts[: args.docs]

    embedder = embedder_get(DEFAULT_EMBEDDER)
    embedder.embed_documents(["warm-up"] * 64)  # load the model and warm kernels outside the timings

    workspace = workspace_create(name="Benchmarks", slug="bench")
    collection = collection_create(workspace=workspace, name=f"ingest-{uuid.uuid4().hex[:8]}")
    try:
        # Pipeline: store uploads, then parse, chunk, embed and write in batches.
        started = time.perf_counter()
        ids = []
        for index, (title, text) in enumerate(texts):
            document, _ = document_create(
                collection=collection,
                source_name=f"doc-{index}.txt",
                content=text.encode(),
                title=title or None,
                enqueue=False,
            )
            ids.append(document.pk)
        bulk.ingest_in_batches(ids)
        pipeline_seconds = time.perf_counter() - started
        failed = Document.objects.filter(collection=collection, status=Document.Status.FAILED).count()
        chunks = list(
            Chunk.objects.filter(collection=collection)
            .select_related("document")
            .order_by("document_id", "ordinal")
            .only("text", "start_offset", "end_offset", "token_count", "ordinal", "document__title")
        )
        inputs = [
            embedding_input(c.document.title, TextChunk(c.ordinal, c.text, c.start_offset, c.end_offset, c.token_count))
            for c in chunks
        ]

        def embed_only() -> float:
            begun = time.perf_counter()
            for start in range(0, len(inputs), EMBED_GROUP):
                embedder.embed_documents(inputs[start : start + EMBED_GROUP])
            return time.perf_counter() - begun

        embed_seconds = (embed_only() + embed_only()) / 2
    finally:
        for document in Document.objects.filter(collection=collection):
            document_delete(document=document)
        collection.delete()
        Workspace.objects.filter(slug="bench", collections__isnull=True).delete()

    pipeline_rate = len(chunks) / pipeline_seconds
    embed_rate = len(chunks) / embed_seconds
    report(
        "ingest",
        {
            "documents": len(texts),
            "failed": failed,
            "chunks": len(chunks),
            "pipeline_seconds": round(pipeline_seconds, 2),
            "embed_only_seconds": round(embed_seconds, 2),
            "pipeline_chunks_per_s": round(pipeline_rate, 2),
            "embed_only_chunks_per_s": round(embed_rate, 2),
            "ratio": round(pipeline_rate / embed_rate, 3),
        },
    )


if __name__ == "__main__":
    main()
