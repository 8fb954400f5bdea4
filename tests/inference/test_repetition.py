"""Generations that repeat themselves: the guard on texts (exact outcomes), then the cut
through the OpenAI protocol against the stand-in (a real process), through ``run_routed``
here, and through a real worker on the ``remote`` queue: the stream is closed (the stand-in
sees the client go), the answer ends as a success with finish_reason ``repetition``, one
ledger row bills the tokens received, and nothing is retried.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.models import UsageRecord
from inference import router
from inference.remote import (
    THRESHOLDS,
    RemoteEndpoint,
    RemoteRequest,
    RemoteStats,
    RepetitionGuard,
    estimate_prompt_tokens,
    stream_chat,
    transport,
    trim_repetition,
)
from ragsite import metrics
from tests.inference.routing_helpers import (
    PROMPT,
    REPLY,
    deltas,
    events_of,
    key_make,
    kinds,
    ledger_row,
    provider_make,
    route_make,
    routed,
    unique,
)
from tests.upstream_server import tokens_of, upstream_log, upstream_script


def pieces(text: str) -> list[str]:
    """Token-like deltas: each word with the whitespace before it (as the stand-in streams)."""
    return re.findall(r"\s*\S+|\s+$", text)


def fed(deltas: list[str]):
    """The guard's finding over ``deltas`` and how many deltas it took (None, len when none)."""
    guard = RepetitionGuard()
    for count, delta in enumerate(deltas, 1):
        found = guard.feed(delta)
        if found is not None:
            return found, count
    return None, len(deltas)


def loop_of(text: str):
    return fed(pieces(text))[0]


# --------------------------------------------------------------------------- loops

PHRASE = "and the airflow separates from the wing. "  # 41 characters


def test_a_sentence_repeated_three_times_is_cut_after_its_first_copy():
    intro = "Summary of the passages:\n"  # ends unlike the phrase: the run starts with it
    text = intro + PHRASE * 6
    found, count = fed(pieces(text))
    assert (found.rule, found.period, found.start_char) == ("span", len(PHRASE), len(intro))
    assert found.cut_at_char == len(intro) + len(PHRASE) - 1  # the trailing space dropped
    assert text[: found.cut_at_char] == intro + PHRASE.rstrip()
    # Found at the first check (every 16 characters) after the third copy is complete.
    assert len(intro) + 3 * len(PHRASE) <= found.chars_seen < len(intro) + 3 * len(PHRASE) + 16 + 8
    assert found.chars_seen == len("".join(pieces(text)[:count]))
    assert found.repeats == 3


def test_a_run_that_begins_inside_the_sentence_before_is_cut_at_the_unit_s_punctuation():
    # "... attack. " ends like the phrase (". "): the periodic run starts two characters early,
    # and the kept copy is extended to its full stop.
    intro = "Lift rises with the angle of attack. "
    text = intro + PHRASE * 5
    found = loop_of(text)
    assert (found.period, found.start_char) == (len(PHRASE), len(intro) - 2)
    assert text[: found.cut_at_char] == intro + PHRASE.rstrip()


def test_a_paragraph_repeated_three_times_is_found():
    paragraph = (
        "The warranty covers parts and labour for two years from the date of purchase [1]. "
        "Batteries are covered for one year [2]. Damage from misuse is not covered.\n\n"
    )
    assert 100 < len(paragraph) < THRESHOLDS.max_period_chars
    text = "Warranty:\n\n" + paragraph * 4
    found = loop_of(text)
    assert (found.rule, found.period, found.start_char) == ("span", len(paragraph), len("Warranty:\n\n") - 2)
    assert text[: found.cut_at_char] == "Warranty:\n\n" + paragraph.rstrip()


def test_a_short_line_repeated_three_times_is_found():
    text = "Steps:\n" + "Contact HR today.\n" * 5
    found = loop_of(text)
    assert (found.rule, found.period) == ("line", len("Contact HR today.\n"))
    assert text[: found.cut_at_char] == "Steps:\nContact HR today."
    assert found.chars_seen < len("Steps:\n") + 4 * len("Contact HR today.\n")


