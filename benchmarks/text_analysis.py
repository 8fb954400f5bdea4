"""The cost of reading Japanese: the analyser's throughput and each embedder's, on the same texts.

    python -m benchmarks.text_analysis [--japanese DIR] [--english DIR] [--texts N] [--rounds 3]

- ``analyser_mb_per_s``: MeCab with UniDic through ``search.analysis.japanese.terms`` (NFKC,
  offsets, lemmas of content words), over the Japanese corpus's texts, in MB of UTF-8 per
  second; beside it PostgreSQL's own English analysis of the English corpus
  (``search_tsvector`` under ``search_english``, one statement) for scale.
- ``embedder_texts_per_s``: each embedder (multilingual-e5-small for Japanese, all-MiniLM-L6-v2
  for English, and the multilingual one on English too) over the first ``--texts`` texts of
  each corpus, one call of all of them, after an untimed warm-up; the best of ``--rounds``.

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
    return {
        "japanese_texts": len(japanese_texts),
        "japanese_mb": round(japanese_mb, 3),
        "analyser_mb_per_s": round(japanese_mb / analyser_seconds, 3),
        "postgres_english_mb_per_s": round(english_mb / postgres_seconds, 3),
        "embedder_texts_per_s": rates,
        "texts_per_embedder_run": args.texts,
    }


if __name__ == "__main__":
    main()
