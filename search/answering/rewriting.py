"""A follow-up rewritten into a standalone question by the route's model (docs/search.md, "Follow-ups").

``followup_rewrite`` sends one short generation (``rewrite_messages``: the latest turns, each
answer cut to ``ANSWER_CHARS``, and the follow-up; at most ``REWRITE_MAX_TOKENS``, temperature
0) through the same route, admission and queue as an answer's own request, under its own
request id: it is billed as its own ledger row, to the same client key. It waits for the
rewrite on the generation's stream at most ``settings.FOLLOWUP_REWRITE_TIMEOUT_S``; a rewrite
that fails, comes late, or is no question (empty, too long, several lines, or none of the
follow-up's words: an answer rather than its question) raises
``RewriteFailed`` with the reason, and the answer falls back to the term-based reading
(``search.answering.conversations.followup_terms``), saying why. A late rewrite still finishes and is
billed: its generation was sent.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from django.conf import settings

from billing import ledger
from inference import router
from inference.streams import stream_read
from search.answering import prompting
from search.answering.abstention import QUESTION_STOP_WORDS
from search.answering.conversations import Turn, words_of

REWRITE_MAX_TOKENS = 64
ANSWER_CHARS = 400
# The turns the rewrite reads: the latest few (a pronoun rarely reaches further back).
REWRITE_TURNS = 3
QUESTION_MAX_CHARS = 500
OUTCOME_KIND = "rewrite"
REWRITE_SYSTEM_PROMPT = (
    "You rewrite the last question of a conversation so that it can be understood without the conversation: "
    "replace pronouns and references with what they refer to, keep every other word the user chose, and do "
    "not answer it. Reply with the rewritten question only, on one line. If it already stands alone, repeat it."
)


class RewriteFailed(Exception):
    """Why no rewrite is used: the fallback's stated reason."""


@ledger.outcome_consumer(OUTCOME_KIND)
def _rewrite_outcome(outcome: dict) -> None:
    """The rewrite's outcome: its ledger row is stored by the drain; the answer read its text
    from the stream already, or fell back without it."""


def rewrite_messages(question: str, history: list[Turn]) -> list[dict]:
    lines = []
    for turn in history[-REWRITE_TURNS:]:
        lines.append(f"User: {turn.question.strip()}")
        if turn.answer:
            answer = turn.answer.strip()
            lines.append(f"Assistant: {answer[:ANSWER_CHARS]}{'…' if len(answer) > ANSWER_CHARS else ''}")
    conversation = "\n".join(lines)
    return [
        {"role": "system", "content": REWRITE_SYSTEM_PROMPT},
        {"role": "user", "content": f"Conversation:\n{conversation}\n\nLast question: {question.strip()}"},
    ]


def _words(text: str) -> set[str]:
    return {word.lower() for word in words_of(text)}


def _cleaned(text: str, question: str) -> str:
    """The model's line as a question: its label and quotes taken off. A line that keeps none of
    the follow-up's own words (those that name rather than ask) answered it, or announced an
    answer ("The answer to this question is yes.", small models' habit), instead of rewriting
    it: searching for that finds nothing the user asked about."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) != 1:
        raise RewriteFailed(
            f"the rewrite was {len(lines)} lines, not one question" if lines else "the rewrite was empty"
        )
    line = lines[0]
    for label in ("Rewritten question:", "Standalone question:", "Question:"):
        if line.lower().startswith(label.lower()):
            line = line[len(label) :].strip()
    line = line.strip("\"' \u201c\u201d\u2018\u2019").strip()  # straight and curly quotes
    if not line:
        raise RewriteFailed("the rewrite was empty")
    if len(line) > QUESTION_MAX_CHARS:
        raise RewriteFailed(f"the rewrite was {len(line)} characters long, over {QUESTION_MAX_CHARS}")
    named = _words(question) - QUESTION_STOP_WORDS
    if named and not named & _words(line):
        raise RewriteFailed("the rewrite keeps none of the follow-up's words: an answer, not the question")
    return line


def followup_rewrite(question: str, history: list[Turn], plan: router.Plan, submit, **common) -> str:
    """The follow-up as a standalone question, written by the plan's model; ``submit`` sends
    a request as the answer sends its own (``search.answering.answers._submit_admitted``'s signature
    without the client key), ``common`` its billing fields. Raises ``RewriteFailed``."""
    request_id = str(uuid.uuid4())
    messages = rewrite_messages(question, history)
    request = prompting.PromptRequest(
        messages=messages,
        max_tokens=REWRITE_MAX_TOKENS,
        prompt_tokens=prompting.RemoteEstimate().messages(messages),
        source_numbers=[],
    )
    bound_s = settings.FOLLOWUP_REWRITE_TIMEOUT_S
    deadline = time.monotonic() + bound_s
    submit(
        replace(plan, request_id=request_id), request, outcome_to={"kind": OUTCOME_KIND}, **{**common, "temperature": 0}
    )
    pieces: list[str] = []
    try:
        for _, kind, data in stream_read(request_id, block_ms=max(1, int(bound_s * 1000))):
            if kind == "retry":  # another key or endpoint starts the generation again
                pieces = []
            elif kind == "delta":
                pieces.append(data.get("text", ""))
            elif kind == "error":
                raise RewriteFailed(f"the rewrite failed: {data.get('message') or data.get('kind') or 'error'}")
            if time.monotonic() > deadline:
                raise TimeoutError
    except TimeoutError:
        raise RewriteFailed(f"the rewrite took longer than {bound_s:g} s") from None
    if time.monotonic() > deadline:
        raise RewriteFailed(f"the rewrite took longer than {bound_s:g} s")
    return _cleaned("".join(pieces), question)
