"""Reranking: the reader reorders the first candidates of a fused ranking before an answer's
sources are packed (``SEARCH_RERANK_TOP``, off by default) and in ``eval_retrieval --rerank``.

A candidate's new score is the reader's probability that the passage answers the question (its
best sentence's) plus a prior from its fused rank, ``rank_weight x (1 - rank / top)``: the
reader alone ranks below the fusion on JSQuAD's held-out half, the two together above it.
docs/search.md, "Reranking".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from django.conf import settings

from search.answering import reader
from search.answering.abstention import Unit, sentence_units
from search.selectors import SearchHit


@dataclass
class Reranked:
    hits: list[SearchHit]
    top: int  # candidates reordered (0: none)
    ms: float = 0.0
    why_not: str | None = None  # why the ranking was left as fused
    scores: list[float] = field(default_factory=list)  # the reader's, of the first ``top`` as fused
    reader: str | None = None  # the version of the weights that read them

    def as_record(self) -> dict:
        """What reranking did, for an answer's stats."""
        if self.why_not:
            return {"top": 0, "why_not": self.why_not}
        return {"top": self.top, "ms": round(self.ms, 1), "reader": self.reader}


def _units(hit: SearchHit) -> list[Unit]:
    # A chunk without a quotable sentence (a table row, a heading and a phrase) is read whole.
    return sentence_units(hit.text) or [Unit(number=0, sentence=" ".join(hit.text.split()))]


def reranked(question: str, hits: Sequence[SearchHit], top: int, rank_weight: float | None = None) -> Reranked:
    """``hits`` with the first ``top`` reordered by the reader and the fused rank, the rest as
    they were; as fused, saying why, when the reader cannot load."""
    hits = list(hits)
    if top < 2:
        return Reranked(hits=hits, top=0, why_not=f"reranking off (top {top})")
    top = min(top, len(hits))
    if top < 2:
        return Reranked(hits=hits, top=0, why_not="fewer than two candidates")
    weight = settings.SEARCH_RERANK_RANK_WEIGHT if rank_weight is None else rank_weight
    started = time.perf_counter()
    read = reader.passages_answer(question, [(hit.document_title, _units(hit)) for hit in hits[:top]])
    if read is None:
        return Reranked(hits=hits, top=0, why_not=reader.reader_load_error() or "the reader could not run")
    combined = [p + weight * (1 - rank / top) for rank, p in enumerate(read)]
    order = sorted(range(top), key=lambda rank: (-combined[rank], rank))
    return Reranked(
        hits=[hits[rank] for rank in order] + hits[top:],
        top=top,
        ms=(time.perf_counter() - started) * 1000,
        scores=read,
        reader=reader.reader_loaded().version,
    )
