"""``manage.py eval_retrieval DIR``: retrieval quality and latency on a BEIR-layout collection.

The corpus is ingested into its own collection (reused when already there), every judged
query goes through ``chunk_search`` (the service the API uses), and document scores come
from each document's best chunk. The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from search import bulk_load as bulk
from search.beir import is_beir_dir, mrr_at, ndcg_at, qrels_read, queries_read, recall_at
from search.ingest.pipeline import collection_bm25_refresh
from search.models import Collection, Document
from search.selectors import MODES, chunk_search
from search.services import collection_create, workspace_create


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


class Command(BaseCommand):
    help = "Evaluate retrieval (nDCG@10, Recall@100, MRR@10, latency) on a BEIR-layout collection."

    def add_arguments(self, parser):
        parser.add_argument("directory", type=Path)
        parser.add_argument("--mode", choices=MODES, default="hybrid")
        parser.add_argument("--split", default="test")
        parser.add_argument("--candidates", type=int, default=200, help="Chunks taken from each ranking.")
        parser.add_argument("--workspace", default="eval")

    def handle(self, *args, directory: Path, mode: str, split: str, candidates: int, workspace: str, **options):
        if not is_beir_dir(directory):
            raise CommandError(f"{directory} is not a BEIR-layout collection (no corpus.jsonl)")
        collection = self._ensure_ingested(directory, workspace)
        queries = queries_read(directory)
        qrels = qrels_read(directory, split)
        judged = [qid for qid in queries if qid in qrels]
        if not judged:
            raise CommandError(f"no query of queries.jsonl is judged in qrels/{split}.tsv")
        beir_ids = {
            pk: meta.get("beir_ids", [])
            for pk, meta in Document.objects.filter(collection=collection).values_list("pk", "metadata")
        }
        ndcg, recall, mrr, latencies = [], [], [], []
        for qid in tqdm(judged, desc=f"eval {mode}", unit="q", disable=None):
            started = time.perf_counter()
            result = chunk_search(
                query=queries[qid],
                workspace=collection.workspace,
                collection_ids=[collection.pk],
                mode=mode,
                top_k=100,
                per_document=True,
                candidates=candidates,
                snippets=False,
            )
            latencies.append((time.perf_counter() - started) * 1000)
            ranked = [doc_id for hit in result.hits for doc_id in beir_ids.get(hit.document_id, [])]
            ndcg.append(ndcg_at(ranked, qrels[qid], 10))
            recall.append(recall_at(ranked, qrels[qid], 100))
            mrr.append(mrr_at(ranked, qrels[qid], 10))
        summary = {
            "collection": directory.name,
            "mode": mode,
            "queries": len(judged),
            "ndcg@10": round(statistics.fmean(ndcg), 4),
            "recall@100": round(statistics.fmean(recall), 4),
            "mrr@10": round(statistics.fmean(mrr), 4),
            "p50_ms": round(percentile(latencies, 0.5), 2),
            "p99_ms": round(percentile(latencies, 0.99), 2),
        }
        self.stdout.write(json.dumps(summary))

    def _ensure_ingested(self, directory: Path, workspace_slug: str) -> Collection:
        workspace = workspace_create(name=workspace_slug.title(), slug=workspace_slug)
        collection = collection_create(workspace=workspace, name=f"beir:{directory.resolve().name}")
        new, refused = bulk.beir_store(collection, directory)
        if refused and new:
            self.stderr.write(f"{len(refused)} corpus entries refused, e.g. {refused[0]}")
        todo = bulk.pending(collection)
        if todo:
            self.stderr.write(f"ingesting {len(todo)} documents ({len(new)} new) into {collection.name}")
            with tqdm(total=len(todo), unit="doc", desc="ingest", disable=None) as bar:
                bulk.ingest_in_batches(todo, on_documents_done=bar.update)
            collection_bm25_refresh(collection_id=collection.pk)
        failed = Document.objects.filter(collection=collection, status=Document.Status.FAILED)
        for document in failed[:20]:
            self.stderr.write(f"failed: {document.source_name}: {document.error}")
        return collection
