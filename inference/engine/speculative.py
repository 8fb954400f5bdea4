"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with a draft model, prompt
lookup (n-grams from the prompt, for RAG: the retrieved passages), or both.

Invariant: the output is exactly what the target alone would produce. Greedy requests
accept a proposed token while it is the target's argmax; sampled requests accept token
``d`` with probability ``min(1, p(d) / q(d))`` and on rejection draw from
``norm(max(0, p - q))``; when every proposal is accepted the target's next distribution
gives one bonus token. Prompt lookup proposes deterministically, i.e. ``q`` is one-hot.

State between rounds: each model's KV cache holds every committed token but the last
(``pending``). A round feeds ``[pending, d1..dk]`` to the target in one pass, whose
logits verify ``d1..dk`` and give the bonus; the caches are then cropped back to the
accepted prefix (rollback), and the token drawn from the target becomes ``pending``.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from inference.engine.proposers import NGramProposer
from inference.engine.sampling import distribution, sample
from inference.requests import GenerationError, validate_sampling

METHODS = ("off", "draft", "ngram", "both")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # off | draft | ngram | both (n-gram when the prompt matches, else draft)
    k: int = 4
    adaptive_k: bool = False
    ngram_max: int = 4
    ngram_min: int = 2


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    drafts: int = 0  # rounds that proposed tokens (vLLM's num_drafts); not in as_dict()
    target_passes: int = 0
    draft_passes: int = 0
    # Accepted proposals by position in the proposal (vLLM's "accepted tokens per position").
    accepted_per_position: list[int] = field(default_factory=list)
    # Decoding passes (after the first, which takes the prompt) by the tokens the target
    # verified in them: the pending token and the proposal. A pass's cost grows with it.
    passes_by_verified_tokens: dict[int, int] = field(default_factory=dict)
    time_to_first_token_ms: float = 0.0
    # Until the prompt has been through the target (the first target pass, with the draft's
    # own prompt pass before it); what follows is decoding, the part speculation speeds up.
    prefill_ms: float = 0.0
    prefill_round_tokens: int = 0  # tokens the first round committed
    total_ms: float = 0.0
    finish_reason: str = "length"
    token_ids: list[int] = field(default_factory=list)  # the completion's tokens

    @property
    def acceptance_rate(self) -> float:
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        """Tokens committed per target pass (1.0 without speculation)."""
        return self.completion_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / (self.total_ms / 1000) if self.total_ms else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "draft_tokens_proposed": self.draft_tokens_proposed,
            "draft_tokens_accepted": self.draft_tokens_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_per_pass": round(self.mean_accepted_per_pass, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "target_passes": self.target_passes,
            "draft_passes": self.draft_passes,
            "time_to_first_token_ms": round(self.time_to_first_token_ms, 2),
            "prefill_ms": round(self.prefill_ms, 2),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "total_ms": round(self.total_ms, 2),
            "finish_reason": self.finish_reason,
        }


@dataclass
class _Model:
    model: torch.nn.Module
    cache: DynamicCache
    length: int = 0  # tokens in the cache

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        """Feed ``tokens`` after the cached prefix; fp32 logits for the last ``keep`` positions.

        Only those rows go through the output head: on a prompt pass the others would cost
        a (prompt x vocabulary) product and its conversion for nothing.
        """
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([tokens], dtype=torch.long, device=device)
        extra = {"logits_to_keep": keep} if _takes_logits_to_keep(self.model) else {}
        with torch.inference_mode():
            output = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, **extra)
        self.length += len(tokens)
        return output.logits[0, -keep:].float()

    def crop(self, length: int) -> None:
        if length < self.length:
            # transformers 5 takes the number of positions to drop, as a negative count.
            self.cache.crop(length - self.length)
            self.length = length