def test_a_run_of_digits_is_found_and_cut_to_one():
    text = "The total is 1" + "0" * 100
    found, count = fed(pieces("The total is 1") + ["0"] * 100)  # a digit per token, as Llama tokenizers do
    assert (found.rule, found.period, found.start_char) == ("digits", 1, len("The total is 1"))
    assert text[: found.cut_at_char] == "The total is 10"
    assert count < 4 + THRESHOLDS.digit_run_chars + THRESHOLDS.check_every_chars


def test_blank_lines_until_max_tokens_are_cut_off():
    found = fed(pieces("It is covered [1].") + ["\n"] * 200)[0]
    assert (found.rule, found.period, found.cut_at_char) == ("blank", 1, len("It is covered [1]."))


def test_a_short_phrase_repeated_is_found_once_it_fills_200_characters():
    text = "Yes! " * 60
    found = loop_of(text)
    assert (found.rule, found.period, found.start_char, found.cut_at_char) == ("short", 5, 0, 4)
    assert THRESHOLDS.short_run_chars <= found.chars_seen < THRESHOLDS.short_run_chars + 16 + 5
    # Shorter, it is left alone.
    assert loop_of("Yes! " * 30) is None


def test_a_phrase_of_a_few_words_said_four_times_running_is_found():
    # SmolLM2-135M on the demo corpus: five copies, then on to max_tokens.
    lead = "The Atlas-7 weighs 145 kg, with a lift height of 60 mm. It is a"
    found = loop_of(lead + " 600-kg (1,320-kg)" * 4)
    assert (found.rule, found.period, found.repeats) == ("phrase", len(" 600-kg (1,320-kg)"), 4)
    assert found.cut_at_char == len(lead + " 600-kg (1,320-kg)")
    # Three times is left alone (an emphatic "no, no, no, no" is shorter than a phrase).
    assert loop_of(lead + " 600-kg (1,320-kg)" * 3 + " in all.") is None


def test_eight_short_words_repeated_three_times_are_a_span():
    unit = "a b c d e f g h "  # 16 characters, 8 words
    found = loop_of("Letters: " + unit * 4)
    assert (found.rule, found.period) == ("span", len(unit))


def test_a_whole_loop_in_one_delta_is_found_in_it():
    text = "Summary:\n" + PHRASE * 4
    guard = RepetitionGuard()
    found = guard.feed(text)
    assert found is not None and text[: found.cut_at_char] == "Summary:\n" + PHRASE.rstrip()
    assert guard.feed("more") is found  # it stays found


def test_a_unit_longer_than_the_longest_period_looked_for_is_not_found():
    long = " ".join(f"word{i}" for i in range(80)) + ". "
    assert len(long) > THRESHOLDS.max_period_chars
    assert loop_of(long * 4) is None


def test_lines_the_same_but_for_their_numbers_four_in_a_row_are_a_counted_loop():
    # What the demo model wrote for "What is the minimum password length?" until max_tokens.
    intro = "The minimum password length is 14 characters [1].\n"
    counting = "".join(f"{n}. Minimum password length: {8 + 4 * n} characters.\n" for n in range(1, 9))
    found = loop_of(intro + counting)
    assert (found.rule, found.repeats) == ("counted", 4)
    # The run is found from its fourth copy on (its start may reach back into the intro's
    # end, which ends like a copy); what is kept is the intro and the first copy.
    assert len(intro) - 3 <= found.start_char <= len(intro)
    assert (intro + counting)[: found.cut_at_char] == intro + "1. Minimum password length: 12 characters."
    # Short lines too ("2. On-call: 1", ...), once four of them are complete (and the next
    # check, every 16 characters, has come).
    short = "Here:\n" + "".join(f"{n}. On-call: 1\n" for n in range(1, 5)) + "5. On-call: 1"
    assert loop_of(short).rule == "counted"
    assert loop_of("Here:\n" + "".join(f"{n}. On-call: 1\n" for n in range(1, 4)) + "4. On-call") is None


# --------------------------------------------------------------------------- legitimate texts

