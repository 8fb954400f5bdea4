"""Django's middleware without a thread hop per hook under ASGI: the one patch of Django here.

``MiddlewareMixin.__acall__`` runs every ``process_request`` and ``process_response`` of a
middleware through ``sync_to_async``, and Django adapts a synchronous ``process_view`` the
same way: under uvicorn each hook is a trip to a thread and back, 15 per request for the
eight middleware below. Their hooks compute headers and lazy objects and touch no database,
so ``install`` (from ``RagsiteConfig.ready``) makes them run in the event loop; where a hook
may reach the database (a session to save, messages kept in the session) it still goes to
the thread, as Django does. Django raises ``SynchronousOnlyOperation`` for database access
from the event loop, so a hook that reached it unexpectedly would fail loudly, never
silently. Under WSGI nothing changes. Why, the figures, and why not subclasses (Django's
deploy checks find its middleware by dotted path): docs/architecture.md.
"""

from __future__ import annotations

import django
from asgiref.sync import sync_to_async
from csp.middleware import CSPMiddleware
from django.conf import settings
from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.core.exceptions import ImproperlyConfigured
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.csrf import CsrfViewMiddleware
from django.middleware.security import SecurityMiddleware

# The Django whose hooks were read for this (requirements.txt pins it).
DJANGO_VERIFIED = (5, 2)


def _session_needs_thread(request) -> bool:
    """The response saves the session when it changed."""
    session = getattr(request, "session", None)
    return session is not None and (session.modified or settings.SESSION_SAVE_EVERY_REQUEST)


def _messages_need_thread(request) -> bool:
    """Messages a view added or read are stored by the response, in the session when they
    overflow the cookie."""
    storage = getattr(request, "_messages", None)
    return storage is not None and (storage.used or storage.added_new)


def _never(request) -> bool:
    return False


# Each middleware whose hooks run in the event loop, and when its process_response needs the thread.
INLINE = {
    SecurityMiddleware: _never,
    CSPMiddleware: _never,
    SessionMiddleware: _session_needs_thread,  # process_request makes a lazy session
    CommonMiddleware: _never,
    CsrfViewMiddleware: _never,  # the token lives in a cookie (CSRF_USE_SESSIONS is checked)
    AuthenticationMiddleware: _never,  # request.user is lazy: read by a view, in its thread
    MessageMiddleware: _messages_need_thread,
    XFrameOptionsMiddleware: _never,
}


def _inline_acall(response_needs_thread):
    async def __acall__(self, request):
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            if response_needs_thread(request):
                response = await sync_to_async(self.process_response, thread_sensitive=True)(request, response)
            else:
                response = self.process_response(request, response)
        return response

    return __acall__


def _csrf_init(init):
    """Under ASGI the instance's ``process_view`` is a coroutine, which Django awaits as is."""

    def __init__(self, get_response):
        init(self, get_response)
        if self.async_mode:
            self.process_view = _csrf_process_view_inline.__get__(self)

    return __init__


async def _csrf_process_view_inline(self, request, callback, callback_args, callback_kwargs):
    return CsrfViewMiddleware.process_view(self, request, callback, callback_args, callback_kwargs)


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    own = [middleware.__name__ for middleware in INLINE if {"__call__", "__acall__"} & set(vars(middleware))]
    if django.VERSION[:2] != DJANGO_VERIFIED or own:
        raise ImproperlyConfigured(
            f"ragsite/async_middleware.py patches Django's middleware, verified on Django "
            f"{'.'.join(map(str, DJANGO_VERIFIED))}; this is {django.get_version()} "
            f"({', '.join(own) or 'none'} with a call of its own): check it and update DJANGO_VERIFIED"
        )
    for middleware, response_needs_thread in INLINE.items():
        if middleware is CsrfViewMiddleware and settings.CSRF_USE_SESSIONS:
            continue  # its hooks read and write the session: left to Django's threads
        if middleware is CsrfViewMiddleware:
            middleware.__init__ = _csrf_init(middleware.__init__)
        middleware.__acall__ = _inline_acall(response_needs_thread)
    _installed = True
