"""The generation pool end to end: a task on queue ``gpu``, a real worker process, Redis Streams."""

from __future__ import annotations

import uuid

import pytest

from inference.engine import GenerationRequest, GenerationStats, generate
from inference.streams import stream_read
from inference.tasks import generate_local
from tests.inference.tiny_models import tiny_model_save

pytestmark = pytest.mark.slow

PROMPT = "the wing flow of the shock wave is high and the lift of the wing flow is low"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return tiny_model_save(path, 1)


def reference(model_dir: str, max_tokens: int) -> str:
    from inference.engine.models import models_load

    models = models_load(model_dir, dtype="float32")
    request = GenerationRequest(prompt_ids=models.tokenizer.encode(PROMPT), max_tokens=max_tokens)
    pieces = list(generate(request, target=models.target, tokenizer=models.tokenizer))
    return "".join(piece for piece in pieces if not isinstance(piece, GenerationStats))


def test_a_request_streams_through_a_gpu_worker_in_order(start_worker, model_dir):
    expected = reference(model_dir, 24)
    with start_worker(["gpu"]):
        request_id = uuid.uuid4().hex
        generate_local.delay(
            request_id,
            {
                "model": model_dir,
                "dtype": "float32",
                "prompt": PROMPT,
                "max_tokens": 24,
                "speculative": {"method": "ngram", "k": 4},
            },
        )
        events = list(stream_read(request_id, block_ms=60000))
        # A reader arriving late gets the whole stream again, from the start.
        replay = list(stream_read(request_id, block_ms=1000))

        bad_id = uuid.uuid4().hex
        generate_local.delay(bad_id, {"model": model_dir, "prompt": PROMPT, "speculative": {"method": "ngram", "k": 0}})
        error = list(stream_read(bad_id, block_ms=60000))
        # The worker keeps serving after a refused request.
        again = uuid.uuid4().hex
        generate_local.delay(again, {"model": model_dir, "dtype": "float32", "prompt": PROMPT, "max_tokens": 24})
        after_error = list(stream_read(again, block_ms=60000))

    kinds = [kind for _, kind, _ in events]
    assert kinds[-1] == "stats" and set(kinds[:-1]) == {"delta"}
    assert "".join(data["text"] for _, kind, data in events if kind == "delta") == expected
    ids = [event_id for event_id, _, _ in events]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    stats = events[-1][2]
    assert stats["completion_tokens"] == 24
    assert stats["finish_reason"] == "length"
    assert stats["draft_tokens_proposed"] >= stats["draft_tokens_accepted"] >= 0
    assert stats["target_passes"] >= 1 and stats["tokens_per_s"] > 0
    assert replay == events
    assert [(kind, data["field"]) for _, kind, data in error] == [("error", "speculative.k")]
    assert "".join(data["text"] for _, kind, data in after_error if kind == "delta") == expected
