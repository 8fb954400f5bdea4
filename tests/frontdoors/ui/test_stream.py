"""An answer's Server-Sent Events through the real ASGI server (uvicorn, as in production):
each event reaches the browser as soon as it is written, not when the answer ends, and a
reconnection resumes after the last event received."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from django.conf import settings
from django.test import Client

from inference.streams import StreamWriter
from search.models import Answer
from tests.frontdoors.ui.conftest import member

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]  # the server sees committed rows


def open_events(url: str, session: str | None, last_event_id: str | None = None):
    headers = {"Accept": "text/event-stream"}
    if session:
        headers["Cookie"] = f"{settings.SESSION_COOKIE_NAME}={session}"
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=20)


def next_event(response) -> dict | None:
    """The next event's fields (``id``, ``event``, ``data``, ``retry``), or None at the end."""
    fields: dict = {}
    while True:
        line = response.readline().decode()
        if not line:
            return fields or None
        if line == "\n":
            if fields:
                return fields
            continue
        if line.startswith(":"):  # a keep-alive comment
            continue
        name, _, value = line.rstrip("\n").partition(": ")
        fields[name] = json.loads(value) if name == "data" else value


def session_of(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


def test_events_arrive_as_they_are_written_and_resume_after_the_last_id(start_web):
    from search.services import workspace_create

    acme, globex = workspace_create(name="Acme", slug="acme"), workspace_create(name="Globex", slug="globex")
    ann, bob = member("ann", acme), member("bob", globex)
    answer = Answer.objects.create(workspace=acme, asker=ann, question="Lift?", status=Answer.Status.GENERATING)
    writer = StreamWriter(str(answer.id))
    first_id = writer.write("sentence", text="Lift rises ")

    with start_web() as base_url:
        url = f"{base_url}/answers/{answer.pk}/events/"
        with open_events(url, session_of(ann)) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            assert next_event(response) == {"retry": "3000"}
            assert next_event(response) == {"id": first_id, "event": "delta", "data": {"text": "Lift rises "}}
            # The connection is open and idle; what is written now arrives now.
            second_id = writer.write("sentence", text="with the angle [1].")
            assert next_event(response) == {"id": second_id, "event": "delta", "data": {"text": "with the angle [1]."}}
            writer.write("progress", stage="map", done=1, total=2)
            assert next_event(response)["event"] == "progress"
            stats_id = writer.write("stats", completion_tokens=7)
            assert next_event(response) == {"id": stats_id, "event": "stats", "data": {"completion_tokens": 7}}
            # The generation has ended; the stored answer, its citations checked, ends the stream.
            answer_id = writer.write("answer", text="Lift rises with the angle [1].", sentences=[])
            assert next_event(response) == {
                "id": answer_id,
                "event": "answer",
                "data": {"text": "Lift rises with the angle [1].", "sentences": []},
            }
            assert next_event(response) is None  # the server ends the response after the answer

        # The browser reconnects with the last id it saw: only what came after.
        with open_events(url, session_of(ann), last_event_id=first_id) as response:
            events = [event for event in iter(lambda: next_event(response), None) if "event" in event]
        assert [event["id"] for event in events] == [second_id, events[1]["id"], stats_id, answer_id]

        with pytest.raises(urllib.error.HTTPError) as anonymous:
            open_events(url, None)
        assert anonymous.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as outsider:
            open_events(url, session_of(bob))
        assert outsider.value.code == 404