def validate(
    request: GenerationRequest, *, context_window: int, has_draft: bool, vocab_size: int | None = None
) -> None:
    spec = request.speculative
    if spec.method not in METHODS:
        raise GenerationError("speculative.method", f"must be one of {', '.join(METHODS)}, got {spec.method!r}")
    if spec.method in ("draft", "both") and not has_draft:
        raise GenerationError("speculative.method", f"{spec.method!r} needs a draft model, and none is loaded")
    validate_sampling(k=spec.k, temperature=request.temperature, top_p=request.top_p, max_tokens=request.max_tokens)
    if not request.prompt_ids:
        raise GenerationError("prompt", "is empty")
    if vocab_size is not None:
        outside = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
        if outside:
            raise GenerationError(
                "prompt_ids", f"token id {outside[0]} is outside the model's vocabulary (0..{vocab_size - 1})"
            )
    if len(request.prompt_ids) + request.max_tokens > context_window:
        raise GenerationError(
            "max_tokens",
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the "
            f"context window of {context_window} tokens",
        )


def generate(
    request: GenerationRequest,
    *,
    target: torch.nn.Module,
    tokenizer,
    draft: torch.nn.Module | None = None,
    context_window: int | None = None,
) -> Iterator[str | GenerationStats]:
    """Yield text deltas as tokens are committed, then the final ``GenerationStats``."""
    window = context_window or int(getattr(target.config, "max_position_embeddings", 2048))
    vocab_size = target.get_output_embeddings().weight.shape[0]
    validate(request, context_window=window, has_draft=draft is not None, vocab_size=vocab_size)
    spec = request.speculative
    started = time.perf_counter()
    generator = None
    if request.seed is not None:
        device = next(target.parameters()).device
        generator = torch.Generator(device=device).manual_seed(request.seed)

    stats = GenerationStats(prompt_tokens=len(request.prompt_ids), accepted_per_position=[0] * spec.k)
    tokens = list(request.prompt_ids)
    prompt_length = len(tokens)
    eos_ids = _eos_ids(target, tokenizer)
    big = _Model(target, DynamicCache(config=target.config))
    use_draft = draft is not None and spec.method in ("draft", "both")
    small = _Model(draft, DynamicCache(config=draft.config)) if use_draft else None
    ngrams = NGramProposer(request.prompt_ids, n_max=spec.ngram_max, n_min=spec.ngram_min)
    k = spec.k
    detokenizer = _Detokenizer(tokenizer, request.stop)

    def temperature_probs(logits: torch.Tensor) -> torch.Tensor:
        return distribution(logits, temperature=request.temperature, top_p=request.top_p)

    # The first target pass also consumes the prompt; before it nothing is pending.
    pending_from = 0
    finished = False
    while not finished:
        remaining = request.max_tokens - (len(tokens) - prompt_length)
        # Propose at most what may still be emitted after the target's own token.
        budget = max(0, min(k, remaining - 1))
        proposal: list[int] = []
        proposal_probs: list[torch.Tensor | None] = []
        if budget and spec.method in ("ngram", "both"):
            proposal = ngrams.propose(tokens, budget)
            proposal_probs = [None] * len(proposal)  # deterministic: q is one-hot
        if budget and not proposal and small is not None:
            proposal, proposal_probs = _draft_propose(small, tokens, budget, temperature_probs, generator, stats)

        logits = big.forward(tokens[pending_from:] + proposal, keep=len(proposal) + 1)
        stats.target_passes += 1
        if stats.target_passes == 1:
            stats.prefill_ms = (time.perf_counter() - started) * 1000
        # logits[i] is the distribution after the last committed token and proposal[:i].
        committed_before = len(tokens)
        accepted = 0
        next_token = None
        greedy = request.temperature == 0
        if greedy:
            # Greedy fast path: the target's argmax at every position, in one call.
            choices = logits.argmax(dim=-1).tolist()
        for i, proposed in enumerate(proposal):
            if greedy:
                if proposed == choices[i]:
                    accepted += 1
                    stats.accepted_per_position[i] += 1
                    continue
                next_token = choices[i]
                break
            p = temperature_probs(logits[i])
            q = proposal_probs[i]
            q_d = 1.0 if q is None else float(q[proposed])
            ratio = float(p[proposed]) / q_d if q_d > 0 else 0.0
            if ratio >= 1.0 or float(torch.rand((), generator=generator, device=p.device)) < ratio:
                accepted += 1
                stats.accepted_per_position[i] += 1
                continue
            # Rejected: draw from the residual norm(max(0, p - q)).
            residual = p.clone()
            if q is None:
                residual[proposed] = 0.0
            else:
                residual = torch.clamp(p - q, min=0.0)
            total = float(residual.sum())
            next_token = sample(residual / total, generator) if total > 0 else sample(p, generator)
            break
        if next_token is None:  # all accepted (or nothing proposed): the target's bonus token
            if greedy:
                next_token = choices[len(proposal)]
            else:
                next_token = sample(temperature_probs(logits[len(proposal)]), generator)
        if stats.target_passes > 1:
            verified = len(proposal) + 1
            stats.passes_by_verified_tokens[verified] = stats.passes_by_verified_tokens.get(verified, 0) + 1
        stats.draft_tokens_proposed += len(proposal)
        stats.draft_tokens_accepted += accepted
        stats.drafts += 1 if proposal else 0
        if spec.adaptive_k and proposal:
            k = min(16, k + 1) if accepted == len(proposal) else max(1, k - 1)
            if len(stats.accepted_per_position) < k:
                stats.accepted_per_position += [0] * (k - len(stats.accepted_per_position))

        new_tokens = [*proposal[:accepted], next_token]
        # Roll both caches back to the committed prefix (all but the new pending token).
        big.crop(committed_before + accepted)
        if small is not None:
            small.crop(min(small.length, committed_before + accepted))
        pending_from = committed_before + accepted
        if stats.target_passes == 1:
            stats.prefill_round_tokens = len(new_tokens)

        for token in new_tokens:
            if token in eos_ids:
                stats.finish_reason = "stop"
                finished = True
                break
            tokens.append(token)
            stats.completion_tokens += 1
            delta, stopped = detokenizer.push(tokens[prompt_length:])
            if delta:
                if not stats.time_to_first_token_ms:
                    stats.time_to_first_token_ms = (time.perf_counter() - started) * 1000
                yield delta
            if stopped:
                stats.finish_reason = "stop"
                finished = True
                break
            if len(tokens) - prompt_length >= request.max_tokens:
                stats.finish_reason = "length"
                finished = True
                break
    stats.token_ids = tokens[prompt_length:]
    tail = detokenizer.flush()
    if tail:
        if not stats.time_to_first_token_ms:
            stats.time_to_first_token_ms = (time.perf_counter() - started) * 1000
        yield tail
    stats.total_ms = (time.perf_counter() - started) * 1000
    yield stats


