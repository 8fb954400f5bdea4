"""BEIR-layout test collections (``corpus.jsonl``, ``queries.jsonl``, ``qrels/test.tsv``) and
the retrieval metrics computed on them (nDCG@10 with graded gains, Recall@100, MRR@10).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BeirDocument:
    id: str
    title: str
    text: str

    def content(self) -> str:
        """What is ingested: the title as its own first paragraph, then the text.

        BEIR's convention for every model is title + text, even where the text repeats
        its title (as Cranfield's does): the reference figures are measured that way.
        """
        title, text = self.title.strip(), self.text.strip()
        return f"{title}\n\n{text}" if title and text else (text or title)


def is_beir_dir(path: Path) -> bool:
    return (path / "corpus.jsonl").is_file()


def corpus_read(path: Path) -> Iterator[BeirDocument]:
    with open(path / "corpus.jsonl", encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                yield BeirDocument(id=str(row["_id"]), title=row.get("title") or "", text=row.get("text") or "")
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{path / 'corpus.jsonl'} line {line_number}: {exc}") from None


def queries_read(path: Path) -> dict[str, str]:
    with open(path / "queries.jsonl", encoding="utf-8") as handle:
        return {str(row["_id"]): row["text"] for row in map(json.loads, filter(str.strip, handle))}


def qrels_read(path: Path, split: str = "test") -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    with open(path / "qrels" / f"{split}.tsv", encoding="utf-8") as handle:
        reader = csv.reader(handle, delimiter="\t")
        header = next(reader)
        if header[0].isdigit():  # no header line
            qrels.setdefault(header[0], {})[header[1]] = int(header[2])
        for row in reader:
            if len(row) >= 3:
                qrels.setdefault(row[0], {})[row[1]] = int(row[2])
    return qrels


def ndcg_at(ranked: list[str], judged: dict[str, int], k: int = 10) -> float:
    """nDCG@k with the graded score as gain and log2(rank + 1) discount."""
    dcg = sum(judged.get(doc, 0) / math.log2(rank + 2) for rank, doc in enumerate(ranked[:k]))
    ideal = sorted((score for score in judged.values() if score > 0), reverse=True)[:k]
    idcg = sum(score / math.log2(rank + 2) for rank, score in enumerate(ideal))
    return dcg / idcg if idcg else 0.0


def recall_at(ranked: list[str], judged: dict[str, int], k: int = 100) -> float:
    relevant = {doc for doc, score in judged.items() if score > 0}
    return len(relevant & set(ranked[:k])) / len(relevant) if relevant else 0.0


def mrr_at(ranked: list[str], judged: dict[str, int], k: int = 10) -> float:
    for rank, doc in enumerate(ranked[:k]):
        if judged.get(doc, 0) > 0:
            return 1.0 / (rank + 1)
    return 0.0
