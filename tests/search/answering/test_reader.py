"""The reader (search/reader/, search/answering/reader.py): what it reads of long, empty and mixed
inputs, what it says of weights that are missing or corrupt, and answers falling back to the
lexical signals then, saying so in their stats. Its quality is measured by
``python -m benchmarks.reader`` and ``eval_answers`` (docs/answers.md, "The reader")."""

from __future__ import annotations

import shutil
import uuid

import pytest
from django.test import override_settings

from search.answering import reader
from search.answering.abstention import sentence_units
from search.answering.extractive import extractive_answer
from search.answering.prompting import Source
from search.reader import model
from search.reader.e5 import WeightsError

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def loaded():
    return model.ReaderModel()


@pytest.fixture
def fresh_reader():
    """The reader turned on (ANSWER_READER=reader), loaded afresh."""
    reader.reader_reset()
    with override_settings(ANSWER_READER="reader"):
        yield
    reader.reader_reset()


def _source(number: int, title: str, text: str) -> Source:
    return Source(number, number, number, title, text, 0, len(text), 1.0)


def _pieces_by_sentence(windows: list[model.Window]) -> dict[tuple[int, int], list[int]]:
    read: dict[tuple[int, int], list[int]] = {}
    for window in windows:
        for pair, sentence, start, end in window.pieces:
            read.setdefault((pair, sentence), []).extend(window.ids[start:end])
    return read


def test_a_passage_longer_than_the_window_is_read_in_windows_whole(loaded):
    sentences = tuple(
        f"Rule {n}: a travel request number {n} is approved by the manager of team {n}." for n in range(120)
    )
    pair = model.Pair("Who approves travel request number 117?", sentences, "Travel policy")
    windows = loaded.inputs.windows([pair])
    assert len(windows) > 1
    assert all(len(window.ids) <= 512 for window in windows)
    question = loaded.tokenizer.encode(["query: Who approves travel request number 117?"])[0]
    assert all(window.ids[1 : 1 + len(question)] == question for window in windows)  # each window asks again
    read = _pieces_by_sentence(windows)
    assert [read[(0, n)] for n in range(len(sentences))] == loaded.tokenizer.encode(list(sentences))
    scores = loaded.scores([pair], model.ANSWERS)[0]
    assert len(scores) == len(sentences)
    assert max(range(len(scores)), key=scores.__getitem__) == 117