RAG_ANSWER = """\
Employees can claim travel expenses when the trip was approved in advance [1]. The policy sets out the steps:

1. Submit the travel request form to your manager at least five days before the trip [1].
2. Submit the receipts for transport and lodging within 30 days of your return [1][2].
3. Submit the mileage log if you used your own car; the rate is 0.30 EUR per km [2].
4. Submit any exceptions to the finance team, who decide within ten days [3].

Meals are reimbursed up to 45 EUR per day [2]. As the handbook puts it, "receipts are required for every \
expense above 10 EUR" [2], and "receipts are required for every expense above 10 EUR" also applies to \
meals paid by card [2][3]. Lost receipts can be replaced by a signed statement [3].

| Expense | Limit | Receipt needed |
|---------|-------|----------------|
| Meals | 45 EUR/day | yes |
| Taxi | 60 EUR/trip | yes |
| Parking | 20 EUR/day | yes |
| Tips | 10 EUR/day | no |

Sources: [1] Travel policy, [2] Expense handbook, [3] Finance FAQ.
"""

CODE = """\
```python
def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--limit", type=int, default=0)
    return parser.parse_args()
```

```js
function walk(tree) {
  for (const node of tree) {
    if (node.children) {
      walk(node.children);
    }
  }
}
```

```lua
for i = 1, 3 do
  if i > 1 then
    print(i)
  end
end
```
"""

TABLE = (
    "| Plan | Seats | Storage | Support | SSO | Audit log | API | Price |\n"
    "|------------|------------|------------|------------|------------|------------|------------|------------|\n"
    "| Free | 1 | 5 GB | community | no | no | no | 0 EUR |\n"
    "| Team | 10 | 100 GB | email | no | no | yes | 50 EUR |\n"
    "| Business | 50 | 1 TB | email | yes | no | yes | 200 EUR |\n"
    "| Enterprise | unlimited | 10 TB | phone | yes | yes | yes | on request |\n"
    "| Legacy | 1 | 5 GB | none | no | no | no | 0 EUR |\n"
    "| Legacy | 1 | 5 GB | none | no | no | no | 0 EUR |\n"
)


@pytest.mark.parametrize(
    "text",
    [
        RAG_ANSWER,
        CODE,
        TABLE,
        # A numbered list whose items share their first words.
        "".join(f"{n}. The employee must submit the form {form} to HR [{n}].\n" for n, form in enumerate("ABCDEF", 1)),
        # A quoted sentence repeated once.
        'The handbook says: "Lift rises with the angle of attack until the wing stalls." '
        "Lift rises with the angle of attack until the wing stalls. That is the whole rule [1].",
        # Separators, a large number, citations side by side.
        "Results\n" + "=" * 80 + "\n\nThe budget is 1000000000000 EUR [1][1][1][2].\n" + "-" * 120 + "\nEnd.",
        # A phrase said three times, and a short one four times.
        "It is light, it is fast, it is cheap: low weight, low weight, low weight is the point [1].",
        "Chant it: let it be, let it be, let it be, let it be, and stop there [1].",
        # A chorus said twice.
        "Row, row, row your boat, gently down the stream.\nRow, row, row your boat, gently down the stream.\n",
    ],
    ids=[
        "rag-answer",
        "code",
        "table",
        "numbered-list",
        "quoted-sentence",
        "separators",
        "phrase-three-times",
        "four-times",
        "twice",
    ],
)
def test_legitimate_text_is_never_cut(text):
    assert fed(pieces(text)) == (None, len(pieces(text)))
    assert RepetitionGuard().feed(text) is None  # nor when it comes in one delta


def test_the_guard_keeps_a_bounded_tail_and_checks_every_16_characters():
    checks = []

    class Counting(RepetitionGuard):
        def _check(self):
            checks.append(self.chars)
            return super()._check()

    guard = Counting()
    # No loop, not even one but for its numbers: the words rotate with periods of 11 and 13 sentences.
    words = "lift drag thrust weight heat flux wing nose tail spar rib skin flap".split()
    text = "".join(f"Sentence {n} says {words[n % 13]} and {words[n % 11]}. " for n in range(3000))
    for delta in pieces(text):
        assert guard.feed(delta) is None
    assert len(checks) <= len(text) / THRESHOLDS.check_every_chars
    assert len(guard._tail) <= guard._window and guard.chars == len(text)


