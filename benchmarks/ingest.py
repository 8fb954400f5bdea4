"""Ingestion throughput: the whole pipeline against the embedder alone, on the same texts.

    python -m benchmarks.ingest [--corpus DIR] [--docs N] [--rounds 2] [--keep]

Each text is first stored as an uploaded document (the upload's share, timed apart as
``upload_store_seconds``). The pipeline run is then what the ingest queue does with stored
uploads, exactly as ``manage.py ingest`` runs it: read, parse, chunk, embed and write
(binary COPY, BM25 weights, term statistics, HNSW and GIN index maintenance, status and
progress updates). The embed-only run sends the very chunk texts the pipeline embedded
through the same embedder, in the same group size. ``ratio`` = pipeline chunks/s over
embed-only chunks/s: the share of the pipeline's time that is embedding.
After an untimed warm-up pass over the same texts (it loads the model and prepares the
kernels for every input shape, for both sides), embed-only runs and pipeline runs
alternate (``--rounds`` pipeline runs, each between two embed-only runs); each side's
times are averaged. A database of its own (``ragsite_bench_ingest``, dropped after unless
``--keep``) and Redis database 11, emptied first.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

from benchmarks.common import CRANFIELD, ROOT, own_databases, report

DATABASE = "ragsite_bench_ingest"
REDIS_DB = 11


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(CRANFIELD), help="A BEIR-layout folder (default: Cranfield).")
    parser.add_argument("--docs", type=int, default=600, help="How many documents of the corpus to use.")
    parser.add_argument("--rounds", type=int, default=2, help="Pipeline runs, alternated with embed-only runs.")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    args = parser.parse_args()
    with own_databases(DATABASE, REDIS_DB, keep=args.keep):
        result = run(args)
    # Another corpus's figures (a Japanese one) are kept beside the default's, not over them.
    corpus = Path(args.corpus)
    name = "ingest" if corpus.resolve() == CRANFIELD.resolve() else "ingest_" + corpus.name.replace("-", "_")
    report(name, {"corpus": corpus.name, **result})


def run(args) -> dict:
    from django.conf import settings
    from django.db import transaction

    from search import bulk_load as bulk
    from search.analysis import JAPANESE, language_of
    from search.beir import corpus_read, is_beir_dir
    from search.embedders import DEFAULT_EMBEDDER, embedder_get
    from search.ingest.parsers import parse_document
    from search.ingest.pipeline import EMBED_GROUP, document_chunks, embedding_input
    from search.models import Chunk, Document, Workspace
    from search.services import collection_create, document_create, document_delete, workspace_create

    corpus = Path(args.corpus)
    if is_beir_dir(corpus):
        texts = [(doc.title, doc.content()) for doc in corpus_read(corpus) if doc.content()][: args.docs]
    else:  # the demo corpus, repeated with a counter so every text is distinct
        files = sorted((ROOT / "demo" / "corpus").iterdir())
        texts = [(f.stem, f"{f.read_text()}\n\nCopy {i}.") for i in range(args.docs // len(files) + 1) for f in files]
        texts = texts[: args.docs]

    # The embedder a new collection of these texts settles on (search/ingest/pipeline.py):
    # multilingual-e5-small for Japanese, all-MiniLM-L6-v2 otherwise.
    japanese = language_of(" ".join(text for _, text in texts[:50])) == JAPANESE
    embedder = embedder_get(settings.EMBEDDING_MODEL_JAPANESE if japanese else DEFAULT_EMBEDDER)
    # The chunk texts the pipeline will embed, computed with its own functions, so that the
    # embedder alone can run on them before and after the pipeline.
    inputs = []
    for title, text in texts:
        parsed = parse_document(text.encode(), media_type="text/plain")
        chunks = document_chunks(parsed, embedder)
        inputs += [embedding_input(title or parsed.title or "", chunk) for chunk in chunks]

    def embed_only() -> float:
        begun = time.perf_counter()
        for start in range(0, len(inputs), EMBED_GROUP):
            embedder.embed_documents(inputs[start : start + EMBED_GROUP])
        return time.perf_counter() - begun

    embed_only()  # untimed: loads the model and warms the kernels for every input shape, for both sides

    workspace = workspace_create(name="Benchmarks", slug="bench")

    def pipeline_once() -> tuple[float, float, int, int]:
        """Store the texts as uploads in a new collection, then run the pipeline over them."""
        collection = collection_create(workspace=workspace, name=f"ingest-{uuid.uuid4().hex[:8]}")
        try:
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
            store = time.perf_counter() - started
            started = time.perf_counter()
            bulk.ingest_in_batches(ids)
            seconds = time.perf_counter() - started
            failed = Document.objects.filter(collection=collection, status=Document.Status.FAILED).count()
            return store, seconds, failed, Chunk.objects.filter(collection=collection).count()
        finally:
            for document in Document.objects.filter(collection=collection):
                document_delete(document=document)
            collection.delete()

    # Alternate the two sides so that the drift of a noisy machine falls on both alike.
    embed_runs, pipeline_runs, store_runs = [], [], []
    try:
        for _ in range(args.rounds):
            embed_runs.append(embed_only())
            store, seconds, failed, chunk_count = pipeline_once()
            store_runs.append(store)
            pipeline_runs.append(seconds)
            if chunk_count != len(inputs):
                raise SystemExit(
                    f"the pipeline wrote {chunk_count} chunks ({failed} documents failed), "
                    f"the embed-only run had {len(inputs)}"
                )
        embed_runs.append(embed_only())
    finally:
        Workspace.objects.filter(slug="bench", collections__isnull=True).delete()
    embed_seconds = sum(embed_runs) / len(embed_runs)
    pipeline_seconds = sum(pipeline_runs) / len(pipeline_runs)
    store_seconds = sum(store_runs) / len(store_runs)
    chunks = inputs

    pipeline_rate = len(chunks) / pipeline_seconds
    embed_rate = len(chunks) / embed_seconds
    return {
        "embedder": embedder.name,
        "documents": len(texts),
        "rounds": args.rounds,
        "failed": failed,
        "chunks": len(chunks),
        "upload_store_seconds": round(store_seconds, 2),
        "pipeline_seconds": round(pipeline_seconds, 2),
        "embed_only_seconds": round(embed_seconds, 2),
        "pipeline_chunks_per_s": round(pipeline_rate, 2),
        "embed_only_chunks_per_s": round(embed_rate, 2),
        "ratio": round(pipeline_rate / embed_rate, 3),
    }


if __name__ == "__main__":
    main()
