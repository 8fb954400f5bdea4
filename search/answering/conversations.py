"""Conversations: threads of questions, and how a follow-up is read (docs/search.md, "Follow-ups").

A conversation is owned by who started it (``client_id_of``: ``user:<id>`` or ``key:<id>``) in one
workspace; each answer is one of its turns. ``conversation_create``, ``conversation_rename``,
``conversation_delete`` and ``conversation_turns`` are the services every door uses;
``conversations_owned`` the one listing.

A follow-up ("And in Berlin?") is retrieved for as a standalone question. ``followup_terms``
builds it without a model: the latest earlier question whole, then the follow-up, then the
older questions' most telling words (highest IDF in the collections searched, not already
there, a turn further back weighing half), at most ``TERMS_MAX`` of them. The latest question
whole rather than its words: measured on Cranfield's conversational sets, its words alone
lost the dense half of retrieval (an embedding of a follow-up with words appended is not one
of a question; docs/benchmarks.md, "Conversational retrieval"). With
``FOLLOWUP_REWRITE`` on, ``search.answering.answers`` asks the route's model for a rewrite first
(``search.answering.rewriting``) and falls back to this reading when the rewrite fails or is late,
saying so in ``Answer.stats["followup"]``.

``history_for_prompt`` gives the earlier turns (questions and answers, their citation markers
removed: the sources they cited are not in this prompt) for ``search.answering.prompting``, which packs
them into the window oldest-dropped-first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from ragsite.errors import DomainError
from search import analysis
from search.access import OPERATOR, Reader, documents_unreadable
from search.answering.prompting import citation_markers
from search.models import Answer, Collection, Conversation, Workspace
from search.scoping import in_workspaces

TITLE_MAX_CHARS = 200
# The turns a follow-up is read with: the latest ones (older turns rarely name what "it" is).
HISTORY_TURNS_MAX = 6
# Words the earlier turns add to a follow-up's query, and how many earlier questions give them.
TERMS_MAX = 8
TERMS_TURNS = 3
# Each turn further back weighs this much less when the words are chosen.
TERMS_TURN_DECAY = 0.5

_WORD = re.compile(r"\w[\w'-]*\w|\w", re.UNICODE)
_SPACES = re.compile(r"\s+")


class ConversationError(DomainError, ValueError):
    """A conversation request that cannot be done as asked; ``field`` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(message, field=field)


class ConversationNotFound(DomainError):
    """A request named a conversation that is not the caller's: the same words whether it is
    someone else's or nobody's (a 400 naming the field, as for collections)."""

    field = "conversation"


# --------------------------------------------------------------------------- services


def title_from(question: str) -> str:
    """A conversation's title from its first question: one line, at most ``TITLE_MAX_CHARS``."""
    text = _SPACES.sub(" ", question).strip()
    if len(text) <= TITLE_MAX_CHARS:
        return text
    return text[: TITLE_MAX_CHARS - 1].rsplit(" ", 1)[0].rstrip(" ,;:") + "…"


def _title_clean(title) -> str:
    if not isinstance(title, str):
        raise ConversationError("title", f"the title must be text, got {title!r}")
    if "\x00" in title:
        raise ConversationError("title", "the title holds a NUL character")
    text = _SPACES.sub(" ", title).strip()
    if not text:
        raise ConversationError("title", "the title is empty")
    if len(text) > TITLE_MAX_CHARS:
        raise ConversationError("title", f"the title is {len(text)} characters long, over {TITLE_MAX_CHARS}")
    return text


def client_id_of(*, key=None, user=None) -> str:
    """Who asks, as answers and conversations record it (``client_id``): an API key
    (``key:<id>``), else a user (``user:<id>``), else nobody (""). Named apart because a key and
    a user may share a number: a conversation is its owner's alone, and a canary arm is sticky
    per client."""
    if key is not None:
        return f"key:{key.pk}"
    if user is not None and user.pk is not None:
        return f"user:{user.pk}"
    return ""


def conversation_create(*, workspace: Workspace, owner=None, client_id: str = "", title: str = "") -> Conversation:
    """A new conversation; untitled until its first question names it (``title`` may be given).
    ``client_id``: its owner's (``client_id_of``); default the ``owner`` user's."""
    client_id = (client_id or client_id_of(user=owner))[:100]
    return Conversation.objects.create(
        workspace=workspace, owner=owner, client_id=client_id, title=_title_clean(title) if title else ""
    )