# --------------------------------------------------------------------------- the stored text


def test_trim_repetition_applies_the_recorded_cut_idempotently():
    stats = {"finish_reason": "repetition", "repetition": {"cut_at_char": 5}}
    assert trim_repetition("Hello world", stats) == "Hello"
    assert trim_repetition("Hello", stats) == "Hello"
    for other in ({}, None, {"repetition": None}, {"repetition": {"cut_at_char": "5"}}, {"repetition": {}}):
        assert trim_repetition("Hello world", other) == "Hello world"


# --------------------------------------------------------------------------- through the protocol

LOOP_MAX_TOKENS = 400
PACE_MS = 5  # the stand-in's pace: 400 tokens would take 2 s; a cut one ends in a fraction of that
# Token chunks the stand-in may write after the client's cut before a write fails: those on the
# way while the client closed, and one into the closed socket (answered with a reset). Far
# fewer than the 64 KiB (~250 chunks) a connection kept for reuse would have read on.
IN_FLIGHT = 5


def expected_cut(prompt: str = PROMPT, max_tokens: int = LOOP_MAX_TOKENS):
    """The stand-in's looping tokens for ``prompt``, and the guard's finding over them: the
    tokens the client receives before it cuts (as the worker counts them: one per chunk)."""
    tokens = tokens_of(REPLY + " " + PHRASE * max_tokens)[:max_tokens]
    found, count = fed(tokens)
    assert found is not None
    return tokens, found, count


def test_a_looping_stream_is_cut_closed_and_ends_as_a_success(upstream_server, monkeypatch):
    # A fresh connection pool, as in a new worker process: which connection each request used.
    monkeypatch.setattr(transport, "_http", {"client": None, "pid": None})
    monkeypatch.setattr(transport, "_clients", type(transport._clients)())
    api_key = f"sk-test-{uuid.uuid4().hex}"
    upstream_script(upstream_server, api_key, [{"loop": PHRASE, "token_delay_ms": PACE_MS}, "ok"])
    endpoint = RemoteEndpoint(base_url=upstream_server, api_key=api_key, model="stand-in-7b", total_timeout_s=30)
    messages = [{"role": "user", "content": PROMPT}]
    tokens, found, count = expected_cut()

    started = time.monotonic()
    pieces_ = list(stream_chat(endpoint, RemoteRequest(messages=messages, max_tokens=LOOP_MAX_TOKENS)))
    elapsed = time.monotonic() - started
    *texts, stats = pieces_
    assert isinstance(stats, RemoteStats) and texts == tokens[:count]
    assert (stats.finish_reason, stats.usage_source, stats.completion_tokens) == ("repetition", "counted", count)
    assert stats.prompt_tokens == estimate_prompt_tokens(messages)
    assert stats.repetition == found.as_dict()
    assert "".join(texts)[: found.cut_at_char] == REPLY + " " + PHRASE.rstrip()
    assert stats.as_dict()["repetition"]["cut_at_char"] == found.cut_at_char
    assert elapsed < LOOP_MAX_TOKENS * PACE_MS / 1000  # well before the whole stream

    # The stand-in saw the client go: it stopped well before max_tokens.
    seen = finished_log(upstream_server, api_key, 1)[0]
    assert seen["disconnected"] is True and seen["tokens_planned"] == LOOP_MAX_TOKENS
    assert count <= seen["completion_tokens"] <= count + IN_FLIGHT, seen
    assert seen["outcome"] == f"client disconnected after {seen['completion_tokens']} tokens"
    # The connection was closed, not kept: the next request opens another.
    list(stream_chat(endpoint, RemoteRequest(messages=messages)))
    first, second = finished_log(upstream_server, api_key, 2)
    assert second["client_port"] != first["client_port"] and second["outcome"] == "ok"


def finished_log(base_url: str, api_key: str, n: int, timeout: float = 10) -> list[dict]:
    """The stand-in's log once its first ``n`` requests have ended (it sees a disconnect on
    its next write)."""
    deadline = time.monotonic() + timeout
    while True:
        log = upstream_log(base_url, api_key)
        if (len(log) >= n and all(entry["finished"] for entry in log[:n])) or time.monotonic() > deadline:
            return log
        time.sleep(0.02)


