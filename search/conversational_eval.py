"""Conversational retrieval built from a judged collection (issue 28; docs/benchmarks.md,
"Conversational retrieval").

Each judged question becomes a conversation of two turns, judged with the question's own
qrels: a first turn that names its subject, then a follow-up that refers back to it without
naming it. ``manage.py eval_retrieval DIR --conversational`` retrieves for the question, for
the follow-up alone and for the follow-up read with its first turn
(``search.answering.conversations.followup_terms``).

The rule (``conversation_built``) is the same on any collection and never reads the
judgements. The subject is the question's ``SUBJECT_WORDS`` (3) most telling words: those of
highest IDF in the collection, as keyword search weighs them
(``search.answering.conversations.word_weights``; a tie goes to the earlier word), two forms of one
stem counting once, never more than half of the question's stems (one at least), so that the
follow-up keeps a question of its own. Words that ask rather than name (``FUNCTION_WORDS``:
"what", "how", "can") and words no chunk holds are never the subject: the first are rare in
any corpus of answers without telling anything, the second find nothing. The first turn
names the subject in the question's order ("I have a question about X Y Z."). The follow-up
is the question with every word of the subject's stems taken out: each run of them (words
with only spaces between, and an article just before) becomes "it". The function words are
English ones: on a collection in another language the rule still runs, but question words
can then be its subject.

A written sample (``followups_read``: JSONL of ``query_id``, ``first_turn``, ``followup``,
the question itself from the collection's queries.jsonl) gives the same figures for
follow-ups as a person writes them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from search.answering.conversations import word_weights
from search.models import Collection

SUBJECT_WORDS = 3
FIRST_TURN = "I have a question about {subject}."
FIRST_TURN_UNNAMED = "I have a question."  # a question with no word that search could find
PRONOUN = "it"
# Words that ask rather than name ("what", "how", "can", "should"): PostgreSQL's ``english``
# stop words (Snowball's list). Keyword search ranks most of them (it drops Lucene's 33 only),
# and a corpus of answers rarely holds a question word, so by IDF alone "what" would be the
# subject of many a question.
FUNCTION_WORDS = frozenset(
    (
        "i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she her "
        "hers herself it its itself they them their theirs themselves what which who whom this that these "
        "those am is are was were be been being have has had having do does did doing a an the and but if or "
        "because as until while of at by for with about against between into through during before after "
        "above below to from up down in out on off over under again further then once here there when where "
        "why how all any both each few more most other some such no nor not only own same so than too very s "
        "t can will just don should now "
    ).split()
)
# Read out of the follow-up with the run of subject words they introduce ("the flutter of"
# becomes "it of", not "the it of").
_ARTICLES = frozenset({"a", "an", "the"})

# The words of a text as search.answering.conversations reads them, so that its weights apply.
_WORD = re.compile(r"\w[\w'-]*\w|\w", re.UNICODE)


@dataclass(frozen=True)
class ConversationalQuery:
    """A judged question as two turns of a conversation."""

    query_id: str
    question: str  # the standalone question the judgements were made for
    first_turn: str
    followup: str
    subject: tuple[str, ...] = ()  # the words the first turn names (the rule's; empty when written)


def question_words(text: str) -> list[str]:
    return _WORD.findall(text)


def subject_of(question: str, weights: dict[str, tuple[str, float]]) -> tuple[str, ...]:
    """The question's most telling words (``weights``: word -> (lexeme, IDF)), in its order.

    One word a stem (its first form in the question); at most ``SUBJECT_WORDS``, and at most
    half of the question's rankable stems (one at least, when it has any)."""
    first_form: dict[str, tuple[int, str, float]] = {}  # lexeme -> (position, word, IDF)
    for position, word in enumerate(question_words(question)):
        if word in weights and word.lower() not in FUNCTION_WORDS and weights[word][0] not in first_form:
            lexeme, idf = weights[word]
            first_form[lexeme] = (position, word, idf)
    count = min(SUBJECT_WORDS, max(1, len(first_form) // 2)) if first_form else 0
    chosen = sorted(first_form.values(), key=lambda item: (-item[2], item[0]))[:count]
    return tuple(word for _, word, _ in sorted(chosen))


def followup_of(question: str, subject: tuple[str, ...], weights: dict[str, tuple[str, float]]) -> str:
    """The question without its subject: every word of the subject's stems out, each run of
    them (words with only spaces between, an article just before the first) replaced by
    ``PRONOUN``."""
    stems = {weights[word][0] for word in subject}
    tokens = list(_WORD.finditer(question))

    def adjacent(index: int) -> bool:  # the token at index follows the one before it with only spaces between
        return index > 0 and not question[tokens[index - 1].end() : tokens[index].start()].strip()

    named = [token.group() in weights and weights[token.group()][0] in stems for token in tokens]
    taken = [
        named[i] or (token.group().lower() in _ARTICLES and i + 1 < len(tokens) and named[i + 1] and adjacent(i + 1))
        for i, token in enumerate(tokens)
    ]
    pieces: list[str] = []
    copied = 0  # where the text not yet copied starts
    for i, token in enumerate(tokens):
        if not taken[i]:
            continue
        if not (adjacent(i) and taken[i - 1]):  # a run starts: one pronoun for all of it
            pieces += [question[copied : token.start()], PRONOUN]
        copied = token.end()
    pieces.append(question[copied:])
    return re.sub(r" {2,}", " ", "".join(pieces)).strip()


def conversation_built(query_id: str, question: str, weights: dict[str, tuple[str, float]]) -> ConversationalQuery:
    """The rule's two turns for one question (see the module docstring)."""
    subject = subject_of(question, weights)
    return ConversationalQuery(
        query_id=query_id,
        question=question,
        first_turn=FIRST_TURN.format(subject=" ".join(subject)) if subject else FIRST_TURN_UNNAMED,
        followup=followup_of(question, subject, weights),
        subject=subject,
    )


def conversations_built(queries: dict[str, str], collections: list[Collection]) -> list[ConversationalQuery]:
    """The rule's conversation for each question (``queries``: id -> text), its words weighed
    over ``collections`` in one statement."""
    words = sorted({word for question in queries.values() for word in question_words(question)})
    weights = word_weights(words, collections)
    return [conversation_built(query_id, question, weights) for query_id, question in queries.items()]


def followups_read(path: Path, queries: dict[str, str]) -> list[ConversationalQuery]:
    """A written sample: one JSON object a line with ``query_id``, ``first_turn`` and
    ``followup``; the question is ``queries[query_id]``. ``ValueError`` names the line of an
    entry that lacks a field, repeats a query or names one ``queries`` does not hold."""
    sample: list[ConversationalQuery] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc})") from None
            fields = ("query_id", "first_turn", "followup")
            missing = [field for field in fields if field not in row] if isinstance(row, dict) else list(fields)
            if missing:
                raise ValueError(
                    f"{where}: an object with query_id, first_turn and followup is wanted, lacking {missing}"
                )
            query_id, first_turn, followup = str(row["query_id"]), row["first_turn"], row["followup"]
            if not (
                isinstance(first_turn, str) and first_turn.strip() and isinstance(followup, str) and followup.strip()
            ):
                raise ValueError(f"{where}: first_turn and followup must be non-empty text")
            if query_id not in queries:
                raise ValueError(f"{where}: query {query_id} is not a judged query of this collection")
            if query_id in seen:
                raise ValueError(f"{where}: query {query_id} is given twice")
            seen.add(query_id)
            sample.append(
                ConversationalQuery(
                    query_id=query_id,
                    question=queries[query_id],
                    first_turn=first_turn.strip(),
                    followup=followup.strip(),
                )
            )
    return sample
