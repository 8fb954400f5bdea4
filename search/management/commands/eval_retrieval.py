"""``manage.py eval_retrieval DIR``: retrieval quality and latency on a BEIR-layout collection.

The corpus is ingested into its own collection (reused when already there), every judged
query goes through ``chunk_search`` (the service the API uses) as a question, and
document scores come from each document's best chunk. The last line printed is one JSON
object.

``--against-bm25`` also ranks with bm25s (search/reference_rankings.py) and reports how far
the keyword ranking agrees with it, top 10 against top 10: over the same chunks (the
ranking function alone) and over whole documents (chunking included), on the collection's
questions and on long questions built from the corpus itself (a document's title and first
sentences). ``--references`` adds the exact dense and fused references and evaluates every
mode against them. ``--beside OTHER_DIR ...`` asks over a workspace that also holds those
collections (each ingested once into its own collection), as the UI's default asks over all.

``--conversational`` asks each judged question as a conversation instead
(search/conversational_eval.py): the question alone, the rule's follow-up alone, and the
follow-up read with its first turn by ``search.answering.conversations.followup_terms``, all judged
with the question's qrels; ``--followups PATH`` adds a written sample of such turns.

``--rerank N`` reorders each ranking's first N documents by the reader
(search/answering/reranking.py), as ``SEARCH_RERANK_TOP`` does for an answer's sources; ``--half
even|odd`` asks every other judged question (the reader learned from JSQuAD's even half).
"""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from django.conf import settings
from django.core.management.base import CommandError
from django.db import connections
from tqdm import tqdm

from inference import router
from ragsite.commands import DatabaseCommand
from search import analysis
from search import bulk_load as bulk
from search import conversational_eval as conversational
from search import reference_rankings as reference
from search.access import OPERATOR
from search.answering import reader, reranking, rewriting
from search.answering.conversations import Turn, followup_terms
from search.beir import corpus_read, is_beir_dir, mrr_at, ndcg_at, qrels_read, queries_read, recall_at
from search.embedders import embedder_get
from search.models import Chunk, Collection, Document
from search.selectors import MODES, chunk_search
from search.services import workspace_create

DEPTH = 100  # documents ranked per query (Recall@100)
# How a conversation's question is asked: alone, its follow-up alone, the follow-up read with its first turn.
VARIANTS = ("standalone", "followup_alone", "followup_terms")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 4) if values else 0.0


