"""Prompt building, the context budget, map-reduce planning and citation parsing (no workers)."""

from __future__ import annotations

import pytest

from inference.models import Provider, Route
from search.answering import prompting
from search.answering.extractive import LEAD, NOTHING_FOUND, extractive_answer, sentences_of
from search.answering.prompting import (
    MAP_SYSTEM_PROMPT,
    NO_SOURCES,
    REDUCE_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    PromptBudget,
    PromptTooLong,
    RemoteEstimate,
    Source,
    answer_messages,
    citation_markers,
    citations_resolve,
    prompt_budget_for,
    prompt_plan,
    reduce_request,
    text_split_to_fit,
)
from tests.inference.tiny_models import CHAT_TEMPLATE, tiny_model_save, tiny_tokenizer


class WordCount:
    """A tokenizer stand-in whose arithmetic a test can do by hand: one token per word."""

    name = "words"
    overcount = 1.0

    def messages(self, messages: list[dict]) -> int:
        return sum(len(str(m["content"]).split()) for m in messages)


def source(number: int, words: int, title: str = "", word: str = "alpha") -> Source:
    text = " ".join(f"{word}{i}." if i % 10 == 9 else f"{word}{i}" for i in range(words))
    return Source(
        number=number,
        chunk_id=100 + number,
        document_id=10 + number,
        title=title or f"Doc {number}",
        text=text,
        start_offset=0,
        end_offset=len(text),
        score=1.0 / number,
    )


QUESTION = "What does the handbook say?"


# --------------------------------------------------------------------------- citations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Lift rises [1].", [(1,)]),
        ("Both say so [1, 3].", [(1, 3)]),
        ("Both say so [1,3] and [2 ; 4].", [(1, 3), (2, 4)]),
        ("Adjacent [2][3].", [(2,), (3,)]),
        ("A range [1-3].", [(1, 2, 3)]),
        ("An en dash range [2\u20134].", [(2, 3, 4)]),
        ("Mixed [1, 3-4].", [(1, 3, 4)]),
        ("Backwards [3-1].", [(3, 1)]),
        ("Too wide [1-500].", [(1, 500)]),
        ("Repeated [2, 2].", [(2,)]),
        ("Not citations: [a], [], [1.5], [x1], (1).", []),
    ],
)
def test_citation_markers_read_every_form(text, expected):
    assert [marker.numbers for marker in citation_markers(text)] == expected


def test_citation_markers_give_their_place_in_the_text():
    text = "Heat flux is given in [2][9]."
    markers = citation_markers(text)
    assert [text[m.start : m.end] for m in markers] == ["[2]", "[9]"]


def test_citations_map_to_the_sources_given_and_unknown_numbers_are_dropped_and_counted():
    sources = [source(n, 5).as_record() for n in (1, 2, 3)]
    text = "A [2]. B [1][9]. C [1, 3]. D [9] [10-11]. E [0]."
    citations, dropped = citations_resolve(text, sources)
    assert [c["number"] for c in citations] == [2, 1, 3]
    assert citations[0] == {
        "number": 2,
        "chunk_id": 102,
        "document_id": 12,
        "title": "Doc 2",
        "start_offset": 0,
        "end_offset": len(source(2, 5).text),
    }
    assert dropped == 4  # 9 (twice, counted once), 10, 11, 0


def test_no_citation_no_drop():
    assert citations_resolve("No sources say this.", [source(1, 3).as_record()]) == ([], 0)


# --------------------------------------------------------------------------- messages


def test_the_prompt_numbers_the_sources_with_their_titles_and_ends_with_the_question():
    messages = answer_messages(QUESTION, [source(1, 3, "Travel policy"), source(2, 2, "Security")])
    assert messages == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {
            "role": "user",
            "content": "Sources:\n\n[1] Travel policy\nalpha0 alpha1 alpha2\n\n[2] Security\nalpha0 alpha1"
            "\n\nQuestion: What does the handbook say?",
        },
    ]
    for requirement in ("only the numbered sources", "[1]", "do not contain the answer", "language of the question"):
        assert requirement in SYSTEM_PROMPT


