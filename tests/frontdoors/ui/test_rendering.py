"""Stored answers as HTML: every [n] form that search.answering.prompting reads becomes links, the rest
is escaped. (static/search/ui.js does the same for streamed answers; test_browser.py.)"""

from __future__ import annotations

from frontdoors.ui.rendering import answer_html

SOURCES = [
    {"number": 1, "chunk_id": 11, "document_id": 1, "title": "Wing <aerodynamics>"},
    {"number": 2, "chunk_id": 12, "document_id": 2, "title": "Heat"},
]


def link(number: int, chunk_id: int, title: str) -> str:
    return (
        f'<a class="cite" href="/passages/{chunk_id}/" data-passage title="{title}" '
        f'aria-label="Source {number}: {title}">{number}</a>'
    )


def test_each_cited_number_links_to_its_passage_and_everything_else_is_escaped():
    wing, heat = link(1, 11, "Wing &lt;aerodynamics&gt;"), link(2, 12, "Heat")
    assert answer_html("Lift <rises> [1].", SOURCES) == f"Lift &lt;rises&gt; [{wing}]."
    assert answer_html("Both [1, 2], a range [1-2], unknown [2; 7].", SOURCES) == (
        f"Both [{wing}, {heat}], a range [{wing}, {heat}], unknown [{heat}, 7]."
    )
    assert answer_html("No sources [1].", []) == "No sources [1]."
