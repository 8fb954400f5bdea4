"""The reader: multilingual-e5-small reading a question (or a claim) and a passage as one
input, and a small head scoring each of the passage's sentences.

Input, as e5 was trained to read the two sides: ``<s> query: Q </s></s> passage: T S1 S2 ... </s>``,
where T is the passage's title and S1... its sentences, each tokenized on its own so that the
tokens of each are known. A sentence's features are the first token's final state beside the
mean of its own tokens' final states; the head maps them to two logits, "this sentence answers
the question" and "this sentence supports the claim". A passage answers (supports) as well as
its best sentence does.

An input longer than the encoder's 512 positions is read in windows, never cut: the sentences
are packed into windows that each repeat the question, a sentence longer than a window is read
in pieces (scored as its best piece), and a question longer than ``QUESTION_TOKENS`` is read
in pieces too, each against every window (a sentence scores its best). Only a title longer
than ``TITLE_TOKENS`` is cut: it is context repeated in every window, not what is scored.
docs/answers.md, "The reader".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from search.reader.e5 import E5File, Encoder, Tokenizer, WeightsError, wheel_model_path

ANSWERS, SUPPORTS = 0, 1  # the head's two outputs
QUESTION_TOKENS = 160
TITLE_TOKENS = 64  # a passage's title is context, repeated in each window: a longer one is cut
HEAD_HIDDEN = 256
BATCH_TOKENS = 4096  # tokens (padded) of one forward pass
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
HEAD_FILE = WEIGHTS_DIR / "reader.safetensors"
HEAD_MANIFEST = WEIGHTS_DIR / "reader.json"


class Sentence(Protocol):
    """A quotable sentence of a passage and what stands above it (``abstention.Unit``)."""

    sentence: str
    context: str


def segments_of(units: Sequence[Sentence]) -> tuple[tuple[str, ...], list[int]]:
    """What the reader reads of a passage's units: each heading or list lead-in once, before
    the sentences under it, then the sentences; and the index of each unit's sentence."""
    segments: list[str] = []
    where: list[int] = []
    context = ""
    for unit in units:
        if unit.context and unit.context != context:
            segments.append(unit.context)
        context = unit.context
        where.append(len(segments))
        segments.append(unit.sentence)
    return tuple(segments), where


@dataclass(frozen=True)
class Pair:
    """One question (or claim) against one passage's sentences."""

    question: str
    sentences: tuple[str, ...]
    title: str = ""


@dataclass
class Window:
    """One encoder input: ids, and for each sentence piece in it, (pair, sentence, start, end)."""

    ids: list[int]
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)


class Head(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = nn.Linear(2 * hidden, HEAD_HIDDEN)
        self.out = nn.Linear(HEAD_HIDDEN, 2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.hidden(features)))


class Inputs:
    """Builds the windows of a list of pairs (``windows``), the same for training and reading."""

    def __init__(self, tokenizer: Tokenizer, positions: int):
        self.tokenizer = tokenizer
        self.positions = positions

    def windows(self, pairs: list[Pair]) -> list[Window]:
        tok = self.tokenizer
        windows: list[Window] = []
        questions = tok.encode([f"query: {pair.question}" for pair in pairs])
        titles = tok.encode([f"passage: {pair.title}".rstrip() for pair in pairs])
        flat = [sentence for pair in pairs for sentence in pair.sentences]
        encoded = iter(tok.encode(flat))
        for index, pair in enumerate(pairs):
            sentences = [next(encoded) for _ in pair.sentences]
            question_pieces = [
                questions[index][start : start + QUESTION_TOKENS]
                for start in range(0, max(len(questions[index]), 1), QUESTION_TOKENS)
            ]
            for question in question_pieces:
                prefix = [tok.bos, *question, tok.eos, tok.eos, *titles[index][:TITLE_TOKENS]]
                room = self.positions - len(prefix) - 1
                window = Window(list(prefix))
                for number, ids in enumerate(sentences):
                    for start in range(0, max(len(ids), 1), room):
                        piece = ids[start : start + room]
                        if len(window.ids) + len(piece) + 1 > self.positions:
                            windows.append(self._closed(window))
                            window = Window(list(prefix))
                        window.pieces.append((index, number, len(window.ids), len(window.ids) + len(piece)))
                        window.ids.extend(piece)
                windows.append(self._closed(window))
        return windows

    def _closed(self, window: Window) -> Window:
        window.ids.append(self.tokenizer.eos)
        return window


def batches(windows: list[Window], budget: int = BATCH_TOKENS) -> list[list[int]]:
    """Indices of ``windows`` in batches of similar length, each under ``budget`` padded tokens."""
    order = sorted(range(len(windows)), key=lambda i: len(windows[i].ids))
    out: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = len(windows[index].ids)
        if current and longest * (len(current) + 1) > budget:
            out.append(current)
            current = []
        current.append(index)
    if current:
        out.append(current)
    return out


