"""Loading target and draft models, once per process, with the checks that must pass first."""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import torch

from inference.hardware import cpu_has_bf16
from inference.requests import GenerationError

logger = logging.getLogger(__name__)
_lock = threading.Lock()


@dataclass(frozen=True)
class LoadedModels:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object
    device: str
    dtype: torch.dtype
    context_window: int


def default_device_and_dtype() -> tuple[str, torch.dtype]:
    """CUDA in bf16 (fp16 where bf16 is missing); CPU in bf16 where the CPU runs it natively.

    On CPUs with AVX512-BF16 a pass over k+1 tokens costs about one pass over 1 token in
    bf16 but k+1 in fp32 (shared notes), and speculation pays only in the first regime.
    """
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return "cpu", torch.bfloat16 if cpu_has_bf16() else torch.float32


def _load_tokenizer(name: str, field: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise GenerationError(field, f"cannot load a tokenizer from {name!r}: {exc}") from None


def _load_model(name: str, field: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise GenerationError(field, f"cannot load a causal language model from {name!r}: {exc}") from None
    return model.to(device).eval()


@functools.lru_cache(maxsize=4)
def models_load(target: str, draft: str | None = None, device: str | None = None, dtype: str | None = None):
    """The (target, draft) pair, loaded on first use in this process and kept.

    Called lazily from the worker's child process (never in a parent that forks, never in
    ``worker_process_init``, which Celery times out). A draft whose tokenizer differs from
    the target's is refused before any weights are loaded.
    """
    with _lock:
        chosen_device, chosen_dtype = default_device_and_dtype()
        device = device or chosen_device
        torch_dtype = getattr(torch, dtype) if dtype else chosen_dtype
        tokenizer = _load_tokenizer(target, "model")
        if draft:
            draft_tokenizer = _load_tokenizer(draft, "draft_model")
            if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
                raise GenerationError(
                    "draft_model",
                    f"the tokenizer of {draft!r} differs from the target {target!r}'s; "
                    "speculative decoding needs the same vocabulary",
                )
        target_model = _load_model(target, "model", device, torch_dtype)
        draft_model = _load_model(draft, "draft_model", device, torch_dtype) if draft else None
        window = int(getattr(target_model.config, "max_position_embeddings", 2048))
        logger.info("loaded %s%s on %s (%s)", target, f" + draft {draft}" if draft else "", device, torch_dtype)
        return LoadedModels(target_model, draft_model, tokenizer, device, torch_dtype, window)