def test_a_routes_system_prompt_replaces_the_instructions():
    messages = answer_messages(QUESTION, [], "  Answer like a pirate, citing [n].  ")
    assert messages[0] == {"role": "system", "content": "Answer like a pirate, citing [n]."}
    assert messages[1]["content"] == f"{NO_SOURCES}\n\nQuestion: {QUESTION}"


# --------------------------------------------------------------------------- counting


def test_the_remote_estimate_rounds_up_and_counts_digits_and_other_scripts_one_each():
    assert RemoteEstimate.text("") == 0
    assert RemoteEstimate.text("abc") == 1
    assert RemoteEstimate.text("abcd") == 2  # 4 / 3, rounded up
    assert RemoteEstimate.text("12345") == 5
    assert RemoteEstimate.text("année 2024") == 2 + 4 + 1  # "anne"+" "=5 ASCII letters -> 2; 4 digits; "é"
    assert RemoteEstimate.text("東京") == 2
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "abcdef"}]
    assert RemoteEstimate().messages(messages) == 8 + (8 + 1) + (8 + 2)
    # English prose: real tokenizers need about one token per 4.3 characters; the estimate
    # counts one per 3, so it stays above them.
    prose = "The propeller slipstream increases the lift of the wing, and jet engines change it. " * 10
    assert RemoteEstimate.text(prose) >= len(prose) / 3


def remote_route(window: int = 4096, max_tokens: int = 512, system_prompt: str = "") -> Route:
    provider = Provider(name="up", kind="openai-compatible", base_url="http://x/v1", model="m", context_window=window)
    return Route(name="r", provider=provider, max_tokens=max_tokens, system_prompt=system_prompt)


def test_a_remote_budget_keeps_a_margin_of_16_tokens_and_5_percent():
    budget = prompt_budget_for(remote_route(4096, 512))
    assert (budget.window, budget.max_tokens, budget.margin) == (4096, 512, 16 + 205)
    assert budget.prompt_limit == 4096 - 512 - 221
    assert budget.counter.name == "estimate"
    assert prompt_budget_for(remote_route(4096, 512), max_tokens=100).max_tokens == 100


def test_max_tokens_that_leave_no_room_are_refused_naming_the_field():
    with pytest.raises(PromptTooLong) as caught:
        prompt_budget_for(remote_route(1000, 950))
    assert caught.value.field == "max_tokens"
    assert "up's context window of 1000 tokens" in str(caught.value)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-prompting")
    return tiny_model_save(path, 1, max_positions=300)


def test_a_local_budget_counts_with_the_models_tokenizer_within_the_models_own_window(tiny_model_dir):
    provider = Provider(name="pool", kind="local", model=tiny_model_dir, context_window=4096)
    route = Route(name="local", provider=provider, max_tokens=32)
    budget = prompt_budget_for(route)
    assert budget.counter.name == f"tokenizer:{tiny_model_dir}"
    assert budget.window == 300  # the model's max_position_embeddings, below the provider's 4096
    assert budget.margin == prompting.LOCAL_MARGIN_TOKENS
    sources = [source(n, 40, word="wing") for n in (1, 2, 3, 4, 5, 6)]
    plan = prompt_plan("the wing lift", sources, budget)
    [request] = plan.requests
    # No chat template: the contents blank-line joined, as our engine server builds the prompt.
    exact = len(tiny_tokenizer().encode("\n\n".join(message["content"] for message in request.messages)))
    assert request.prompt_tokens == exact <= 300 - 32 - prompting.LOCAL_MARGIN_TOKENS
    assert [s.number for s in plan.sources] == list(range(1, len(plan.sources) + 1))
    assert 0 < len(plan.sources) < 6 and len(plan.left_out) == 6 - len(plan.sources)


def test_a_local_budget_counts_the_chat_template_as_the_engine_server_applies_it(tmp_path):
    model = tiny_model_save(tmp_path / "templated", 1, max_positions=300, chat_template=True)
    budget = prompt_budget_for(
        Route(name="local", provider=Provider(name="pool", kind="local", model=model), max_tokens=32)
    )
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the wing lift"}]
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "be brief\n\nthe wing lift"
    assert budget.counter.messages(messages) == len(tokenizer.encode(rendered)) == 5


