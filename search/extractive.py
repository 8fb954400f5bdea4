"""The answer without a generation model: the sentences of the top chunks that best match the question.

Used when no generation route is configured (``inference.errors.NoRouteConfigured``), so
that a fresh install with only the embedded stack still answers. The text quotes the
sources verbatim, one sentence per line, each followed by its source's ``[n]``, under a
line saying that it is extracted, not generated.

Scoring a sentence (higher is better):

- cosine similarity of the sentence to the question with the collection's own embedding
  model (the model that ranked the chunks; the question's vector is cached in Redis);
- plus half the share of the question's words that the sentence contains, compared as
  PostgreSQL lexemes of the collection's text-search configuration (its stemmer and stop
  words: the same normalisation as keyword search); without a configuration, lower-cased
  words on their first five letters, stop words left out;
- minus 0.02 per rank of the sentence's source, so ties go to the better chunk.

When the embedder cannot run (a remote embedding API that is down), words alone decide.
Sentences repeated across overlapping chunks are quoted once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from search.embedders import EmbedderError, embedder_get, query_embedding
from search.prompting import Source

logger = logging.getLogger(__name__)

MAX_SENTENCES = 3
MIN_SENTENCE_CHARS = 12
MAX_SENTENCE_CHARS = 600
LEAD = "Extracted from the sources (no generation model is configured):"
NOTHING_FOUND = "The searched collections hold no passage that matches the question."

_SENTENCE_END = re.compile(r"(?<=[.!?\u2026\u3002\uff01\uff1f])\s+|\n+")
_WORD = re.compile(r"\w+")
STOP_WORDS = frozenset(
    """a an and are as at be by can could did do does for from had has have how i if in into is it its
    me my no not of on or our shall should so than that the their them then there these they this those
    to was we were what when where which who whom why will with would you your""".split()
)


@dataclass(frozen=True)
class Extract:
    number: int
    sentence: str
    score: float


@dataclass(frozen=True)
class ExtractiveAnswer:
    text: str
    extracts: list[Extract]


def sentences_of(text: str) -> list[str]:
    """The sentences of a chunk, verbatim; Markdown headings and fragments too short to
    say anything are skipped."""
    sentences = []
    for part in _SENTENCE_END.split(text):
        sentence = part.strip()
        if sentence.startswith("#") or len(sentence) < MIN_SENTENCE_CHARS or len(_WORD.findall(sentence)) < 3:
            continue
        sentences.append(sentence)
    return sentences


def _terms(text: str) -> set[str]:
    return {word[:5] for word in _WORD.findall(text.lower()) if word not in STOP_WORDS and len(word) > 1}


def _lexemes(texts: list[str], config: str | None) -> list[set[str]]:
    """Each text's lexemes under a text-search configuration (one query for all)."""
    if not config:
        return [_terms(text) for text in texts]
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT array(SELECT lexeme FROM unnest(search_tsvector(%s::regconfig, t))"
            " WHERE search_bm25_lexeme(lexeme))"
            " FROM unnest(%s::text[]) WITH ORDINALITY AS x(t, i) ORDER BY i",
            [config, texts],
        )
        return [set(row[0]) for row in cursor.fetchall()]


def _dense_scores(question: str, sentences: list[str], embedding_model: str) -> np.ndarray | None:
    try:
        query = query_embedding(embedding_model, question)
        vectors = np.asarray(embedder_get(embedding_model).embed_documents(sentences), dtype=np.float32)
    except (EmbedderError, OSError, RuntimeError, ValueError) as exc:
        logger.warning("extractive answer without embeddings (%s)", exc)
        return None
    norms = np.linalg.norm(vectors, axis=1) * (np.linalg.norm(query) or 1.0)
    return (vectors @ query) / np.where(norms == 0, 1.0, norms)


def extractive_answer(
    question: str,
    sources: Sequence[Source],
    *,
    embedding_model: str | None,
    text_search_config: str | None = None,
    max_sentences: int = MAX_SENTENCES,
) -> ExtractiveAnswer:
    candidates: list[tuple[int, str]] = []
    seen: set[str] = set()
    for source in sources:
        for sentence in sentences_of(source.text):
            key = " ".join(sentence.lower().split())
            if key in seen or len(sentence) > MAX_SENTENCE_CHARS:
                continue
            seen.add(key)
            candidates.append((source.number, sentence))
    if not candidates:
        return ExtractiveAnswer(text=NOTHING_FOUND, extracts=[])

    texts = [sentence for _, sentence in candidates]
    question_terms, *sentence_terms = _lexemes([question, *texts], text_search_config)
    lexical = np.array([len(question_terms & terms) / max(len(question_terms), 1) for terms in sentence_terms])
    dense = _dense_scores(question, texts, embedding_model) if embedding_model else None
    ranks = np.array([number for number, _ in candidates], dtype=np.float64)
    scores = (dense if dense is not None else 0.0) + 0.5 * lexical - 0.02 * ranks
    order = sorted(range(len(candidates)), key=lambda i: (-scores[i], i))[:max_sentences]
    extracts = [Extract(candidates[i][0], candidates[i][1], round(float(scores[i]), 4)) for i in order]
    lines = [LEAD, ""] + [f"- {extract.sentence} [{extract.number}]" for extract in extracts]
    return ExtractiveAnswer(text="\n".join(lines), extracts=extracts)