def conversation_rename(*, conversation: Conversation, title: str) -> Conversation:
    conversation.title = _title_clean(title)
    conversation.save(update_fields=["title"])
    return conversation


def conversation_delete(*, conversation: Conversation) -> None:
    """The conversation and its answers. What they cost stays in the ledger (its rows are
    keyed by request id, not tied to the answers)."""
    conversation.delete()


def conversations_owned(workspace: Workspace | int, client_id: str) -> QuerySet:
    """The conversations ``client_id`` started in ``workspace``, latest turn first."""
    return in_workspaces(Conversation, workspace).filter(client_id=client_id).order_by("-updated_at", "-pk")


def conversation_of(workspace: Workspace | int, client_id: str, conversation_id) -> Conversation:
    """The caller's conversation, or ``ConversationNotFound``."""
    conversation = conversations_owned(workspace, client_id).filter(pk=conversation_id).first()
    if conversation is None:
        raise ConversationNotFound(f"No conversation {conversation_id} of yours in this workspace.")
    return conversation


def conversation_turns(conversation: Conversation) -> QuerySet:
    """Its answers, oldest first."""
    return conversation.answers.order_by("created_at", "pk")


def turn_started(conversation: Conversation, question: str, *, at=None) -> None:
    """A new turn asked ``at`` (default: now): the conversation is listed by it, and titled by
    its question if it had no title."""
    fields = {"updated_at": at or timezone.now()}
    if not conversation.title:
        fields["title"] = title_from(question)
    with transaction.atomic():
        Conversation.objects.filter(pk=conversation.pk).update(**fields)
    for name, value in fields.items():
        setattr(conversation, name, value)


# --------------------------------------------------------------------------- history


@dataclass(frozen=True)
class Turn:
    """An earlier turn as a follow-up reads it."""

    question: str
    answer: str  # the text without citation markers; "" while unanswered, failed or declined


# The first line of an answer quoted from its sources (search.answering.answers: "Extracted from the
# sources (why):", QUOTED_LEAD): what the answer is, not what it says.
_QUOTED_LEAD = re.compile(
    r"\A(?:(?:Extracted|Quoted) from the sources(?: \([^\n]*\))?:"
    r"|資料から(?:抜粋|引用)しました(?:（[^\n]*）)?：)[ \t]*\n"
)


def text_without_markers(text: str) -> str:
    """An answer's text as a later turn's prompt holds it: its ``[n]`` markers named sources
    that prompt does not give, and the lead line of a quoted answer goes (a small model given
    it writes the lead line again, and nothing after it)."""
    text = _QUOTED_LEAD.sub("", text.lstrip())
    pieces, last = [], 0
    for marker in citation_markers(text):
        pieces.append(text[last : marker.start].rstrip(" "))
        last = marker.end
    pieces.append(text[last:])
    return "".join(pieces).strip()


def history_of(conversation: Conversation | None, *, before=None, reader: Reader = OPERATOR) -> list[Turn]:
    """The conversation's latest ``HISTORY_TURNS_MAX`` turns before ``before`` (a time; None:
    all), oldest first. A turn that failed is left out: its question was not answered. An
    answer that cites a document ``reader`` may no longer read (search.access) is left out
    too, its question kept: the next turn must not be read with, or repeat, what it quoted."""
    if conversation is None or conversation.pk is None:
        return []
    rows = conversation_turns(conversation).exclude(status=Answer.Status.FAILED)
    if before is not None:
        rows = rows.filter(created_at__lt=before)
    latest = list(
        rows.order_by("-created_at", "-pk").values_list("question", "text", "abstained", "status", "sources")[
            :HISTORY_TURNS_MAX
        ]
    )
    unreadable = documents_unreadable(
        {source["document_id"] for *_, sources in latest for source in sources or ()}, reader
    )
    return [
        Turn(
            question=question,
            answer=""
            if abstained
            or status != Answer.Status.DONE
            or any(source["document_id"] in unreadable for source in sources or ())
            else text_without_markers(text),
        )
        for question, text, abstained, status, sources in reversed(latest)
    ]


# --------------------------------------------------------------------------- follow-ups