def test_a_sentence_or_question_longer_than_the_window_is_read_in_pieces(loaded):
    long_sentence = "The retention schedule lists " + ", ".join(f"record class {n}" for n in range(300)) + "."
    long_question = "Which record classes are listed, " + " and ".join(f"class {n}" for n in range(200)) + "?"
    pair = model.Pair(long_question, ("Short first sentence here.", long_sentence), "")
    windows = loaded.inputs.windows([pair])
    ids = loaded.tokenizer.encode([long_sentence, f"query: {long_question}"])
    assert len(ids[0]) > 512 and len(ids[1]) > model.QUESTION_TOKENS
    question_pieces = -(-len(ids[1]) // model.QUESTION_TOKENS)
    read = _pieces_by_sentence(windows)
    # Every piece of the question reads the whole sentence once.
    assert read[(0, 1)] == ids[0] * question_pieces
    assert all(len(window.ids) <= 512 for window in windows)
    scores = loaded.scores([pair], model.ANSWERS)[0]
    assert len(scores) == 2 and all(0.0 <= score <= 1.0 for score in scores)


def test_an_empty_passage_is_read_as_nothing(loaded, fresh_reader):
    assert loaded.scores([model.Pair("What is the deadline?", (), "Empty")], model.ANSWERS) == [[]]
    assert reader.answers("What is the deadline?", [("Empty", [])]) == [[]]
    assert reader.supports("The deadline is Friday.", [("Empty", [])]) == [0.0]
    answer = extractive_answer("What is the deadline?", [_source(1, "Empty", "")], embedding_model=None)
    assert answer.abstained and answer.extracts == []


def test_japanese_and_english_in_one_pair(loaded, fresh_reader):
    # Japanese sentences naming English things, and a Japanese question naming them too.
    passages = [
        ("Atlas-7 仕様", sentence_units("Atlas-7 のバッテリーは連続12時間駆動します。本体の重さは1.2 kgです。")),
        ("Atlas-7 保証", sentence_units("Atlas-7 の保証期間は2年間です。修理は大阪の Service Center が受け付けます。")),
    ]
    battery = reader.answers("Atlas-7のバッテリーは何時間持ちますか？", passages)
    assert battery[0][0] == max(max(scores) for scores in battery)
    warranty = reader.answers("Atlas-7の保証期間は何年ですか？", passages)
    assert warranty[1][0] == max(max(scores) for scores in warranty)
    english = reader.answers(
        "How long is the Atlas-7 warranty?",
        [
            passages[0],
            (
                "Atlas-7 warranty",
                sentence_units(
                    "The Atlas-7 comes with a two-year warranty. Repairs are handled by the 大阪 Service Center."
                ),
            ),
        ],
    )
    assert english[1][0] == max(max(scores) for scores in english)


def test_scores_are_kept_and_the_same_when_read_again(fresh_reader):
    # A title of its own: what another test read is kept in Redis and would be found.
    title = f"Leave {uuid.uuid4()}"
    passages = [(title, sentence_units("Employees receive 25 days of paid leave a year. Leave carries over."))]
    first = reader.answers("How many days of paid leave do employees get?", passages)
    assert reader.reader_counts() == {"hits": 0, "read": 1}
    again = reader.answers("How many days of paid leave do employees get?", passages)
    assert again == first
    assert reader.reader_counts() == {"hits": 1, "read": 1}
    reader.reader_reset()  # the process forgets; Redis still holds it
    assert reader.answers("How many days of paid leave do employees get?", passages) == first
    assert reader.reader_counts() == {"hits": 1, "read": 0}


def test_missing_weights_name_the_file_and_answers_fall_back(tmp_path, monkeypatch, fresh_reader):
    missing = tmp_path / "reader.safetensors"
    monkeypatch.setattr(model, "HEAD_FILE", missing)
    with pytest.raises(WeightsError, match=f"missing: {missing}"):
        model.ReaderModel()
    assert str(missing) in reader.reader_description() and "UNAVAILABLE" in reader.reader_description()
    sources = [_source(1, "Leave", "Employees receive 25 days of paid leave a year.")]
    answer = extractive_answer("How many days of paid leave do employees get?", sources, embedding_model=None)
    assert answer.decided_by == {"reader": None, "reader_unavailable": reader.reader_unavailable()}
    assert str(missing) in answer.decided_by["reader_unavailable"]


def test_corrupt_weights_are_refused_naming_the_file(tmp_path, monkeypatch, fresh_reader):
    corrupt = tmp_path / "reader.safetensors"
    shutil.copy(model.HEAD_FILE, corrupt)
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    monkeypatch.setattr(model, "HEAD_FILE", corrupt)
    with pytest.raises(WeightsError, match=f"corrupt: {corrupt}"):
        model.ReaderModel()
    truncated = tmp_path / "short.safetensors"
    truncated.write_bytes(model.HEAD_FILE.read_bytes()[:1000])
    with pytest.raises(WeightsError, match=str(truncated)):
        model.ReaderModel(head_path=truncated)
    assert reader.reader_get() is None
    assert str(corrupt) in reader.reader_unavailable()


def test_answers_say_when_the_reader_is_off():
    reader.reader_reset()
    with override_settings(ANSWER_READER="signals"):
        sources = [_source(1, "Leave", "Employees receive 25 days of paid leave a year.")]
        answer = extractive_answer("How many days of paid leave do employees get?", sources, embedding_model=None)
        assert answer.decided_by == {"reader": None, "reader_unavailable": "turned off (ANSWER_READER=signals)"}
        assert reader.reader_description().startswith("off (ANSWER_READER=signals")
    reader.reader_reset()


def test_answers_decided_by_the_reader_say_its_version(fresh_reader):
    sources = [
        _source(1, "Leave", "Employees receive 25 days of paid leave a year. Unused days carry over until March."),
        _source(2, "Travel", "Book trains in second class. Flights need the manager's approval."),
    ]
    answer = extractive_answer("How many days of paid leave do employees get?", sources, embedding_model=None)
    version = model.weights_manifest()["version"]
    assert answer.decided_by == {"reader": version}
    assert not answer.abstained
    assert answer.extracts[0].number == 1 and "25 days" in answer.extracts[0].sentence
    declined = extractive_answer("What is the CEO's salary?", sources, embedding_model=None)
    assert declined.abstained and declined.decided_by == {"reader": version}
