"""Tiny causal LMs and a tokenizer built here, so engine tests download nothing."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = [
    "the", "wing", "flow", "lift", "drag", "shock", "wave", "heat", "plate", "jet", "speed", "high", "low",
    "pressure", "layer", "boundary", "is", "of", "and", "a", "in", "on", "at", "to", "with", "by", "for",
    "theory", "test", "model", "data", "value", "number", "mach", "angle", "edge", "body", "nose", "tail",
    "cone", "curve", "point", "line", "result", "method", "case", "time", "rate", "mass", "air",
]  # fmt: skip
SPECIALS = ["<unk>", "<s>", "</s>"]
# The messages' contents, blank-line joined: what an OpenAI-protocol server (vLLM) needs to
# serve chat completions from a tokenizer that has no template of its own.
# (The separator is a Jinja string: chat templates are rendered with trim_blocks, which would
# eat a newline written right after a block tag.)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% if not loop.last %}{{ '\\n\\n' }}{% endif %}{% endfor %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama(
    seed: int,
    *,
    layers: int = 2,
    width: int = 64,
    vocab_size: int | None = None,
    eos: bool = False,
    max_positions: int = 512,
) -> LlamaForCausalLM:
    """A random Llama; ``eos=False`` keeps generations going to max_tokens (EOS never wins).
    Four attention heads: ``width`` 256 gives vLLM's CPU attention a head size it supports (64)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size or len(SPECIALS) + len(WORDS),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Sharper logits than the tiny initialisation gives, so greedy choices are not near-ties.
        model.lm_head.weight.mul_(8.0)
        if not eos:
            # EOS's logit is always 0 while the best of the other 52 is almost surely above.
            model.lm_head.weight[2].fill_(0.0)
    model.eval()
    model.generation_config.eos_token_id = 2
    return model


def tiny_model_save(path, seed: int = 1, *, chat_template: bool = False, **options) -> str:
    """A ``tiny_llama`` and the tiny tokenizer saved in ``path``, for what loads models by path
    (the engine's ``models_load``, an engine server); ``chat_template``: the tokenizer gets
    ``CHAT_TEMPLATE`` (vLLM serves chat completions only with one). Returns the path."""
    tiny_llama(seed, **options).save_pretrained(path)
    tokenizer = tiny_tokenizer()
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)
