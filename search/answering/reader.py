"""The reader behind answers: does a passage's sentence answer the question, does a passage
support a claim. One interface over ``search.reader`` (the model); the answer path asks it
here and falls back to the lexical signals when it cannot run (``reader_unavailable``).
docs/answers.md, "The reader".
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.cache import cache

# search.reader loads torch: imported when the reader is first used, so that the web and
# workers' processes that never read (ANSWER_READER=signals) do not load it.
if TYPE_CHECKING:
    from search.reader.model import Pair, ReaderModel, Sentence

ANSWERS, SUPPORTS = 0, 1  # search.reader.model's head outputs

logger = logging.getLogger(__name__)

SCORES_KEPT = 65536  # (question, passage) readings kept per process
SHARED_SECONDS = 24 * 3600  # ... and in Redis, for every process

_lock = threading.Lock()
_model: ReaderModel | None = None
_broken: str | None = None  # why the weights could not be loaded
_scores: OrderedDict[str, list[float]] = OrderedDict()
_counts = {"hits": 0, "read": 0}


def reader_loaded() -> ReaderModel | None:
    """The process's reader, loaded on first use whatever ANSWER_READER says (reranking asks for
    it on its own: SEARCH_RERANK_TOP); None (and the reason logged once) when its weights are
    missing or corrupt."""
    global _model, _broken
    if _model is not None or _broken is not None:
        return _model
    with _lock:
        if _model is None and _broken is None:
            try:
                from search.reader.e5 import WeightsError
                from search.reader.model import ReaderModel

                _model = ReaderModel()
            except WeightsError as error:
                _broken = str(error)
                logger.error("reader unavailable, answers use the lexical signals: %s", error)
    return _model


def reader_get() -> ReaderModel | None:
    """The reader that answers read with: None when ANSWER_READER turns it off or it cannot load."""
    if settings.ANSWER_READER != "reader":
        return None
    return reader_loaded()


def reader_unavailable() -> str | None:
    """Why answers cannot read with the reader in this process, or None when they can."""
    if settings.ANSWER_READER != "reader":
        return f"turned off (ANSWER_READER={settings.ANSWER_READER})"
    reader_loaded()
    return _broken


def reader_load_error() -> str | None:
    """Why the reader's weights could not be loaded in this process, or None."""
    reader_loaded()
    return _broken


def reader_description() -> str:
    """One line for a start-up banner: whether answers read with the reader, and its weights'
    version, or why they cannot be used (checked without loading the encoder)."""
    from search.reader.e5 import WeightsError
    from search.reader.model import HEAD_FILE, weights_manifest

    try:
        manifest = weights_manifest()
    except WeightsError as error:
        return f"UNAVAILABLE, answers use the lexical signals: {error}"
    weights = f"{manifest['version']} ({HEAD_FILE.name}, LoRA rank {manifest['rank']} on {manifest['base']})"
    if settings.ANSWER_READER != "reader":
        return f"off (ANSWER_READER={settings.ANSWER_READER}: the lexical and dense signals decide); weights {weights}"
    return weights


def reader_reset() -> None:
    """Forget the loaded reader and its scores (tests swap weights)."""
    global _model, _broken
    with _lock:
        _model, _broken = None, None
        _scores.clear()
        _counts.update(hits=0, read=0)


def _key(model: ReaderModel, output: int, pair: Pair) -> str:
    digest = hashlib.blake2b(digest_size=16, person=b"reader")
    for part in (model.version, str(output), pair.question, pair.title, *pair.sentences):
        digest.update(part.encode())
        digest.update(b"\x00")
    return "read:" + digest.hexdigest()


def _read(model: ReaderModel, output: int, pairs: list[Pair]) -> list[list[float]]:
    """Each pair's sentence scores: from this process's LRU, else from Redis (shared by every
    worker: the same chunks come back question after question), else read and kept in both."""
    keys = [_key(model, output, pair) for pair in pairs]
    with _lock:
        known = {key: _scores[key] for key in keys if key in _scores}
        for key in known:
            _scores.move_to_end(key)
    hits = len(known)
    wanted = [key for key in dict.fromkeys(keys) if key not in known]
    if wanted:
        try:
            shared = cache.get_many(wanted)
        except Exception:  # a cache outage must not take answers down with it
            shared = {}
        known.update(shared)
        hits += len(shared)
    missing = [index for index, key in enumerate(keys) if key not in known]
    if missing:
        fresh = model.scores([pairs[index] for index in missing], output)
        computed = {keys[index]: scores for index, scores in zip(missing, fresh, strict=True)}
        known.update(computed)
        try:
            cache.set_many(computed, SHARED_SECONDS)
        except Exception:
            logger.warning("reader scores not kept in the cache", exc_info=True)
    with _lock:
        for key in dict.fromkeys(keys):
            _scores[key] = known[key]
            _scores.move_to_end(key)
        while len(_scores) > SCORES_KEPT:
            _scores.popitem(last=False)
        _counts["hits"] += hits
        _counts["read"] += len(missing)
    return [known[key] for key in keys]


def reader_counts() -> dict:
    """Pairs this process found kept (``hits``, in its LRU or in Redis) and read (``read``)."""
    with _lock:
        return dict(_counts)


def answers(question: str, passages: Sequence[tuple[str, Sequence[Sentence]]]) -> list[list[float]] | None:
    """For each (title, units) passage, each unit's probability that it answers ``question``;
    None when the reader cannot run."""
    model = reader_get()
    return None if model is None else _answers_read(model, question, passages)


def passages_answer(question: str, passages: Sequence[tuple[str, Sequence[Sentence]]]) -> list[float] | None:
    """For each (title, units) passage, the probability that it answers ``question`` (its best
    unit's), for reranking; None when the weights cannot be loaded."""
    model = reader_loaded()
    if model is None:
        return None
    return [max(scores, default=0.0) for scores in _answers_read(model, question, passages)]


def _answers_read(
    model: ReaderModel, question: str, passages: Sequence[tuple[str, Sequence[Sentence]]]
) -> list[list[float]]:
    from search.reader.model import Pair, segments_of

    pairs, wheres = [], []
    for title, units in passages:
        segments, where = segments_of(units)
        pairs.append(Pair(question, segments, title))
        wheres.append(where)
    read = _read(model, ANSWERS, pairs)
    return [[scores[index] for index in where] for scores, where in zip(read, wheres, strict=True)]


def supports(claim: str, passages: Sequence[tuple[str, Sequence[Sentence]]]) -> list[float] | None:
    """For each (title, units) passage, the probability that it supports ``claim``."""
    model = reader_get()
    if model is None:
        return None
    from search.reader.model import Pair, segments_of

    pairs = [Pair(claim, segments_of(units)[0], title) for title, units in passages]
    return [max(scores, default=0.0) for scores in _read(model, SUPPORTS, pairs)]
