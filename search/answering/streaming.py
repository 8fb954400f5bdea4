"""An answer's sentences verified while its generation streams.

The worker that runs a generation hands its deltas to the observer registered here
(``inference.observers``): a ``StreamVerifier`` over the passages the prompt gave. The stream
then carries, beside the model's raw ``delta`` events, ``sentence`` events: the verified text,
sentence by sentence, as the stored answer will say it. What the verifier found goes with the
generation's outcome (``stats["observed"]``), and the answer is stored from it
(``search.answering.answers``), so that what a streaming client was shown is the start of the
stored answer, never something the check withheld. Docs: docs/answers.md, "Verified while
streaming".
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.observers import generation_observer
from search import analysis
from search.answering.verification import StreamVerifier
from search.embedders import embedder_languages
from search.models import Answer, Chunk, Collection

# Outcomes addressed to answers (``router.submit``'s ``outcome_to``): ``{"kind": OUTCOME_KIND,
# "answer_id"}``, with ``"map": index`` for a map request of a map-reduce answer.
OUTCOME_KIND = "answer"
# The stream event that carries verified text (the model's own tokens are ``delta`` events).
SENTENCE = "sentence"


def scoring(collection: Collection | None) -> dict:
    """The embedding model and text-search language that judge sentences against a question
    (``abstention``, ``extractive``, ``verification``): the collection's."""
    return {
        "embedding_model": collection.embedding_model if collection else None,
        "text_search_config": collection.text_search_config if collection else None,
    }


def scoring_collection(collections: list[Collection] | None, language: str) -> Collection | None:
    """The collection whose embedding model judges sentences of a question in ``language``:
    the first whose model reads that language (a Japanese question beside an English-only
    model's collection is judged by the multilingual one's), else the first."""
    if not collections:
        return None
    return next((c for c in collections if language in embedder_languages(c.embedding_model)), collections[0])


@dataclass(frozen=True)
class Checking:
    """What an answer's generated text is checked against, and how."""

    passages: dict[int, str]  # source number -> its chunk's text, title first, as the prompt gave it
    texts: dict[int, str]  # chunk id -> its text
    collection: Collection | None
    withhold: bool  # the route abstains: what nothing supports is withheld

    def verifier(self) -> StreamVerifier:
        return StreamVerifier(self.passages, **scoring(self.collection), withhold=self.withhold)


def checking_of(answer: Answer) -> Checking | str:
    """What the answer's text is checked against; or, when there is nothing to check it
    against, why (no prompt sources: a map-reduce's notes only; or their chunks deleted since)."""
    numbers = {record["number"]: record["chunk_id"] for record in answer.sources}
    texts = dict(Chunk.objects.filter(pk__in=numbers.values()).values_list("pk", "text"))
    titles = {record["number"]: record.get("title") or "" for record in answer.sources}
    # With its title first, as the prompt gives it: a chunk often names its subject only there.
    passages = {
        number: f"{titles[number]}\n{texts[chunk_id]}".lstrip("\n")
        for number, chunk_id in numbers.items()
        if chunk_id in texts
    }
    if not passages:
        return "none of the passages given is stored any more" if numbers else "no sources"
    collection = scoring_collection(list(answer.collections.order_by("pk")), analysis.language_of(answer.question))
    withhold = answer.route.abstains if answer.route is not None else True
    return Checking(passages=passages, texts=texts, collection=collection, withhold=withhold)


class AnswerObserver:
    """The observer of an answer's generation: verified sentences as they complete."""

    def __init__(self, verifier: StreamVerifier):
        self.verifier = verifier
        self.shown = 0

    def delta(self, text: str) -> list[tuple[str, dict]]:
        return self._events(self.verifier.feed(text))

    def end(self) -> tuple[list[tuple[str, dict]], dict]:
        events = self._events(self.verifier.finish())
        result = self.verifier.result()
        # ``shown``: how much of ``text`` the stream carries already; the rest comes when the
        # answer is stored (all of it when nothing was supported: it is then replaced).
        return events, {"text": result.text, "shown": self.shown, "verification": result.as_dict()}

    def _events(self, shown: str) -> list[tuple[str, dict]]:
        if not shown:
            return []
        self.shown += len(shown)
        return [(SENTENCE, {"text": shown})]


@generation_observer(OUTCOME_KIND)
def answer_observer(payload: dict) -> AnswerObserver | None:
    """The observer of a generation whose outcome is an answer (not one of its map requests,
    whose notes are not its text), when its sources can be checked."""
    to = payload.get("outcome_to") or {}
    if to.get("map") is not None:
        return None
    answer = Answer.objects.select_related("route").filter(pk=to.get("answer_id")).first()
    if answer is None:
        return None
    checking = checking_of(answer)
    return AnswerObserver(checking.verifier()) if isinstance(checking, Checking) else None
