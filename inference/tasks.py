"""Celery tasks of the generation pool (queue ``gpu``): one request, streamed into Redis."""

from __future__ import annotations

import logging

import torch
from celery import shared_task

from inference.engine import GenerationRequest, GenerationStats, SpeculativeConfig, generate
from inference.engine.models import models_load
from inference.engine.speculative import GenerationError
from inference.streams import StreamWriter
from ragsite.celery import LONG_TASK_OPTIONS

logger = logging.getLogger(__name__)


@shared_task(name="inference.tasks.generate_local", bind=True, **LONG_TASK_OPTIONS)
def generate_local(self, request_id: str, payload: dict) -> dict:
    """Run one generation on this process's device and stream it to ``gen:<request_id>``.

    ``payload``: model, draft_model, dtype (optional, e.g. "float32"), prompt (text) or
    prompt_ids, max_tokens, temperature, top_p, stop, seed, speculative {method, k, adaptive_k}.
    A bad request, an out-of-memory error or a crash inside the model fails this request
    only (an ``error`` event with the reason); the worker goes on serving.
    """
    writer = StreamWriter(request_id)
    try:
        models = models_load(payload["model"], payload.get("draft_model"), dtype=payload.get("dtype"))
        prompt_ids = payload.get("prompt_ids") or models.tokenizer.encode(payload["prompt"])
        spec = payload.get("speculative") or {}
        request = GenerationRequest(
            prompt_ids=list(prompt_ids),
            max_tokens=int(payload.get("max_tokens", 256)),
            temperature=float(payload.get("temperature", 0.0)),
            top_p=float(payload.get("top_p", 1.0)),
            stop=tuple(payload.get("stop") or ()),
            seed=payload.get("seed"),
            speculative=SpeculativeConfig(
                method=spec.get("method", "off"), k=int(spec.get("k", 4)), adaptive_k=bool(spec.get("adaptive_k"))
            ),
        )
        stats = None
        for piece in generate(
            request,
            target=models.target,
            tokenizer=models.tokenizer,
            draft=models.draft,
            context_window=models.context_window,
        ):
            if isinstance(piece, GenerationStats):
                stats = piece
            else:
                writer.write("delta", text=piece)
        result = stats.as_dict()
        writer.write("stats", **result)
        return result
    except GenerationError as exc:
        writer.write("error", field=exc.field, message=str(exc))
        return {"error": str(exc)}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        writer.write("error", field=None, message="the GPU ran out of memory for this request")
        return {"error": "out of memory"}
    except (KeyError, TypeError, ValueError) as exc:
        writer.write("error", field=None, message=f"invalid request: {exc}")
        return {"error": str(exc)}
    except Exception as exc:  # a crash in the model fails this request, not the worker
        logger.exception("generation %s failed", request_id)
        writer.write("error", field=None, message=f"generation failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
