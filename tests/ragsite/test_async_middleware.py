"""The middleware under ASGI: no thread hop per hook, and what the hooks did before still done
(ragsite/async_middleware.py)."""

from __future__ import annotations

import asyncio
import re

import pytest
from asgiref.sync import SyncToAsync, sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connections
from django.test import AsyncClient
from django.utils.deprecation import MiddlewareMixin
from django.utils.module_loading import import_string

from ragsite.async_middleware import INLINE
from search.models import Membership
from search.services import workspace_create

pytestmark = pytest.mark.django_db(transaction=True)


def test_every_middleware_is_async_capable_and_none_hops_per_hook():
    for path in settings.MIDDLEWARE:
        middleware = import_string(path)
        assert getattr(middleware, "async_capable", False), f"{path} would run the chain below it in a thread"
        hooks = hasattr(middleware, "process_request") or hasattr(middleware, "process_response")
        if issubclass(middleware, MiddlewareMixin) and hooks:
            assert path in INLINE, f"{path} hops to a thread for each of its hooks"


def _thread_hops(monkeypatch) -> list[str]:
    """The names of the functions each ``sync_to_async`` call ran, in order."""
    hops = []
    original = SyncToAsync.__call__

    async def counted(self, *args, **kwargs):
        hops.append(getattr(self.func, "__qualname__", repr(self.func)))
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(SyncToAsync, "__call__", counted)
    return hops


def test_a_page_under_asgi_goes_to_a_thread_for_the_request_signals_and_its_view_only(monkeypatch):
    user = get_user_model().objects.create_user("ann", password="a long pass phrase")
    Membership.objects.create(workspace=workspace_create(name="Acme", slug="acme"), user=user)

    async def scenario():
        client = AsyncClient()
        await client.aforce_login(user)
        await client.get("/documents/")  # the first visit stores the chosen workspace in the session
        hops = _thread_hops(monkeypatch)
        response = await client.get("/documents/")
        seen = list(hops)
        await sync_to_async(connections.close_all)()
        return response, seen

    response, hops = asyncio.run(scenario())
    assert response.status_code == 200
    # The test client's request_started and request_finished receivers, then the (synchronous)
    # view; with Django's MiddlewareMixin there were 15 more, one per hook.
    assert [hop for hop in hops if "Middleware" in hop] == []
    assert len(hops) == 3, hops


def test_csrf_sessions_and_messages_work_as_before_under_asgi():
    user = get_user_model().objects.create_user("ann", password="a long pass phrase")
    Membership.objects.create(workspace=workspace_create(name="Acme", slug="acme"), user=user)
    credentials = {"username": "ann", "password": "a long pass phrase"}

    async def scenario():
        client = AsyncClient(enforce_csrf_checks=True)
        without_token = await client.post("/accounts/login/", credentials)
        form = await client.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.content.decode()).group(1)
        logged_in = await client.post("/accounts/login/", {**credentials, "csrfmiddlewaretoken": token})
        documents = await client.get("/documents/")
        # An upload without a file: the view adds an error message and redirects; the next
        # page shows it once (stored by the message middleware's response, read by the page).
        refused = await client.post("/documents/upload/", {"csrfmiddlewaretoken": client.cookies["csrftoken"].value})
        shown = await client.get("/documents/")
        again = await client.get("/documents/")
        await sync_to_async(connections.close_all)()
        return without_token, logged_in, documents, refused, shown, again

    without_token, logged_in, documents, refused, shown, again = asyncio.run(scenario())
    assert without_token.status_code == 403
    assert b"CSRF verification failed" in without_token.content
    assert logged_in.status_code == 302 and logged_in["Location"] == "/"
    assert documents.status_code == 200 and b"Acme" in documents.content
    assert refused.status_code == 302 and refused["Location"] == "/documents/"
    assert b"This field is required." in shown.content
    assert b"This field is required." not in again.content
    for response in (documents, shown):
        assert response["X-Frame-Options"] == "DENY"
        assert response["X-Content-Type-Options"] == "nosniff"
        assert "Content-Security-Policy" in response