def test_a_local_model_whose_tokenizer_cannot_be_read_here_is_estimated(tmp_path):
    provider = Provider(name="pool", kind="local", model=str(tmp_path / "missing"), context_window=2048)
    budget = prompt_budget_for(Route(name="local", provider=provider, max_tokens=64))
    assert budget.counter.name == "estimate"
    assert budget.margin == 16 + 103


# --------------------------------------------------------------------------- packing


def words_budget(window: int, max_tokens: int = 10, margin: int = 0) -> PromptBudget:
    return PromptBudget(window=window, max_tokens=max_tokens, margin=margin, counter=WordCount())


def bare_words(system_prompt: str = SYSTEM_PROMPT) -> int:
    return WordCount().messages(answer_messages(QUESTION, [], system_prompt)) - len(NO_SOURCES.split())


def test_sources_are_packed_by_rank_and_a_source_that_does_not_fit_is_left_out_and_recorded():
    # Each source block is "[n] Doc n" (3 words) and its text; "Sources:" is 1 word.
    base = bare_words() + 1
    sources = [source(1, 30), source(2, 50), source(3, 20), source(4, 10)]
    budget = words_budget(base + 33 + 23 + 10 + 5, max_tokens=10)
    limit = base + 61
    assert budget.prompt_limit == limit
    plan = prompt_plan(QUESTION, sources, budget)
    assert plan.strategy == "single"
    assert [(s.number, s.chunk_id) for s in plan.sources] == [(1, 101), (2, 103)]  # renumbered: no gap
    assert plan.left_out == [
        {
            "chunk_id": 102,
            "document_id": 12,
            "score": 0.5,
            "reason": f"does not fit the context window (the prompt would take {base + 33 + 53} of {limit})",
        },
        {
            "chunk_id": 104,
            "document_id": 14,
            "score": 0.25,
            "reason": f"does not fit the context window (the prompt would take {base + 33 + 23 + 13} of {limit})",
        },
    ]
    [request] = plan.requests
    assert request.prompt_tokens == base + 33 + 23 <= budget.prompt_limit
    assert request.messages == answer_messages(QUESTION, plan.sources)
    assert request.max_tokens == 10 and request.source_numbers == [1, 2]
    record = plan.context_record()
    assert record["strategy"] == "single" and record["prompt_tokens"] == [base + 56]
    assert record["left_out"] == plan.left_out


def test_the_question_alone_must_fit():
    with pytest.raises(PromptTooLong) as caught:
        prompt_plan(QUESTION, [source(1, 5)], words_budget(bare_words() + len(NO_SOURCES.split()) + 9, 10))
    assert caught.value.field == "question"
    assert "ask a shorter question" in str(caught.value)


def test_a_source_larger_than_the_window_is_answered_by_map_reduce():
    # The window leaves 229 tokens for a prompt: the 400-word source cannot fit alone.
    budget = words_budget(329, max_tokens=100)
    sources = [source(1, 400, "Big report"), source(2, 20, "Note")]
    plan = prompt_plan(QUESTION, sources, budget)
    assert plan.strategy == "map_reduce"
    assert [s.number for s in plan.sources] == [1, 2]
    assert plan.left_out == []
    maps = plan.requests
    assert [request.source_numbers for request in maps] == [[1], [1, 2]]  # the small source rides along
    note_tokens = maps[0].max_tokens
    assert note_tokens == prompting.MAP_NOTE_MIN_TOKENS
    for request in maps:
        assert request.max_tokens == note_tokens
        assert request.messages[0] == {"role": "system", "content": MAP_SYSTEM_PROMPT}
        assert request.prompt_tokens == WordCount().messages(request.messages)
        assert request.prompt_tokens + request.max_tokens <= budget.window  # never over the window
        assert request.messages[1]["content"].endswith(f"Question: {QUESTION}")
    # Every word of the big source is in exactly one map request, in order, labelled as its part.
    bodies = "\n".join(r.messages[1]["content"] for r in maps)
    parts = [line for line in bodies.splitlines() if line.startswith("[1] Big report")]
    assert parts == ["[1] Big report (part 1 of 2)", "[1] Big report (part 2 of 2)"]
    words = [w for w in bodies.split() if w.startswith("alpha")]
    assert words == source(1, 400).text.split() + source(2, 20).text.split()
    assert plan.context_record()["note_tokens"] == note_tokens
    # All notes fit the reduce request.
    notes = [" ".join(["fact"] * note_tokens)] * len(maps)
    reduce, dropped = reduce_request(QUESTION, notes, plan.sources, budget)
    assert dropped == 0
    assert reduce.prompt_tokens + budget.max_tokens <= budget.window
    assert reduce.messages[0] == {"role": "system", "content": REDUCE_SYSTEM_PROMPT}
    assert "Sources: [1] Big report; [2] Note" in reduce.messages[1]["content"]