# --------------------------------------------------------------------------- routed


def cut_count(model: str) -> float:
    """``ragsite_generations_cut_total`` of ``model``, from every process's metrics."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for sample in family.samples
        if sample.name == "ragsite_generations_cut_total" and sample.labels == {"model": model, "reason": "repetition"}
    )


@pytest.mark.django_db(transaction=True)
def test_a_routed_generation_cut_for_repetition_is_stored_trimmed_billed_once_and_not_retried(upstream_server):
    provider = provider_make(upstream_server, model=unique("looping"))
    key, secret = key_make(provider)
    spare_provider = provider_make(upstream_server)
    _, spare_secret = key_make(spare_provider)
    route = route_make(provider, fallbacks=(route_make(spare_provider),))
    upstream_script(upstream_server, secret, [{"loop": PHRASE, "token_delay_ms": PACE_MS}])
    tokens, found, count = expected_cut()

    result, events, usage = routed(route, max_tokens=LOOP_MAX_TOKENS)

    assert kinds(events) == ["delta"] * count + ["stats"]  # no retry event
    assert deltas(events) == tokens[:count]
    stats = events[-1][1]
    assert (stats["finish_reason"], stats["usage_source"], stats["attempts"]) == ("repetition", "counted", 1)
    assert stats["repetition"] == found.as_dict()
    # The outcome, which the answer stores (it travels in the ledger entry), keeps the loop's first copy only.
    assert (result["status"], result["attempts"]) == ("ok", 1)
    assert result["text"] == REPLY + " " + PHRASE.rstrip() == "".join(deltas(events))[: found.cut_at_char]
    # One ledger row: answered (ok), the tokens received, the prompt estimated.
    assert UsageRecord.objects.filter(request_id=result["request_id"]).count() == 1
    assert (usage.status, usage.error_class, usage.attempts, usage.upstream_key_id) == ("ok", "", 1, key.id)
    assert (usage.completion_tokens, usage.usage_source) == (count, "counted")
    assert usage.prompt_tokens == estimate_prompt_tokens([{"role": "user", "content": PROMPT}])
    # One request upstream, none to the fallback.
    assert len(upstream_log(upstream_server, secret)) == 1 and upstream_log(upstream_server, spare_secret) == []
    assert cut_count(provider.model) == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_looping_generation_through_a_remote_worker_is_cut_and_billed_once(start_worker, upstream_server):
    provider = provider_make(upstream_server, model=unique("looping"))
    key, secret = key_make(provider)
    route = route_make(provider)
    upstream_script(upstream_server, secret, [{"loop": PHRASE, "token_delay_ms": PACE_MS}])
    tokens, found, count = expected_cut()

    with start_worker(["remote"], pool="threads", concurrency=2):
        plan = router.plan(route_name=route.name, client_id="tests")
        router.submit(plan, messages=[{"role": "user", "content": PROMPT}], max_tokens=LOOP_MAX_TOKENS)
        events = events_of(plan.request_id, block_ms=30000)
        row = ledger_row(plan.request_id)

    assert kinds(events) == ["delta"] * count + ["stats"]
    assert deltas(events) == tokens[:count]
    assert events[-1][1]["finish_reason"] == "repetition" and events[-1][1]["repetition"] == found.as_dict()
    # The upstream got exactly one request, and saw the client go before max_tokens.
    [seen] = finished_log(upstream_server, secret, 1)
    assert seen["disconnected"] is True and count <= seen["completion_tokens"] <= count + IN_FLIGHT, seen
    # One ledger row, answered, with the tokens the worker received and the estimated prompt.
    assert UsageRecord.objects.filter(request_id=plan.request_id).count() == 1
    assert (row.status, row.error_class, row.attempts, row.upstream_key_id) == ("ok", "", 1, key.id)
    assert (row.completion_tokens, row.usage_source) == (count, "counted")
    assert row.prompt_tokens == estimate_prompt_tokens([{"role": "user", "content": PROMPT}])
    assert cut_count(provider.model) == 1  # recorded by the worker (multiprocess metrics)