def collated(
    windows: list[Window], pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]:
    """Padded ids, attention, the pooling matrix (pieces x batch*length) and the pieces."""
    length = max(len(window.ids) for window in windows)
    ids = torch.full((len(windows), length), pad, dtype=torch.long)
    attention = torch.zeros((len(windows), length), dtype=torch.long)
    pieces = [(row, *piece) for row, window in enumerate(windows) for piece in window.pieces]
    pooling = torch.zeros((len(pieces), len(windows) * length))
    for row, window in enumerate(windows):
        ids[row, : len(window.ids)] = torch.tensor(window.ids)
        attention[row, : len(window.ids)] = 1
    for index, (row, _pair, _sentence, start, end) in enumerate(pieces):
        pooling[index, row * length + start : row * length + end] = 1.0 / max(end - start, 1)
    return ids, attention, pooling, [(row, pair, sentence, start) for row, pair, sentence, start, _end in pieces]


def piece_features(hidden: torch.Tensor, pooling: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Each piece's features: its window's first state beside the mean of its own states."""
    batch, length, size = hidden.shape
    means = pooling @ hidden.reshape(batch * length, size)
    return torch.cat([hidden[rows, 0], means], dim=1)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_manifest(head_path: Path | None = None, manifest_path: Path | None = None) -> dict:
    """The trained weights' manifest, once the file is found to be the one it describes; a
    ``WeightsError`` naming the file otherwise (missing, unreadable, changed or truncated)."""
    head_path, manifest_path = head_path or HEAD_FILE, manifest_path or HEAD_MANIFEST
    if not manifest_path.is_file() or not head_path.is_file():
        missing = head_path if not head_path.is_file() else manifest_path
        raise WeightsError(f"the reader's trained weights are missing: {missing} (manage.py train_reader builds them)")
    try:
        manifest = json.loads(manifest_path.read_text())
        version = manifest["version"]
    except (ValueError, KeyError, OSError) as error:
        raise WeightsError(f"the reader's manifest cannot be read: {manifest_path}: {error}") from error
    if file_sha256(head_path)[:16] != version:
        raise WeightsError(
            f"the reader's trained weights are corrupt: {head_path} is not the file {manifest_path} "
            "describes (sha256 differs)"
        )
    return manifest


class ReaderModel:
    """The encoder with the trained LoRA updates and head, read for inference."""

    def __init__(self, head_path: Path | None = None, manifest_path: Path | None = None, e5_path: Path | None = None):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        head_path = head_path or HEAD_FILE
        e5_path = e5_path or wheel_model_path()
        manifest = weights_manifest(head_path, manifest_path)
        try:
            tensors = load_file(str(head_path))
        except (SafetensorError, OSError) as error:
            raise WeightsError(f"the reader's trained weights cannot be read: {head_path}: {error}") from error
        self.manifest = manifest
        weights = E5File(e5_path)
        self.tokenizer = Tokenizer(weights)
        self.encoder = Encoder(weights, rank=manifest["rank"], alpha=manifest["alpha"], lora_from=manifest["lora_from"])
        self.head = Head(weights.config.hidden)
        modules = {"encoder.": self.encoder, "head.": self.head}
        expected = {
            f"{prefix}{name}"
            for prefix, module in modules.items()
            for name, p in module.named_parameters()
            if p.requires_grad or prefix == "head."
        }
        if set(tensors) != expected:
            raise WeightsError(
                f"the reader's trained weights do not fit the encoder: {head_path} "
                f"({len(set(tensors) ^ expected)} tensors differ)"
            )
        with torch.no_grad():
            for prefix, module in modules.items():
                parameters = dict(module.named_parameters())
                for name, tensor in tensors.items():
                    if name.startswith(prefix):
                        parameters[name[len(prefix) :]].copy_(tensor)
        self.encoder.eval()
        self.head.eval()
        self.inputs = Inputs(self.tokenizer, weights.config.positions)
        self.version = manifest["version"]

    @torch.inference_mode()
    def scores(self, pairs: list[Pair], output: int) -> list[list[float]]:
        """For each pair, each sentence's probability (``ANSWERS`` or ``SUPPORTS``)."""
        result = [[0.0] * len(pair.sentences) for pair in pairs]
        seen = [[False] * len(pair.sentences) for pair in pairs]
        windows = self.inputs.windows(pairs)
        for batch in batches(windows):
            chosen = [windows[index] for index in batch]
            if not any(window.pieces for window in chosen):
                continue
            ids, attention, pooling, pieces = collated(chosen, self.tokenizer.pad)
            hidden = self.encoder(ids, attention)
            logits = self.head(piece_features(hidden, pooling, [piece[0] for piece in pieces]))
            probabilities = torch.sigmoid(logits[:, output]).tolist()
            for (_row, pair, sentence, _start), probability in zip(pieces, probabilities, strict=True):
                if not seen[pair][sentence] or probability > result[pair][sentence]:
                    result[pair][sentence] = probability
                    seen[pair][sentence] = True
        return result
