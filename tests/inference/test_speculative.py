"""The engine's output is exactly the target's, whatever proposes tokens."""

from __future__ import annotations

import collections

import pytest
import torch

from inference.engine.speculative import GenerationRequest, GenerationStats, SpeculativeConfig, generate
from inference.requests import GenerationError
from tests.inference.tiny_models import tiny_llama, tiny_tokenizer

torch.set_num_threads(1)
TOKENIZER = tiny_tokenizer()
TARGET = tiny_llama(1)
POOR_DRAFT = tiny_llama(2, layers=1)


def _noisy_copy(model, scale: float, seed: int):
    """The target with noise on its last attention output: agrees on some tokens, not all."""
    import copy

    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = noisy.model.layers[-1].self_attn.o_proj.weight
        weight.add_(torch.randn(weight.shape, generator=generator) * scale * weight.std())
    return noisy


HALF_DRAFT = _noisy_copy(TARGET, 1.0, 3)  # acceptance about 0.4

PROMPTS = [
    "the wing flow of the shock wave is high and the lift of the wing flow is low",
    "heat plate boundary layer theory test model of the heat plate",
    "mach number angle of the cone nose and the tail body",
]


def run(prompt_ids, *, draft=None, **kwargs):
    spec = kwargs.pop("speculative", SpeculativeConfig())
    request = GenerationRequest(prompt_ids=prompt_ids, speculative=spec, **kwargs)
    pieces = list(generate(request, target=TARGET, tokenizer=TOKENIZER, draft=draft))
    stats = pieces[-1]
    assert isinstance(stats, GenerationStats)
    return "".join(pieces[:-1]), stats


def greedy_reference(prompt_ids, max_tokens):
    """Plain greedy decoding of the target, one token per step, without any cache."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = TARGET(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(
    ("method", "draft", "k"),
    [
        ("off", None, 4),
        ("draft", TARGET, 1),
        ("draft", TARGET, 5),
        ("draft", POOR_DRAFT, 3),
        ("draft", POOR_DRAFT, 8),
        ("draft", HALF_DRAFT, 4),
        ("ngram", None, 4),
        ("both", POOR_DRAFT, 4),
    ],
)
def test_greedy_speculation_is_token_for_token_the_targets_greedy_output(prompt, method, draft, k):
    prompt_ids = TOKENIZER.encode(prompt)
    expected = TOKENIZER.decode(greedy_reference(prompt_ids, 40), skip_special_tokens=True)
    text, stats = run(prompt_ids, draft=draft, max_tokens=40, speculative=SpeculativeConfig(method=method, k=k))
    assert text == expected
    assert stats.completion_tokens == 40
    assert stats.finish_reason == "length"
    if method == "draft" and draft is TARGET:
        # A draft equal to the target is always right: k + 1 tokens per target pass.
        assert stats.acceptance_rate == 1.0
        assert stats.target_passes == -(-40 // (k + 1))
    if method == "off":
        assert stats.target_passes == 40 and stats.draft_tokens_proposed == 0


def test_speculation_off_ignores_a_loaded_draft():
    prompt_ids = TOKENIZER.encode(PROMPTS[0])
    _, stats = run(prompt_ids, draft=TARGET, max_tokens=12, speculative=SpeculativeConfig(method="off"))
    assert (stats.target_passes, stats.draft_passes, stats.draft_tokens_proposed) == (12, 0, 0)


def test_long_generation_with_many_rejections_stays_identical():
    prompt_ids = TOKENIZER.encode(PROMPTS[0])
    expected = TOKENIZER.decode(greedy_reference(prompt_ids, 200), skip_special_tokens=True)
    text, stats = run(prompt_ids, draft=HALF_DRAFT, max_tokens=200, speculative=SpeculativeConfig(method="draft", k=6))
    assert text == expected
    assert stats.draft_tokens_proposed > stats.draft_tokens_accepted > 0  # rollbacks happened
    assert 0.2 < stats.acceptance_rate < 0.95
    adaptive, _ = run(
        prompt_ids,
        draft=HALF_DRAFT,
        max_tokens=200,
        speculative=SpeculativeConfig(method="both", k=4, adaptive_k=True),
    )
    assert adaptive == expected


def test_max_tokens_and_stop_sequences_are_exact():
    prompt_ids = TOKENIZER.encode(PROMPTS[1])
    full = TOKENIZER.decode(greedy_reference(prompt_ids, 30), skip_special_tokens=True)
    for max_tokens in (1, 2, 7):
        _, stats = run(prompt_ids, draft=TARGET, max_tokens=max_tokens, speculative=SpeculativeConfig("draft", k=5))
        assert stats.completion_tokens == max_tokens
    words = full.split()
    stop = " ".join(words[5:7])
    text, stats = run(prompt_ids, draft=TARGET, max_tokens=30, stop=(stop,), speculative=SpeculativeConfig("draft", 5))
    assert text == full[: full.index(stop)]
    assert stats.finish_reason == "stop"


def test_sampling_preserves_the_targets_distribution():
    """Chi-square: speculative samples of the first generated tokens vs the target's own distribution."""
    prompt_ids = TOKENIZER.encode("the wing")
    with torch.inference_mode():
        logits = TARGET(input_ids=torch.tensor([prompt_ids])).logits[0, -1] / 2.0  # temperature 2
    expected = torch.softmax(logits.float(), dim=-1)
    counts = collections.Counter()
    samples = 3000
    for seed in range(samples):
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=2,
            temperature=2.0,
            seed=seed,
            speculative=SpeculativeConfig(method="draft", k=2),
        )
        # Sample the first token through the speculative path (verified against a poor draft).
        stats = list(generate(request, target=TARGET, tokenizer=TOKENIZER, draft=HALF_DRAFT))[-1]
        # An empty completion means the first token drawn was EOS (it ends the text).
        counts[stats.token_ids[0] if stats.token_ids else TOKENIZER.eos_token_id] += 1
    observed = torch.tensor([counts.get(i, 0) for i in range(len(expected))], dtype=torch.float64)
    mass = expected.double() * samples
    keep = mass >= 5  # chi-square needs expected counts of at least 5; pool the rest
    chi2 = float((((observed[keep] - mass[keep]) ** 2) / mass[keep]).sum())
    rest_obs, rest_exp = float(observed[~keep].sum()), float(mass[~keep].sum())
    if rest_exp > 0:
        chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
    dof = int(keep.sum()) - (0 if rest_exp > 0 else 1)
    from scipy.stats import chi2 as chi2_distribution

    assert chi2_distribution.sf(chi2, dof) > 0.001, (chi2, dof)


def test_invalid_requests_name_the_field():
    prompt_ids = TOKENIZER.encode(PROMPTS[0])
    cases = [
        ({"speculative": SpeculativeConfig("draft", k=0)}, "speculative.k"),
        ({"speculative": SpeculativeConfig("draft", k=17)}, "speculative.k"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 600}, "max_tokens"),
        ({"speculative": SpeculativeConfig("medusa")}, "speculative.method"),
    ]
    for kwargs, field in cases:
        with pytest.raises(GenerationError) as excinfo:
            run(prompt_ids, draft=TARGET, **kwargs)
        assert excinfo.value.field == field
    with pytest.raises(GenerationError, match="needs a draft model"):
        run(prompt_ids, speculative=SpeculativeConfig("draft"))
    vocab_size = TARGET.config.vocab_size
    with pytest.raises(GenerationError, match=f"token id {vocab_size} is outside .*0..{vocab_size - 1}") as excinfo:
        run([*prompt_ids, vocab_size])
    assert excinfo.value.field == "prompt_ids"
