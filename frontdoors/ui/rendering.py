"""Text to HTML for the browser UI: answers with citation links, passages in their context.

Everything from a document or a model is escaped; the only markup added is ours (links
and ``<mark>``). ``static/search/ui.js`` renders streamed answers the same way in the
browser, so a stored answer and a streamed one look alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.urls import reverse
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext, gettext_lazy

from search.access import Reader
from search.answering.prompting import citation_markers
from search.models import Chunk
from search.scoping import in_workspaces


def sources_by_number(sources: list[dict]) -> dict[int, dict]:
    """``Answer.sources`` records keyed by their ``[n]``, each with its passage URL."""
    return {
        source["number"]: {
            "url": reverse("ui:passage", args=[source["chunk_id"]]),
            "title": source.get("title") or gettext("Passage %(id)s") % {"id": source["chunk_id"]},
        }
        for source in sources
    }


def citation_link(number: int, source: dict) -> SafeString:
    # The same words as ui.js's link for a streamed answer (frontdoors/ui/languages.py, "source").
    label = gettext("Source %(number)s: %(title)s") % {"number": number, "title": source["title"]}
    return format_html(
        '<a class="cite" href="{}" data-passage title="{}" aria-label="{}">{}</a>',
        source["url"],
        source["title"],
        label,
        number,
    )


UNSUPPORTED_TITLE = gettext_lazy("No passage given to the answer supports this sentence")


def _linked(text: str, by_number: dict[int, dict]) -> str:
    parts, position = [], 0
    for marker in citation_markers(text):
        parts.append(escape(text[position : marker.start]))
        numbers = [
            citation_link(number, by_number[number]) if number in by_number else escape(str(number))
            for number in marker.numbers
        ]
        parts.append("[" + ", ".join(numbers) + "]")
        position = marker.end
    parts.append(escape(text[position:]))
    return "".join(parts)


def answer_html(text: str, sources: list[dict], sentences: list[dict] | None = None) -> SafeString:
    """The answer's text, escaped, each ``[n]`` naming a source turned into a link to its
    passage; a number the answer was not given stays plain text, as it was dropped. A
    sentence that the citation check found unsupported (``sentences``: the answer's
    ``verification["sentences"]``, spans of ``text``) is marked as such."""
    by_number = sources_by_number(sources)
    parts, position = [], 0
    for sentence in sentences or ():
        start, end = sentence.get("start", 0), sentence.get("end", 0)
        if sentence.get("action") != "unsupported" or not position <= start < end <= len(text):
            continue
        parts.append(_linked(text[position:start], by_number))
        parts.append(
            format_html('<span class="unsupported" title="{}">', UNSUPPORTED_TITLE)
            + _linked(text[start:end], by_number)
            + "</span>"
        )
        position = end
    parts.append(_linked(text[position:], by_number))
    return mark_safe("".join(parts))  # noqa: S308 (each part is escaped or built by format_html)


@dataclass(frozen=True)
class PassageContext:
    chunk: Chunk
    before: str
    after: str
    previous_id: int | None
    next_id: int | None
    total: int


def passage_context(chunk: Chunk, reader: Reader) -> PassageContext:
    """The chunk with the text of its neighbours around it. The document's text is not
    stored, but each chunk is an exact slice of it (overlapping its neighbours), so the
    previous and next chunks give the words before and after."""
    siblings = in_workspaces(Chunk, chunk.document.collection.workspace_id, reader).filter(
        document_id=chunk.document_id, embedding_model=chunk.embedding_model
    )
    neighbours = {
        neighbour.ordinal: neighbour
        for neighbour in siblings.filter(ordinal__in=[chunk.ordinal - 1, chunk.ordinal + 1]).only(
            "ordinal", "text", "start_offset", "end_offset"
        )
    }
    previous, following = neighbours.get(chunk.ordinal - 1), neighbours.get(chunk.ordinal + 1)
    before = after = ""
    if previous is not None:
        if previous.end_offset > chunk.start_offset:  # overlapping: only the part before ours
            before = previous.text[: max(0, chunk.start_offset - previous.start_offset)]
        else:  # adjacent, or apart by whitespace the chunker left out
            before = previous.text + (" " if previous.end_offset < chunk.start_offset else "")
    if following is not None:
        if following.start_offset < chunk.end_offset:
            after = following.text[max(0, chunk.end_offset - following.start_offset) :]
        else:
            after = (" " if following.start_offset > chunk.end_offset else "") + following.text
    return PassageContext(
        chunk=chunk,
        before=before,
        after=after,
        previous_id=previous.pk if previous is not None else None,
        next_id=following.pk if following is not None else None,
        total=siblings.count(),
    )