def _draft_propose(small: _Model, tokens, budget, temperature_probs, generator, stats):
    """The draft model proposes ``budget`` tokens autoregressively, with its probabilities."""
    proposal: list[int] = []
    probs: list[torch.Tensor] = []
    logits = small.forward(tokens[small.length :], keep=1)
    stats.draft_passes += 1
    for step in range(budget):
        q = temperature_probs(logits[-1])
        token = int(q.argmax()) if float(q.max()) == 1.0 else sample(q, generator)
        proposal.append(token)
        probs.append(q)
        if step + 1 < budget:
            logits = small.forward([token], keep=1)
            stats.draft_passes += 1
    return proposal, probs


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in _forward_parameters(type(model))


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for candidate in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(candidate, int):
            ids.add(candidate)
        elif candidate:
            ids.update(candidate)
    return ids


class _Detokenizer:
    """Incremental text: emits only text that can no longer change.

    Held back: a trailing replacement character (half of a multi-byte character) and any
    tail that could be the start of a stop sequence. A stop sequence ends the text before it.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.emitted = 0
        self.text = ""

    def push(self, ids: list[int]) -> tuple[str, bool]:
        self.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in self.stop:
            index = self.text.find(stop)
            if index != -1:
                self.text = self.text[:index]
                return self._take(len(self.text)), True
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        for stop in self.stop:
            for size in range(min(len(stop) - 1, safe), 0, -1):
                if self.text[:safe].endswith(stop[:size]):
                    safe = min(safe, len(self.text) - size)
                    break
        return self._take(safe), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta
