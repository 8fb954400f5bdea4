"""The reader alone, against the signals it replaced, on pairs it was not trained on; and its cost.

    python -m benchmarks.reader [--answers N] [--rounds 1]

- ``auc``: for each held-out group of ``search.answering.reader_training.examples(held_out=True)`` (JSQuAD's odd half
  and its hard negatives; the demo handbook's held-out and unseen questions against every demo
  chunk that holds or lacks their answer; the verification sets' claims on files the reader never
  saw, and claims made from JSQuAD's odd half), the area under the ROC curve of the reader's
  score of each (question, passage) or (claim, passage) pair, beside that of the lexical and
  dense signals it replaced on the same pairs: ``sentences_score(...).best`` (abstention's
  relevance: cosine, weighted term coverage, kinds of answer) for answers, ``support_table``'s
  score (verification: cosine, lexemes, names, values) for supports. The embedder and
  text-search configuration are the demo's for the passage's language (multilingual-e5-small
  under search_japanese for Japanese, all-MiniLM-L6-v2 under search_english for English);
  ``today_plus_reader``: the pair's signal plus ``READER_WEIGHT`` x the reader's, as
  ``ANSWER_READER=reader`` scores sentences.
- ``cpu_ms_per_answer``: process CPU milliseconds of the reader reading one question against the
  passages an answer gets (JSQuAD's held-out questions, each against its own paragraph and its
  negatives: ``passages_per_answer`` on average), nothing cached, at torch's default threads;
  ``wall_ms_per_answer`` beside it.

Needs ``../shared/data/jsquad-ja``. Runs against a database of its own (``ragsite_bench_reader``,
dropped after): the baseline's lexemes come from PostgreSQL.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

from benchmarks.common import own_databases, report

DATABASE = "ragsite_bench_reader"
REDIS_DB = 13
SEED = 49  # train_reader's: the same held-out pairs as the weights' manifest reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=int, default=60, help="Held-out questions timed for the cost.")
    args = parser.parse_args()
    with own_databases(DATABASE, REDIS_DB):
        result = run(args)
    report("reader", result)


def _texts_by_passage() -> dict[tuple, str]:
    """Each training/test passage's text, by (title, segments): the baseline reads the text."""
    import json

    from search.answering import reader_training as training

    texts = {}
    records = [json.loads(line) for line in open(training.JSQUAD / "corpus.jsonl", encoding="utf-8")]
    for passage in [*training.demo_passages(), *(training._passage(record) for record in records)]:
        texts[(passage["title"], passage["segments"])] = passage["text"]
    return texts


def _baseline(example, text: str) -> float:
    from search.analysis import JAPANESE, language_of
    from search.answering.abstention import sentences_score
    from search.answering.prompting import Source
    from search.answering.verification import support_table
    from search.reader.model import ANSWERS

    japanese = language_of(text) == JAPANESE
    model, config = ("multilingual-e5-small", "search_japanese") if japanese else ("all-MiniLM-L6-v2", "search_english")
    pair = example.pair
    if example.output == ANSWERS:
        source = Source(1, 1, 1, pair.title, text, 0, len(text), 1.0)
        return sentences_score(
            pair.question, [source], embedding_model=model, text_search_config=config, read=False
        ).best
    passage = f"{pair.title}\n{text}" if pair.title else text
    return support_table([pair.question], [passage], embedding_model=model, text_search_config=config).score(0, 0)


def run(args) -> dict:
    from search.answering import reader_training as training
    from search.answering.abstention import READER_WEIGHT
    from search.reader.model import ANSWERS, ReaderModel

    rng = random.Random(SEED)  # noqa: S311 (a reproducible sample, not a secret)
    training.examples(rng, held_out=False)  # drawn first, as train_reader draws them: the same test pairs
    tests = training.examples(rng, held_out=True)
    texts = _texts_by_passage()
    reader = ReaderModel()
    groups: dict[str, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
    for output in (0, 1):
        chosen = [example for example in tests if example.output == output]
        read = reader.scores([example.pair for example in chosen], output)
        for example, scores in zip(chosen, read, strict=True):
            reader_scores, baseline_scores, labels = groups[example.group]
            reader_scores.append(max(scores, default=0.0))
            baseline_scores.append(_baseline(example, texts[(example.pair.title, example.pair.sentences)]))
            labels.append(example.label)
    auc = {
        group: {
            "kind": "answers" if group in ("jsquad", "demo-en", "demo-ja") else "supports",
            "pairs": len(labels),
            "positives": sum(labels),
            "reader": round(training.auc(reader_scores, labels), 4),
            "today": round(training.auc(baseline_scores, labels), 4),
            "today_plus_reader": round(
                training.auc(
                    [t + READER_WEIGHT * r for t, r in zip(baseline_scores, reader_scores, strict=True)], labels
                ),
                4,
            ),
        }
        for group, (reader_scores, baseline_scores, labels) in sorted(groups.items())
    }
    # The cost: a held-out JSQuAD question against its passages, as an answer reads them.
    by_question: dict[str, list] = defaultdict(list)
    for example in tests:
        if example.group == "jsquad" and example.output == ANSWERS:
            by_question[example.pair.question].append(example.pair)
    questions = list(by_question.values())[: args.answers]
    reader.scores(questions[0], ANSWERS)  # warm-up, untimed
    cpu, wall = time.process_time(), time.perf_counter()
    for pairs in questions:
        reader.scores(pairs, ANSWERS)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "reader_version": reader.version,
        "auc": auc,
        "answers_timed": len(questions),
        "passages_per_answer": round(sum(map(len, questions)) / len(questions), 2),
        "cpu_ms_per_answer": round(1000 * cpu / len(questions), 1),
        "wall_ms_per_answer": round(1000 * wall / len(questions), 1),
    }


if __name__ == "__main__":
    main()