class Command(DatabaseCommand):
    help = "Evaluate retrieval (nDCG@10, Recall@100, MRR@10, latency) on a BEIR-layout collection."

    def add_arguments(self, parser):
        parser.add_argument("directory", type=Path)
        parser.add_argument("--mode", choices=MODES, default="hybrid")
        parser.add_argument("--split", default="test")
        parser.add_argument(
            "--candidates", type=int, default=None, help="Documents taken from each ranking (default: the product's)."
        )
        parser.add_argument("--workspace", default="eval")
        parser.add_argument(
            "--half",
            choices=("even", "odd"),
            default=None,
            help="Every other judged question only (the first, third, ... or the second, fourth, ...): "
            "tune on one half, report on the other.",
        )
        parser.add_argument(
            "--rerank",
            type=int,
            default=0,
            metavar="N",
            help="Reorder each ranking's first N documents by the reader (search/answering/reranking.py).",
        )
        parser.add_argument(
            "--language",
            default=Collection._meta.get_field("text_search_config").default,
            help="The collection's text-search configuration (a collection of its own per configuration).",
        )
        parser.add_argument(
            "--against-bm25", action="store_true", help="Compare the keyword ranking with bm25s (top-10 agreement)."
        )
        parser.add_argument(
            "--references", action="store_true", help="Every mode against in-memory references (BM25, dense, fusion)."
        )
        parser.add_argument(
            "--beside",
            nargs="+",
            type=Path,
            default=[],
            metavar="OTHER_DIR",
            help=(
                "Also hold these BEIR collections in the workspace, each its own collection, and ask over all of"
                " them at once, as the UI's default does: their documents are never relevant."
            ),
        )
        parser.add_argument("--long-questions", type=int, default=200, help="Long questions built from the corpus.")
        parser.add_argument("--seed", type=int, default=0, help="Which documents the long questions come from.")
        parser.add_argument(
            "--conversational",
            action="store_true",
            help="Each judged question as a first turn and a follow-up (search/conversational_eval.py).",
        )
        parser.add_argument(
            "--followups",
            type=Path,
            default=None,
            help="With --conversational: a written sample (JSONL of query_id, first_turn, followup) beside the rule's.",
        )
        parser.add_argument(
            "--rewrite-route",
            default=None,
            help=(
                "With --conversational: also each follow-up rewritten by this route's model"
                " (search/answering/rewriting.py), as answers do; needs its workers running (python3 dev.py up)."
            ),
        )
        parser.add_argument(
            "--rewrite-concurrency", type=int, default=8, help="Rewrites in flight at once (the pool batches them)."
        )

    def handle(self, *args, directory: Path, mode: str, split: str, workspace: str, language: str, **options):
        if not is_beir_dir(directory):
            raise CommandError(f"{directory} is not a BEIR-layout collection (no corpus.jsonl)")
        if options["followups"] and not options["conversational"]:
            raise CommandError("--followups goes with --conversational")
        if options["conversational"] and (options["against_bm25"] or options["references"]):
            raise CommandError("--conversational is a run of its own: without --against-bm25 or --references")
        if options["rewrite_route"] and not options["conversational"]:
            raise CommandError("--rewrite-route goes with --conversational")
        self.rewrite_route = options["rewrite_route"]
        self.rewrite_concurrency = max(1, options["rewrite_concurrency"])
        self.candidates = options["candidates"]
        self.rerank = options["rerank"]
        if self.rerank and (options["conversational"] or options["against_bm25"] or options["references"]):
            raise CommandError("--rerank is a plain run: without --conversational, --against-bm25 or --references")
        if self.rerank and (error := reader.reader_load_error()):
            raise CommandError(f"--rerank: {error}")
        for other in options["beside"]:
            if not is_beir_dir(other):
                raise CommandError(f"{other} is not a BEIR-layout collection (no corpus.jsonl)")
            if other.resolve() == directory.resolve():
                raise CommandError(f"--beside {other} is the collection asked over")
        if options["beside"] and (options["conversational"] or options["against_bm25"] or options["references"]):
            raise CommandError("--beside is a run of its own: without --conversational, --against-bm25 or --references")
        self.collection = self._ensure_ingested(directory, workspace, language)
        self.beside = [self._ensure_ingested(other, workspace, language) for other in options["beside"]]
        queries = queries_read(directory)
        qrels = qrels_read(directory, split)
        judged = [qid for qid in queries if qid in qrels]
        if not judged:
            raise CommandError(f"no query of queries.jsonl is judged in qrels/{split}.tsv")
        if options["half"]:
            judged = judged[(options["half"] == "odd") :: 2]
        self.beir_ids = {
            pk: meta.get("beir_ids", [])
            for pk, meta in Document.objects.filter(collection=self.collection).values_list("pk", "metadata")
        }
        questions = [queries[qid] for qid in judged]
        judgements = [qrels[qid] for qid in judged]
        summary: dict = {"collection": directory.name, "queries": len(judged)}
        if options["half"]:
            summary["half"] = options["half"]
        if self.beside:
            summary["beside"] = [other.name for other in options["beside"]]
        if options["conversational"]:
            summary["mode"] = mode
            summary.update(
                self._conversational(mode, {qid: queries[qid] for qid in judged}, qrels, options["followups"])
            )
            self.stdout.write(json.dumps(summary))
            return
        if not (options["against_bm25"] or options["references"]):
            summary["mode"] = mode
            if self.rerank:
                summary["rerank"] = {"top": self.rerank, "rank_weight": settings.SEARCH_RERANK_RANK_WEIGHT}
            summary.update(self._evaluate(mode, questions, judgements)[0])
            self.stdout.write(json.dumps(summary))
            return
        try:
            summary.update(self._compare(directory, questions, judgements, options))
        except reference.ReferenceUnavailable as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(json.dumps(summary))

    # ------------------------------------------------------------------ ours

    def _ranked(self, question: str, mode: str) -> tuple[list[str], float]:
        """Our ranking of corpus ids for a question, and how long it took (ms)."""
        started = time.perf_counter()
        result = chunk_search(
            query=question,
            workspace=self.collection.workspace,
            collection_ids=[self.collection.pk, *(other.pk for other in self.beside)],
            mode=mode,
            top_k=DEPTH,
            per_document=True,
            candidates=self.candidates,
            snippets=False,
            syntax="question",
            reader=OPERATOR,  # the whole collection, whoever may read which part of it
        )
        hits = result.hits
        if self.rerank:
            hits = reranking.reranked(question, hits, self.rerank).hits
        elapsed = (time.perf_counter() - started) * 1000
        # A document of a collection beside holds its place in the ranking, judged irrelevant.
        ranked = [
            doc_id for hit in hits for doc_id in self.beir_ids.get(hit.document_id, [f"beside:{hit.document_id}"])
        ]
        return ranked, elapsed

    def _evaluate(self, mode: str, questions: list[str], judgements: list[dict]) -> tuple[dict, list[list[str]]]:
        rankings, latencies = [], []
        for question in tqdm(questions, desc=f"eval {mode}", unit="q", disable=None):
            ranked, elapsed = self._ranked(question, mode)
            rankings.append(ranked)
            latencies.append(elapsed)
        figures = _metrics(rankings, judgements)
        figures["p50_ms"] = round(percentile(latencies, 0.5), 2)
        figures["p99_ms"] = round(percentile(latencies, 0.99), 2)
        return figures, rankings

    # ------------------------------------------------------------------ conversations

    def _conversational(self, mode: str, questions: dict[str, str], qrels: dict, followups: Path | None) -> dict:
        """The three variants' figures on the rule's conversations, and on the written ones
        when given (over their query ids only, the standalone question's beside them)."""
        built = conversational.conversations_built(questions, [self.collection])
        try:
            written = conversational.followups_read(followups, questions) if followups else []
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        rule_rankings = self._conversation_rankings(mode, built, standalone=None)
        out: dict = {"rule": self._conversation_figures(built, rule_rankings, qrels)}
        self._rewrite_report(out["rule"])
        lines = [("rule", out["rule"])]
        out["written"] = None
        if written:
            # The standalone questions are the rule's own, searched already: the same rankings.
            by_id = {conversation.query_id: i for i, conversation in enumerate(built)}
            standalone = [rule_rankings["standalone"][by_id[conversation.query_id]] for conversation in written]
            rankings = self._conversation_rankings(mode, written, standalone=standalone)
            figures = self._conversation_figures(written, rankings, qrels)
            self._rewrite_report(figures)
            same_ids = [built[by_id[conversation.query_id]] for conversation in written]
            rule_same_ids = self._conversation_figures(
                same_ids,
                {name: [ranking[by_id[c.query_id]] for c in written] for name, ranking in rule_rankings.items()},
                qrels,
            )
            figures["path"] = str(followups)
            figures["rule_same_queries"] = {
                key: rule_same_ids[key] for key in ("followup_alone_ndcg@10", "followup_terms_ndcg@10", "terms_ratio")
            }
            out["written"] = figures
            lines += [("written", figures), ("rule, same", rule_same_ids)]
        self._conversation_table(lines)
        return out

    def _conversation_rankings(
        self, mode: str, conversations: list[conversational.ConversationalQuery], standalone: list | None
    ) -> dict[str, list[list[str]]]:
        """Each variant's rankings; ``standalone``: the questions' rankings when searched already."""
        readings = [
            followup_terms(c.followup, [Turn(question=c.first_turn, answer="")], [self.collection])
            for c in conversations
        ]
        texts = {
            "standalone": [c.question for c in conversations],
            "followup_alone": [c.followup for c in conversations],
            "followup_terms": [reading.query for reading in readings],
        }
        if self.rewrite_route:
            texts["followup_model"] = self._rewrites(conversations, readings)
        rankings = {"standalone": standalone} if standalone is not None else {}
        for name in self._variants():
            if name not in rankings:
                rankings[name] = [self._ranked(text, mode)[0] for text in tqdm(texts[name], desc=name, disable=None)]
        return rankings

    def _rewrite_report(self, figures: dict) -> None:
        """How many of the set's rewrites fell back (by reason), and a few rewrites to read."""
        if self.rewrite_route:
            figures["model_route"] = self.rewrite_route
            figures["model_fallbacks"] = dict(self.rewrite_fallbacks)
            figures["model_samples"] = self.rewrite_samples

    def _variants(self) -> tuple[str, ...]:
        return (*VARIANTS, "followup_model") if self.rewrite_route else VARIANTS

    def _rewrites(self, conversations, readings) -> list[str]:
        """Each follow-up as the route's model rewrites it for an answer (``search.answering.rewriting``),
        or, where the rewrite fails or is late, the term-based reading answers fall back to
        (counted in ``self.rewrite_fallbacks``, with the reasons)."""

        def submit(planned, request, **fields):
            router.submit(planned, messages=request.messages, max_tokens=request.max_tokens, **fields)

        def rewrite(item):
            conversation, reading = item
            try:
                plan = router.plan(route_name=self.rewrite_route, client_id="eval", request_id=str(uuid.uuid4()))
                return rewriting.followup_rewrite(
                    conversation.followup, [Turn(question=conversation.first_turn, answer="")], plan, submit
                ), ""
            except rewriting.RewriteFailed as exc:
                return reading.query, str(exc)
            finally:
                connections.close_all()  # this thread's: the pool's threads end without closing them

        with ThreadPoolExecutor(self.rewrite_concurrency) as pool:
            done = list(
                tqdm(
                    pool.map(rewrite, zip(conversations, readings, strict=True)),
                    total=len(conversations),
                    desc="rewrite",
                )
            )
        self.rewrite_fallbacks = Counter(reason.split(":")[0] for _, reason in done if reason)
        self.rewrite_samples = [
            {"followup": c.followup, "rewritten": text} for c, (text, reason) in zip(conversations, done, strict=True)
        ][:5]
        return [text for text, _ in done]

    @staticmethod
    def _conversation_figures(conversations, rankings: dict[str, list[list[str]]], qrels: dict) -> dict:
        judgements = [qrels[c.query_id] for c in conversations]
        figures: dict = {"queries": len(conversations)}
        variants = tuple(name for name in (*VARIANTS, "followup_model") if name in rankings)
        for name in variants:
            figures.update(
                {f"{name}_{metric}": value for metric, value in _metrics(rankings[name], judgements).items()}
            )
        standalone = figures["standalone_ndcg@10"]
        figures["alone_ratio"] = round(figures["followup_alone_ndcg@10"] / standalone, 4) if standalone else None
        figures["terms_ratio"] = round(figures["followup_terms_ndcg@10"] / standalone, 4) if standalone else None
        if "followup_model" in variants:
            figures["model_ratio"] = round(figures["followup_model_ndcg@10"] / standalone, 4) if standalone else None
        return figures

    def _conversation_table(self, lines: list[tuple[str, dict]]) -> None:
        self.stdout.write("nDCG@10 / Recall@100 / MRR@10 of each way of asking; ratios of nDCG@10 to standalone's")
        variants = self._variants()
        header = ["set", "queries", *variants, "alone / standalone", "terms / standalone"]
        if "followup_model" in variants:
            header.append("model / standalone")
        rows = [
            [
                label,
                str(figures["queries"]),
                *(
                    " / ".join(f"{figures[f'{name}_{metric}']:.4f}" for metric in ("ndcg@10", "recall@100", "mrr@10"))
                    for name in variants
                ),
                f"{figures['alone_ratio']}",
                f"{figures['terms_ratio']}",
                *([f"{figures['model_ratio']}"] if "followup_model" in variants else []),
            ]
            for label, figures in lines
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            self.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())

    # ------------------------------------------------------------------ references

    def _compare(self, directory: Path, questions: list[str], judgements: list[dict], options) -> dict:
        corpus = list(corpus_read(directory))
        ids = [document.id for document in corpus]
        texts = [document.content() for document in corpus]
        out: dict = {}
        # The chunks we index, read once: bm25s ranks them too (the same units as ours).
        self.chunks = list(
            Chunk.objects.filter(collection=self.collection, embedding_model=self.collection.embedding_model)
            .order_by("pk")
            .values_list("document_id", "text")
        )
        per_document = Counter(document_id for document_id, _ in self.chunks)
        self.multi_chunk_documents = sum(1 for count in per_document.values() if count > 1)

        def as_ids(rankings: list[list[int]]) -> list[list[str]]:
            return [[ids[i] for i in ranking] for ranking in rankings]

        # The corpus's language, as the collection read it (auto: each text's own; a sample decides here).
        language = self.language = analysis.language_resolved(self.collection.language, " ".join(texts[:200]))
        bm25 = reference.bm25_rankings(
            texts, questions, depth=DEPTH, k1=settings.BM25_K1, b=settings.BM25_B, language=language
        )
        keyword, keyword_rankings = self._evaluate("keyword", questions, judgements)
        out["keyword_vs_bm25s"] = self._agreement(
            keyword_rankings, as_ids(bm25), questions, judgements, _metrics(as_ids(bm25), judgements)
        )

        rng = random.Random(options["seed"])  # noqa: S311 (a reproducible sample, not a secret)
        askable = [i for i, document in enumerate(corpus) if document.content()]
        sampled = rng.sample(askable, min(options["long_questions"], len(askable)))
        long_questions = [reference.long_question(corpus[i].title, corpus[i].text) for i in sampled]
        long_judgements = [{ids[i]: 1} for i in sampled]  # the document the question was built from
        long_bm25 = as_ids(
            reference.bm25_rankings(
                texts, long_questions, depth=DEPTH, k1=settings.BM25_K1, b=settings.BM25_B, language=language
            )
        )
        long_ours = [self._ranked(q, "keyword")[0] for q in tqdm(long_questions, desc="long", disable=None)]
        out["long_questions"] = {
            "count": len(long_questions),
            "words_mean": round(statistics.fmean(len(q.split()) for q in long_questions), 1),
            **self._agreement(
                long_ours, long_bm25, long_questions, long_judgements, _metrics(long_bm25, long_judgements)
            ),
        }
        if not options["references"]:
            out["keyword"] = keyword
            return out

        embedder = embedder_get(self.collection.embedding_model)
        self.stderr.write(f"embedding {len(texts)} documents for the exact dense reference")
        document_vectors = np.concatenate(
            [embedder.embed_documents(texts[start : start + 256]) for start in range(0, len(texts), 256)]
        )
        query_vectors = np.stack([embedder.embed_query(question) for question in questions])
        dense = reference.dense_rankings(document_vectors, query_vectors, depth=DEPTH)
        fused = reference.rrf_fuse(bm25, dense)
        references = {"keyword": bm25, "dense": dense, "hybrid": fused}
        modes = {"keyword": keyword}
        for mode in ("dense", "hybrid"):
            modes[mode] = self._evaluate(mode, questions, judgements)[0]
        for mode, figures in modes.items():
            expected = _metrics(as_ids(references[mode]), judgements)
            figures["reference_ndcg@10"] = expected["ndcg@10"]
            figures["reference_recall@100"] = expected["recall@100"]
            figures["ndcg@10_minus_reference"] = round(figures["ndcg@10"] - expected["ndcg@10"], 4)
            out[mode] = figures
        out["references"] = {
            "keyword": (
                "bm25s, the product's Japanese analyser (MeCab, UniDic lemmas of content words), k1 1.5, b 0.75"
                if language == analysis.JAPANESE
                else "bm25s, Lucene's English stop words, Snowball (PyStemmer), k1 1.5, b 0.75"
            ),
            "dense": f"exact cosine, {self.collection.embedding_model}, whole documents",
            "hybrid": f"reciprocal-rank fusion of the two, k = {reference.RRF_K}, depth {reference.FUSION_DEPTH}",
        }
        return out

    def _agreement(self, ours, bm25, questions, judgements, bm25_figures) -> dict:
        """Top-10 agreement of our keyword ranking with bm25s over the same units, our chunks
        (a document ranked by its best chunk, as ours is), and with bm25s over whole
        documents, which also counts what chunking changes: a document longer than the
        embedder's window is scored by its best passage instead of as a whole."""
        chunks = self.chunks
        per_chunk = reference.bm25_rankings(
            [text for _, text in chunks],
            questions,
            depth=DEPTH * 3,
            k1=settings.BM25_K1,
            b=settings.BM25_B,
            language=self.language,
        )
        same_chunks = []
        for ranking in per_chunk:
            documents = list(dict.fromkeys(chunks[i][0] for i in ranking))  # best chunk first
            same_chunks.append([doc_id for pk in documents for doc_id in self.beir_ids.get(pk, [])])
        figures = _metrics(ours, judgements)
        return {
            "top10_agreement": _mean([reference.top_agreement(a, b) for a, b in zip(ours, same_chunks, strict=True)]),
            "top10_agreement_whole_documents": _mean(
                [reference.top_agreement(a, b) for a, b in zip(ours, bm25, strict=True)]
            ),
            "multi_chunk_documents": self.multi_chunk_documents,
            "ndcg@10": figures["ndcg@10"],
            "bm25s_ndcg@10": bm25_figures["ndcg@10"],
            "ndcg@10_minus_bm25s": round(figures["ndcg@10"] - bm25_figures["ndcg@10"], 4),
        }

    # ------------------------------------------------------------------ ingestion

    def _ensure_ingested(self, directory: Path, workspace_slug: str, language: str) -> Collection:
        workspace = workspace_create(name=workspace_slug.title(), slug=workspace_slug)
        try:
            return bulk.beir_collection_ingested(
                workspace, directory, text_search_config=language, log=self.stderr.write
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None


def _metrics(rankings: list[list[str]], judgements: list[dict]) -> dict:
    return {
        "ndcg@10": _mean([ndcg_at(r, j, 10) for r, j in zip(rankings, judgements, strict=True)]),
        "recall@100": _mean([recall_at(r, j, 100) for r, j in zip(rankings, judgements, strict=True)]),
        "mrr@10": _mean([mrr_at(r, j, 10) for r, j in zip(rankings, judgements, strict=True)]),
    }
