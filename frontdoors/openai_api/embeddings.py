"""Embeddings in OpenAI's shape, with the embedders that index the key's collections.

``model`` is the built-in ``all-MiniLM-L6-v2`` (the default when left out) or the
embedding model of one of the key's workspace collections: the vectors are then comparable
with the stored chunks'. Any other name is refused (400 naming ``model``): a vector from
another model would not be comparable with anything here.

Each input is a non-empty string of at most the embedder's window (254 tokens for
all-MiniLM-L6-v2; counted with its own tokenizer, which is also what ``usage`` reports):
longer text is refused rather than silently truncated, as OpenAI refuses text over its
models' window. ``encoding_format`` ``float`` or ``base64`` (little-endian float32, what the
``openai`` SDK asks for by default and decodes); ``dimensions`` only as the model's own.

A call is admitted against the key's limits (``billing.limits``: one request, its tokens)
before the model runs, and leaves one ledger row (``billing.ledger.embedding_row``, kind
embedding, billed to the key and its workspace), which carries the admission so that the
ledger's drain settles it at the stored cost. The model runs in a worker thread of its own
(``thread_sensitive=False``), so that a large batch does not hold the thread where Django
runs every other synchronous call.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass

import numpy as np
from asgiref.sync import sync_to_async

from billing import ledger, limits
from billing.models import ClientKey
from frontdoors.openai_api.errors import OpenAIError, from_domain, invalid, model_not_found
from search.embedders import DEFAULT_EMBEDDER, Embedder, EmbedderError, embedder_get
from search.models import Collection
from search.scoping import in_workspaces

logger = logging.getLogger(__name__)

MAX_INPUTS = 2048  # OpenAI's limit per request
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[str]
    encoding_format: str
    dimensions: int | None


def request_parse(body) -> EmbeddingRequest:
    """The request, validated; ``OpenAIError`` (400) naming the field at fault."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        model = DEFAULT_EMBEDDER
    if not isinstance(model, str):
        raise invalid("model", f"model must be a string, got {model!r}")
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs:
        raise invalid("input", "input must be a string or a non-empty list of strings", "missing_required_parameter")
    if len(inputs) > MAX_INPUTS:
        raise invalid("input", f"input holds {len(inputs)} items; at most {MAX_INPUTS} per request")
    for index, text in enumerate(inputs):
        if not isinstance(text, str):
            raise invalid(
                "input", f"input[{index}] is not a string: token arrays are not supported, send the text itself"
            )
        if not text.strip():
            raise invalid("input", f"input[{index}] is empty")
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODINGS:
        raise invalid("encoding_format", f"encoding_format must be one of {', '.join(ENCODINGS)}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise invalid("dimensions", f"dimensions must be an integer, got {dimensions!r}")
    return EmbeddingRequest(model.strip(), inputs, encoding_format, dimensions)


def _embedder_for(key: ClientKey, name: str) -> Embedder:
    """The embedder, if it is the built-in one or one of the key's workspace collections use."""
    used = set(in_workspaces(Collection, key.workspace_id).values_list("embedding_model", flat=True))
    allowed = sorted({DEFAULT_EMBEDDER} | used)
    if name not in allowed:
        raise model_not_found(name, allowed)
    try:
        return embedder_get(name)
    except EmbedderError as exc:
        message = f"the embedding model {name!r} cannot be used now: {exc}"
        raise OpenAIError(503, message, code="model_unavailable") from None


def _token_counts(embedder: Embedder, inputs: list[str]) -> list[int]:
    counts = [len(embedder.token_offsets(text)) for text in inputs]
    for index, count in enumerate(counts):
        if count > embedder.max_tokens:
            raise invalid(
                "input",
                f"input[{index}] is {count} tokens long; {embedder.name} reads at most {embedder.max_tokens}: split it",
            )
    return counts


def _admit(key: ClientKey, model: str, tokens: int) -> limits.Admission:
    try:
        return limits.admission_reserve(key, model=model, local=False, prompt_tokens=tokens, max_tokens=0)
    except limits.LimitExceeded as exc:
        raise from_domain(exc) from None


def _embed(embedder: Embedder, inputs: list[str]) -> np.ndarray:
    try:
        return embedder.embed_documents(inputs)
    except EmbedderError as exc:
        raise OpenAIError(502, f"the embedding model failed: {exc}", code="embedding_failed") from None


def _record(key: ClientKey, model: str, tokens: int, latency_ms: float, admission: limits.Admission) -> None:
    row = ledger.embedding_row(
        model=model,
        tokens=tokens,
        latency_ms=latency_ms,
        workspace_id=key.workspace_id,
        client_key_id=key.pk,
    )
    row["admission"] = admission.as_json()  # settled by the drain with the stored cost
    try:
        ledger.usage_records_queue([row])
    except Exception:  # the vectors are computed: answer, and say loudly what was not billed
        logger.exception("the embedding usage of key %s (%d tokens) could not be queued", key.pk, tokens)
        limits.admission_release(admission)


def _encoded(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(value) for value in vector]


async def embeddings_create(key: ClientKey, request: EmbeddingRequest) -> dict:
    """Embed the inputs: the OpenAI ``list`` of ``embedding`` objects with ``usage``."""
    embedder = await sync_to_async(_embedder_for)(key, request.model)
    counts = await sync_to_async(_token_counts, thread_sensitive=False)(embedder, request.inputs)
    if request.dimensions is not None and request.dimensions != embedder.dimensions:
        raise invalid("dimensions", f"{embedder.name} makes vectors of {embedder.dimensions} dimensions only")
    tokens = sum(counts)
    admission = await sync_to_async(_admit)(key, embedder.name, tokens)
    started = time.perf_counter()
    try:
        vectors = await sync_to_async(_embed, thread_sensitive=False)(embedder, request.inputs)
    except BaseException:
        await sync_to_async(limits.admission_release)(admission)
        raise
    latency_ms = (time.perf_counter() - started) * 1000
    await sync_to_async(_record)(key, embedder.name, tokens, latency_ms, admission)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": _encoded(vector, request.encoding_format)}
            for index, vector in enumerate(vectors)
        ],
        "model": embedder.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