def test_map_requests_are_capped_and_what_is_beyond_is_left_out():
    plan = prompt_plan(QUESTION, [source(1, 2000), source(2, 10)], words_budget(312, max_tokens=100))
    assert plan.strategy == "map_reduce"
    assert len(plan.requests) == 3  # notes of 3 maps fill the reduce request
    assert [s.number for s in plan.sources] == [1]
    assert [item["chunk_id"] for item in plan.left_out] == [101, 102]
    assert plan.left_out[0]["reason"].startswith("parts 4, 5")
    assert plan.left_out[0]["reason"].endswith("over the limit of map requests")
    assert plan.left_out[1]["reason"] == "over the limit of 3 map requests"


def test_the_reduce_request_skips_empty_notes_and_drops_the_last_ones_that_do_not_fit():
    sources = [source(1, 3)]
    kept = WordCount().messages(prompting.reduce_messages(QUESTION, ["a b c [1]", "d " * 30], sources))
    budget = words_budget(kept + 1 + 5, max_tokens=5)  # one word short of the last note, "e [1]"
    request, dropped = reduce_request(
        QUESTION, ["NONE", "  ", "a b c [1]", "None.", "d " * 30, "e [1]"], sources, budget
    )
    assert dropped == 1
    assert "a b c [1]\n\n" + "d " * 29 + "d" in request.messages[1]["content"]
    assert "e [1]" not in request.messages[1]["content"]
    assert request.prompt_tokens <= budget.prompt_limit


def test_text_is_split_at_sentences_then_words_then_characters():
    def at_most(n):
        return lambda text: len(text) <= n

    text = "One two three. Four five six. Seven eight nine ten eleven twelve."
    assert text_split_to_fit(text, at_most(30)) == [
        "One two three. Four five six.",
        "Seven eight nine ten eleven",
        "twelve.",
    ]
    assert text_split_to_fit("abcdefghij", at_most(4)) == ["abcd", "efgh", "ij"]
    with pytest.raises(PromptTooLong):
        text_split_to_fit("abc", at_most(0))


# --------------------------------------------------------------------------- extractive


def test_sentences_skip_headings_fragments_and_questions():
    # A question in a source is a FAQ's heading (HTML headings come through as lines), not an answer.
    text = "# Atlas-7 robot\n\nThe robot runs for 10 hours. Charging takes 90 minutes! Ok.\nIt carries 300 kg?"
    assert sentences_of(text) == ["The robot runs for 10 hours.", "Charging takes 90 minutes!"]


def test_an_extractive_answer_quotes_the_best_sentences_with_their_numbers():
    sources = [
        Source(1, 11, 1, "Robot", "The robot runs for 10 hours. Charging takes 90 minutes.", 0, 55, 0.9),
        Source(2, 12, 2, "Travel", "Receipts are due within 30 days. Charging a card needs approval.", 0, 64, 0.5),
    ]
    answer = extractive_answer("How long does charging take?", sources, embedding_model=None, max_sentences=2)
    # The second sentence of source 2 holds no question term that the first did not: not quoted
    # just to fill the count.
    assert answer.text == f"{LEAD}\n\n- Charging takes 90 minutes. [1]"
    assert [(e.number, e.sentence) for e in answer.extracts] == [(1, "Charging takes 90 minutes.")]
    assert extractive_answer("anything", [], embedding_model=None).text == NOTHING_FOUND
