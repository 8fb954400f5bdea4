"""In-memory reference rankings that ``manage.py eval_retrieval`` holds ours against.

- BM25: bm25s (k1 1.5, b 0.75, Lucene's IDF) with Lucene's English analysis: its 33 stop
  words, then the Snowball English stemmer (PyStemmer). A query term counts as often as
  the query holds it.
- Dense: exact cosine similarity over whole documents with the collection's embedder.
- Fusion: reciprocal-rank fusion (k = 60) of the two, each to a depth of 100.

bm25s and PyStemmer are evaluation requirements (requirements-dev.txt), imported when a
reference is asked for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from search import analysis
from search.analysis import japanese

RRF_K = 60
FUSION_DEPTH = 100


class ReferenceUnavailable(RuntimeError):
    """A reference's library is not installed."""


def _bm25s():
    try:
        import bm25s
        import Stemmer
    except ImportError as exc:
        raise ReferenceUnavailable(
            f"the BM25 reference needs bm25s and PyStemmer ({exc.name} is missing): pip install -r requirements-dev.txt"
        ) from None
    return bm25s, Stemmer.Stemmer("english")


def _top(scores: np.ndarray, depth: int) -> list[int]:
    """Indices of the best scores, ties in corpus order; documents scoring 0 are left out."""
    order = np.lexsort((np.arange(len(scores)), -scores))[:depth]
    return [int(i) for i in order if scores[i] > 0]


def bm25_rankings(
    texts: Sequence[str],
    queries: Sequence[str],
    *,
    depth: int,
    k1: float = 1.5,
    b: float = 0.75,
    language: str = analysis.ENGLISH,
) -> list[list[int]]:
    """For each query, the indices of ``texts`` that bm25s ranks best. Japanese is split by
    the product's own analyser (search.analysis.japanese), so that the reference differs from
    ours in the ranking only."""
    bm25s, stemmer = _bm25s()
    retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
    if language == analysis.JAPANESE:
        vocabulary: dict[str, int] = {}
        ids = [[vocabulary.setdefault(term, len(vocabulary)) for term in japanese.terms(text)] for text in texts]
        retriever.index(bm25s.tokenization.Tokenized(ids=ids, vocab=vocabulary), show_progress=False)
        asked = [japanese.terms(query) for query in queries]
    else:
        corpus = bm25s.tokenize(list(texts), stopwords="en", stemmer=stemmer, show_progress=False)
        retriever.index(corpus, show_progress=False)
        vocabulary = corpus.vocab
        asked = bm25s.tokenize(list(queries), stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False)
    rankings = []
    for tokens in asked:
        known = [token for token in tokens if token in vocabulary]  # repeats kept: they weigh
        rankings.append(_top(retriever.get_scores(known), depth) if known else [])
    return rankings


def dense_rankings(document_vectors: np.ndarray, query_vectors: np.ndarray, *, depth: int) -> list[list[int]]:
    """Exact cosine similarity, best first."""
    documents = document_vectors / np.maximum(np.linalg.norm(document_vectors, axis=1, keepdims=True), 1e-12)
    queries = query_vectors / np.maximum(np.linalg.norm(query_vectors, axis=1, keepdims=True), 1e-12)
    similarities = queries @ documents.T
    return [[int(i) for i in np.lexsort((np.arange(len(row)), -row))[:depth]] for row in similarities]


def rrf_fuse(first: list[list[int]], second: list[list[int]], *, depth: int = FUSION_DEPTH) -> list[list[int]]:
    """Reciprocal-rank fusion (k = 60) of two rankings per query, each cut to ``depth``."""
    fused = []
    for a, b in zip(first, second, strict=True):
        scores: dict[int, float] = {}
        for ranking in (a[:depth], b[:depth]):
            for rank, index in enumerate(ranking, start=1):
                scores[index] = scores.get(index, 0.0) + 1.0 / (RRF_K + rank)
        fused.append(sorted(scores, key=lambda index: (-scores[index], index)))
    return fused


def top_agreement(first: list, second: list, k: int = 10) -> float:
    """The share of one top-k found in the other (1.0: the same k results, in any order)."""
    a, b = first[:k], second[:k]
    if not a and not b:
        return 1.0
    return len(set(a) & set(b)) / max(len(a), len(b))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def long_question(title: str, text: str, *, min_words: int = 40, max_sentences: int = 4) -> str:
    """A long question built from a document: its title and first sentences (at least
    ``min_words`` words where the text has them), as a paragraph-long query."""
    words = title.split()
    for count, sentence in enumerate(_SENTENCE_END.split(text.strip()), start=1):
        words += sentence.split()
        if len(words) >= min_words or count >= max_sentences:
            break
    return " ".join(words)