@dataclass(frozen=True)
class FollowupReading:
    """What a question was retrieved for, and how it was read."""

    query: str
    method: str  # "standalone" (a first question), "terms", "model"
    terms: tuple[str, ...] = ()
    # Why the model's rewrite was not used, when it was tried: the fallback says so.
    fallback: str = ""
    rewrite_ms: float | None = None

    def as_record(self) -> dict:
        record: dict = {"method": self.method, "query": self.query}
        if self.terms:
            record["terms"] = list(self.terms)
        if self.fallback:
            record["fallback"] = self.fallback
        if self.rewrite_ms is not None:
            record["rewrite_ms"] = self.rewrite_ms
        return record


def words_of(text: str) -> list[str]:
    """The words of a question as follow-ups are read: a Japanese one's as search.analysis
    splits them, another's by spaces and punctuation (a hyphenated or elided word is one)."""
    if analysis.language_of(text) == analysis.JAPANESE:
        return analysis.words(text)
    return _WORD.findall(text)


def word_weights(words: list[str], collections: list[Collection]) -> dict[str, tuple[str, float]]:
    """Each word's BM25 lexeme and IDF over ``collections``, as keyword search weighs it (one
    statement). A word without a rankable lexeme, or that no chunk holds, is left out: it
    could not match anything."""
    if not words or not collections:
        return {}
    configs = {collection.text_search_config for collection in collections}
    config = sorted(configs)[0]
    # Each word as keyword search reads it: a Japanese one's lemma under search_japanese.
    analysed = [analysis.analysed(word, language=analysis.AUTO, config=config) for word in words]
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH words AS (
                -- A word analysed into several lexemes (a hyphenated one) is read as its longest.
                SELECT w.word, (SELECT u.lexeme FROM unnest(search_tsvector(w.config::regconfig, w.body)) u
                                WHERE search_bm25_lexeme(u.lexeme)
                                ORDER BY length(u.lexeme) DESC, u.lexeme LIMIT 1) AS lexeme
                FROM unnest(%(words)s::text[], %(configs)s::text[], %(bodies)s::text[]) AS w(word, config, body)
            ), total AS (
                SELECT coalesce(sum(chunk_count), 0) AS n FROM search_collection WHERE id = ANY(%(collections)s)
            )
            SELECT w.word, w.lexeme, ln(1 + (total.n - df.df + 0.5) / (df.df + 0.5))
            FROM words w CROSS JOIN total
            JOIN LATERAL (
                SELECT sum(t.df) AS df FROM search_termstat t
                WHERE t.term = search_term_index(w.lexeme) AND t.collection_id = ANY(%(collections)s)
            ) df ON df.df > 0
            WHERE w.lexeme IS NOT NULL
            """,
            {
                "words": words,
                "configs": [config for config, _ in analysed],
                "bodies": [
                    terms if terms is not None else word for (_, terms), word in zip(analysed, words, strict=True)
                ],
                "collections": [collection.pk for collection in collections],
            },
        )
        return {word: (lexeme, float(idf)) for word, lexeme, idf in cursor.fetchall()}


def followup_terms(question: str, history: list[Turn], collections: list[Collection]) -> FollowupReading:
    """The latest earlier question whole, then the follow-up, then the older questions' most
    telling words (see the module docstring)."""
    if not history:
        return FollowupReading(query=question, method="standalone")
    latest, older = history[-1].question.strip(), [turn.question for turn in history[-TERMS_TURNS:-1]][::-1]
    terms: tuple[str, ...] = ()
    if older:
        candidates = [words_of(text) for text in older]  # the latest first
        own = words_of(question) + words_of(latest)
        weights = word_weights(sorted({*own, *(word for words in candidates for word in words)}), collections)
        present = {weights[word][0] for word in own if word in weights}
        scored: dict[str, tuple[float, str]] = {}  # lexeme -> (score, the word as written)
        for age, words in enumerate(candidates):
            for word in words:
                if word not in weights:
                    continue
                lexeme, idf = weights[word]
                if lexeme in present:
                    continue
                score = idf * TERMS_TURN_DECAY**age
                if score > scored.get(lexeme, (0.0, ""))[0]:
                    scored[lexeme] = (score, word)
        terms = tuple(word for _, word in sorted(scored.values(), key=lambda item: -item[0])[:TERMS_MAX])
    query = " ".join(part for part in (latest, question.strip(), " ".join(terms)) if part)
    return FollowupReading(query=query, method="terms", terms=terms)
